"""Reading a client's request body within the gateway's limit."""

from __future__ import annotations

from starlette.requests import Request

from engine_shim.wire import ClientGone, OpenAIError
from engine_shim.wire import read_body as read_limited
from gateway.errors import BadRequest, PayloadTooLarge

__all__ = ["ClientGone", "read_body"]


async def read_body(request: Request, limit: int) -> bytes:
    try:
        body = await read_limited(request, limit)
    except OpenAIError as exc:
        # Re-raised as the gateway's own types, so its handlers and metrics see one tree.
        raise (PayloadTooLarge if exc.status == 413 else BadRequest)(exc.message) from exc
    if not body:
        raise BadRequest("request body is empty; expected a JSON object")
    return body
