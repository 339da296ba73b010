"""HTTP plumbing shared by the prefill shim and the decode worker.

* `ApiError`: a failure with its HTTP status and OpenAI error body (and its in-band SSE form).
* `read_body`: the request body, never more than a limit held in memory.
* `until_disconnect`: run work while watching the client; a disconnect cancels the work.
* `ClosingStreamingResponse`: a streaming response whose clean-up runs exactly once on every
  path (finished, client gone, never started, server shut down).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from engine_shim.wire import ClientGone, OpenAIError

T = TypeVar("T")


# One error type and one body reader for the gateway and the shims (engine_shim/wire.py).
ApiError = OpenAIError


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def busy(message: str, *, code: str) -> ApiError:
    """429: the P/D-Serve rejection; the caller retries here or elsewhere."""
    return ApiError(429, message, type_="rate_limit_error", code=code, retry_after=1)


def draining() -> ApiError:
    return ApiError(
        503, "instance is draining", type_="service_unavailable", code="draining", retry_after=1
    )


def json_response(
    payload: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    return Response(
        orjson.dumps(payload), status_code=status, headers=headers, media_type="application/json"
    )


async def _disconnected(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work` (after the body was read); raise `ClientGone` and cancel it if the client
    disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            # Let the work unwind (free its slot) before the caller goes on.
            await asyncio.wait((task,))
    if task.cancelled():
        raise ClientGone
    return task.result()


class ClosingStreamingResponse(StreamingResponse):
    """A `StreamingResponse` that calls `on_close` once after it ends, however it ends."""

    def __init__(self, *args: Any, on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Closing the body iterator first makes its own `finally` run before the slot is
            # released, even when the response was cancelled before it started iterating.
            aclose = getattr(self.body_iterator, "aclose", None)
            try:
                if aclose is not None:
                    await aclose()
            finally:
                self._on_close()
