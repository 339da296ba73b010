"""Relaying the decode's answer to the client.

Streaming clients get the decode's SSE as bytes, chunk by chunk as it arrives, never parsed
and never buffered whole; the only inspection is for the first event (the KV has left the
prefill: its slot is free) and of the stream's tail, so a client always sees ``[DONE]``.
Non-streaming clients get the stream assembled into one JSON answer (bounded in size); a
failure before the end is then still a real HTTP status.
"""

from __future__ import annotations

import logging
import time

import orjson
from starlette.types import Send

from pdgate.config.wire import SSE_DONE
from pdgate.gateway._assemble import Assembler, StreamError, sse_events
from pdgate.gateway.dispatch import Placement
from pdgate.gateway.errors import BadGateway, GatewayError, UpstreamError
from pdgate.gateway.metrics import ANY_GROUP, GatewayMetrics

log = logging.getLogger("pdgate.relay")

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # tell nginx-style proxies in front not to buffer
]


def _headers(placement: Placement, request_id: str) -> list[tuple[bytes, bytes]]:
    return [
        (b"x-request-id", request_id.encode("latin-1")),
        (b"x-pdgate-prefill", placement.prefill_id.encode("latin-1")),
        (b"x-pdgate-decode", placement.decode_id.encode("latin-1")),
    ]


async def relay_stream(
    placement: Placement,
    send: Send,
    *,
    request_id: str,
    chunk_bytes: int,
    metrics: GatewayMetrics,
    arrived: float,
    group: str = ANY_GROUP,
) -> str:
    """Stream the decode's SSE to the client; returns the outcome label for metrics."""
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": _SSE_HEADERS + _headers(placement, request_id),
        }
    )
    tail = b""
    last = 0.0  # when the previous data chunk arrived (0: none yet)
    itl = metrics.itl
    outcome = "ok"
    try:
        async for chunk in placement.stream.chunks(chunk_bytes):
            # A keep-alive comment is not an event: only data says the KV has arrived.
            if b"data:" in chunk:
                now = time.monotonic()
                if last:
                    itl.observe(now - last)
                    placement.gaps_s += now - last
                else:
                    placement.first_byte()
                    metrics.ttft.labels(group).observe(now - arrived)
                placement.tokens += chunk.count(b"data:")
                last = now
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            tail = (tail + chunk)[-len(SSE_DONE) - 2 :]
        if SSE_DONE not in tail:
            raise UpstreamError(placement.stream.url, "stream ended without [DONE]")
    except UpstreamError as exc:
        # Streaming began: the failure can only be reported in-band.
        log.warning("decode stream %s broke: %s", placement.decode_id, exc)
        error = BadGateway("the decode instance failed mid-stream")
        await send(
            {"type": "http.response.body", "body": error.sse() + SSE_DONE, "more_body": True}
        )
        outcome = "upstream_error"
    await send({"type": "http.response.body", "body": b"", "more_body": False})
    return outcome


async def relay_whole(
    placement: Placement,
    send: Send,
    *,
    request_id: str,
    chunk_bytes: int,
    max_bytes: int,
    metrics: GatewayMetrics,
    arrived: float,
    group: str = ANY_GROUP,
) -> str:
    """Non-streaming clients: the decode's stream assembled into one JSON completion."""
    assembler = Assembler()
    last = 0.0
    buffer = bytearray()
    size = 0
    error: GatewayError | None = None
    try:
        async for chunk in placement.stream.chunks(chunk_bytes):
            size += len(chunk)
            if size > max_bytes:
                raise StreamError(f"the decode's answer is larger than {max_bytes} bytes")
            buffer += chunk
            for data in sse_events(buffer):
                assembler.feed(data)
                if assembler.events == 1:
                    placement.first_byte()
                    last = time.monotonic()
                elif assembler.events > 1:
                    now = time.monotonic()
                    placement.gaps_s += now - last
                    last = now
                placement.tokens = assembler.events
            if assembler.done:
                break
        if not assembler.done:
            raise UpstreamError(placement.stream.url, "stream ended without [DONE]")
        body = orjson.dumps(assembler.result())
    except (UpstreamError, StreamError) as exc:
        log.warning("decode %s failed before its answer was whole: %s", placement.decode_id, exc)
        error = BadGateway("the decode instance failed before answering")
        body = orjson.dumps(error.body())
    metrics.ttft.labels(group).observe(time.monotonic() - arrived)
    status = 200 if error is None else error.status
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": headers + _headers(placement, request_id),
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})
    return "ok" if error is None else "upstream_error"
