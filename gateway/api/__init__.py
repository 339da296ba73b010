"""The HTTP surface: ``/v1/completions`` and ``/v1/chat/completions`` (`completions`), the
admin and health endpoints (`admin`), the operator's page (`dashboard`, `static/`).

May import every stage below it; app.py wires these into the ASGI app."""
