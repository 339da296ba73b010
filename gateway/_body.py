"""Reading a request body without ever holding more than the limit."""

from __future__ import annotations

from starlette.requests import ClientDisconnect, Request

from gateway.errors import BadRequest, PayloadTooLarge


class ClientGone(Exception):
    """The client disconnected; nothing more can be sent to it."""


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError as exc:
            raise BadRequest("invalid Content-Length header") from exc
        if size > limit:
            raise PayloadTooLarge(
                f"request body of {size} bytes exceeds the limit of {limit} bytes"
            )
    chunks: list[bytes] = []
    total = 0
    try:
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                # Chunked uploads have no Content-Length: stop reading at the limit.
                raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect as exc:
        raise ClientGone from exc
    if total == 0:
        raise BadRequest("request body is empty; expected a JSON object")
    return b"".join(chunks)
