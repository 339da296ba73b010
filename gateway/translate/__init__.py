"""Front doors: client APIs served as internal chat requests.

A request to the Responses API (`responses.py`) or to Anthropic Messages (`messages.py`) is
translated into one chat completions request, which goes through the same admission, queue,
P/D legs, migration, metrics and traces as a client's chat request
(gateway/api/completions.py); a `Shaper` turns its chat events back into the API's answer
or stream (gateway/stream/out.py). `base.py` holds what both share: the `Front` seam and the
reader of chat events. docs/api.md says what each API supports and why the gateway
translates rather than passing the API through to the engines.

May import: errors, observe, upstream, instances, admission, placement, stream.
"""
