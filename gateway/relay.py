"""Relaying the decode's answer to the client as bytes.

SSE is forwarded chunk by chunk as it arrives, never parsed and never buffered whole; the
only inspection is of the stream's tail, to make sure a client always sees ``[DONE]``.
"""

from __future__ import annotations

import logging
import time

import aiohttp
from starlette.types import Send

from engine_shim.wire import SSE_DONE
from gateway.dispatch import Placement
from gateway.errors import BadGateway, GatewayError, UpstreamError
from gateway.metrics import GatewayMetrics
from gateway.upstream import Upstream

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
    first = True
    outcome = "ok"
    try:
        async for chunk in placement.response.content.iter_chunked(chunk_bytes):
            if first:
                metrics.ttft.observe(time.monotonic() - arrived)
                first = False
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            tail = (tail + chunk)[-len(SSE_DONE) - 2 :]
        if SSE_DONE not in tail:
            raise UpstreamError(str(placement.response.url), "stream ended without [DONE]")
    except (aiohttp.ClientError, TimeoutError, OSError, UpstreamError) as exc:
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
    upstream: Upstream,
    *,
    request_id: str,
    metrics: GatewayMetrics,
    arrived: float,
) -> str:
    """Non-streaming clients: the decode's JSON completion, read whole (it is bounded)."""
    try:
        body = await upstream.read_body(placement.response)
    except UpstreamError as exc:
        log.warning("decode %s failed: %s", placement.decode_id, exc)
        error: GatewayError = BadGateway("the decode instance failed before answering")
        body = bytes(error.response().body)
        status = error.status
    else:
        status = placement.response.status
    metrics.ttft.observe(time.monotonic() - arrived)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": headers + _headers(placement, request_id),
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})
    return "ok" if status == 200 else "upstream_error"
