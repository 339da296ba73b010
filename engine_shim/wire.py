"""The wire format shared by the gateway and the shims.

It is vLLM's OpenAI API plus vLLM's disaggregation handshake (``kv_transfer_params``), so
the gateway can front real vLLM and any vLLM-compatible router can front these shims.

Handshake (DESIGN.md section 3):

1. gateway -> prefill ``POST /v1/completions``: the client body with ``max_tokens=1``,
   ``stream=false``, no ``stream_options`` and ``kv_transfer_params = prefill_kv_request()``.
   A prefill with no free slot answers 429 (OpenAI error body, ``Retry-After``) at once.
2. prefill -> gateway: a completion whose ``kv_transfer_params`` name where the KV lives
   (vLLM's NIXL field names: ``remote_engine_id``, ``remote_host``, ``remote_port``,
   ``remote_block_ids``, ``remote_request_id``).
3. gateway -> decode ``POST /v1/completions``: the client's body plus those params.
   The decode pulls ``GET {prefill}/v1/kv/{remote_request_id}`` (pdgate extension) and streams.
4. ``DELETE {prefill}/v1/kv/{remote_request_id}`` (pdgate extension) releases KV nobody will
   fetch (decode rejected, client gone); the prefill's hold timeout is the backstop.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

KV_PATH = "/v1/kv/{request_id}"
BATCH_PATH = "/v1/completions/batch"  # pdgate extension: several prefill legs in one call
LOAD_PATH = "/load"
HEALTH_PATH = "/health"

# Request header of the prefill leg: the caller's name for the KV handle (pdgate extension),
# so it can DELETE the KV of a call it abandoned without ever reading the answer.
KV_ID_HEADER = "x-pdgate-kv-id"

# Response headers of the KV pull.
KV_TOKENS_HEADER = "x-pdgate-kv-tokens"
KV_DIGEST_HEADER = "x-pdgate-kv-digest"  # blake2b-128 hex of the body, checked by the decode

SSE_DONE = b"data: [DONE]\n\n"


def prefill_kv_request() -> dict[str, Any]:
    """``kv_transfer_params`` the gateway sends to a prefill."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


def kv_release_url(base_url: str, kv_id: str) -> str:
    return base_url.rstrip("/") + KV_PATH.format(request_id=kv_id)


def kv_url(params: dict[str, Any]) -> str | None:
    """Where a decode pulls the KV named by a prefill's ``kv_transfer_params``."""
    host, port = params.get("remote_host"), params.get("remote_port")
    rid = params.get("remote_request_id")
    if not host or not port or not rid:
        return None
    # IPv6 literals need brackets in a URL.
    netloc = f"[{host}]" if ":" in str(host) and not str(host).startswith("[") else str(host)
    return f"http://{netloc}:{int(port)}" + KV_PATH.format(request_id=rid)


def error_body(
    message: str, type_: str, *, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    """An OpenAI error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_json(
    message: str, type_: str, *, param: str | None = None, code: str | int | None = None
) -> bytes:
    return orjson.dumps(error_body(message, type_, param=param, code=code))


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class OpenAIError(Exception):
    """A failure with its HTTP status and OpenAI error body: `response()` before anything was
    sent, `sse()` in-band once a stream has begun. Shared by the gateway and the shims."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, param=self.param, code=self.code)

    def response(self) -> Response:
        headers = {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}
        return Response(
            orjson.dumps(self.body()),
            status_code=self.status,
            headers=headers,
            media_type="application/json",
        )

    def sse(self) -> bytes:
        return sse_event(self.body())


class ClientGone(Exception):
    """The client disconnected; nothing can be sent to it any more."""


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, never holding more than `limit` bytes: a declared Content-Length over
    the limit is refused before reading, a chunked upload as soon as it passes it."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise OpenAIError(400, "invalid Content-Length header") from None
        if size > limit:
            raise OpenAIError(
                413, f"request body of {size} bytes exceeds {limit} bytes", code="payload_too_large"
            )
    chunks: list[bytes] = []
    total = 0
    try:
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                raise OpenAIError(
                    413, f"request body exceeds {limit} bytes", code="payload_too_large"
                )
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone from None
    return b"".join(chunks)
