"""HTTP plumbing shared by the prefill shim and the decode worker.

* `ApiError`: a failure with its HTTP status and OpenAI error body (and its in-band SSE form).
* `until_disconnect`: run work while watching the client; a disconnect cancels the work.
* `ClosingStreamingResponse`: a streaming response whose clean-up runs exactly once on every
  path (finished, client gone, never started, server shut down).
* `ClusterAuth`: the fleet's cluster token, checked on every request that makes the shim
  compute, hold or hand out KV, and sent on the decode's own calls to prefills.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pdgate.config.aio import run_unless, wait_disconnect
from pdgate.config.openai_api import ClientGone, OpenAIError

T = TypeVar("T")


# One error type for the gateway and the shims (pdgate.config.openai_api).
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


def conflict(message: str, *, code: str, param: str | None = None) -> ApiError:
    return ApiError(409, message, code=code, param=param)


class ClusterAuth:
    """``Authorization: Bearer <cluster token>`` on the shims' request paths.

    Only members of the fleet (gateways, decodes pulling KV) hold the token; without it a
    caller could run prompts on the engine, read another request's KV (``GET /v1/kv/{id}``)
    or throw it away (``DELETE``). Digests are compared in constant time, so response times
    say nothing about how much of a guess was right. With no token configured every caller
    is let in (the shim then refuses to listen beyond loopback unless told otherwise:
    `pdgate.engine_shim.app.check_exposure`)."""

    __slots__ = ("_digest", "_header")

    def __init__(self, token: str | None) -> None:
        self._digest = None if not token else hashlib.sha256(token.encode()).digest()
        self._header = {} if not token else {"authorization": f"Bearer {token}"}

    @property
    def enabled(self) -> bool:
        return self._digest is not None

    @property
    def headers(self) -> Mapping[str, str]:
        """What this shim sends on its own calls to other members (KV pulls, releases)."""
        return self._header

    def check(self, request: Request) -> None:
        """Raises a 401 `ApiError` unless the request carries the cluster token."""
        if self._digest is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        presented = hashlib.sha256(token.strip().encode()).digest()
        # Both compared whatever the scheme, so a malformed header takes as long as a wrong one.
        if not hmac.compare_digest(presented, self._digest) or scheme.lower() != "bearer":
            raise ApiError(
                401,
                "this instance accepts requests from its cluster only: send the cluster token "
                "as 'Authorization: Bearer <token>'",
                code="invalid_api_key",
            )


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work` (after the body was read); if the client disconnects first, cancel it,
    let it unwind and raise `ClientGone`. The gateway's rule: a result that arrives when
    nobody will take it is closed (`pdgate.config.aio.run_unless`)."""
    watcher = asyncio.ensure_future(wait_disconnect(request.receive))
    try:
        return await run_unless(work, watcher, lost=ClientGone())
    finally:
        watcher.cancel()


class ClosingStreamingResponse(StreamingResponse):
    """A `StreamingResponse` that calls `on_close` once after it ends, however it ends."""

    def __init__(self, *args: Any, on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await close_body(self.body_iterator, self._on_close)


async def close_body(body: object, on_close: Callable[[], None]) -> None:
    """A streaming response's end: close its body iterator, then call `on_close`. The
    iterator's own `finally` (which may count the request as cancelled) runs before the slot
    is released, even when the response was cancelled before it started iterating."""
    aclose = getattr(body, "aclose", None)
    try:
        if aclose is not None:
            await aclose()
    finally:
        on_close()
