"""The HTTP surface: ``/v1/completions`` and ``/v1/chat/completions`` (`completions`, which
also serves ``/v1/responses`` and ``/v1/messages`` as chat requests: gateway/translate/),
stored responses (`responses`), the admin and health endpoints (`admin`), the operator's
page (`dashboard`, `static/`).

May import every stage below it; app.py wires these into the ASGI app."""
