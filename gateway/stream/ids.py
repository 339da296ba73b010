"""One id per request: the answer's ``id`` is the ``x-request-id`` the gateway sends back.

pdgate's shims already answer with the request id the gateway sent them, so their streams
pass through untouched after the first event. A stock decode answers with an id of its own
(vLLM: ``cmpl-`` + the ``x-request-id`` it was sent, or a random one); for such a stream the
JSON-encoded old id is replaced by the request's in every event. Only whole events are
rewritten (an id split across two reads is never missed), and an event is passed on as soon as
its blank line has arrived, so the rewrite adds no latency.
"""

from __future__ import annotations

import orjson

__all__ = ["StreamIds"]

_SEPARATORS = (b"\n\n", b"\r\n\r\n", b"\r\r")


def _end_of_events(buffer: bytearray) -> int:
    """Length of the leading run of whole events in `buffer` (0: none yet)."""
    end = 0
    for sep in _SEPARATORS:
        at = buffer.rfind(sep)
        if at >= 0:
            end = max(end, at + len(sep))
    return end


def _first_id(events: bytes) -> bytes | None:
    """The JSON-encoded ``id`` of the first data event that has one (None: none yet)."""
    for line in events.splitlines():
        if not line.startswith(b"data:"):
            continue
        try:
            event = orjson.loads(line[5:])
        except orjson.JSONDecodeError:
            continue  # [DONE], or a multi-line event: not an answer chunk
        if isinstance(event, dict) and isinstance(event.get("id"), str):
            return orjson.dumps(event["id"])
    return None


class StreamIds:
    """Feed it a decode's SSE chunks in order; it returns what to send (possibly b"") and,
    at the end, `flush()` what it still holds."""

    __slots__ = ("_buffer", "_new", "_old", "_passing")

    def __init__(self, request_id: str) -> None:
        self._new = orjson.dumps(request_id)
        self._old: bytes | None = None  # set once a stream turns out to carry another id
        self._passing = False  # the stream already carries the request id
        self._buffer = bytearray()

    def feed(self, chunk: bytes) -> bytes:
        if self._passing:
            return chunk
        if self._old is not None and not self._buffer and chunk.endswith(_SEPARATORS):
            # The usual chunk of a stock decode's stream: whole events, nothing held back.
            return chunk.replace(self._old, self._new)
        self._buffer += chunk
        cut = _end_of_events(self._buffer)
        if not cut:
            return b""
        ready = bytes(self._buffer[:cut])
        del self._buffer[:cut]
        if self._old is None:
            found = _first_id(ready)
            if found is None:
                return ready  # pings or an error event so far: nothing to decide on
            if found == self._new:
                self._passing = True
                rest = bytes(self._buffer)
                self._buffer.clear()
                return ready + rest
            self._old = found
        return ready.replace(self._old, self._new)

    def flush(self) -> bytes:
        rest = bytes(self._buffer)
        self._buffer.clear()
        return rest if self._old is None else rest.replace(self._old, self._new)
