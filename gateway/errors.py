"""The gateway's exception tree, written out once.

`GatewayError`s are what a client sees: each knows its HTTP status and OpenAI error type.
`UpstreamError`s are what an instance did; aiohttp errors are mapped to them at the boundary
(gateway/upstream.py) and the dispatcher decides which become a `GatewayError`.
"""

from __future__ import annotations

from starlette.responses import Response

from engine_shim.wire import error_body, error_json, sse_event


class GatewayError(Exception):
    status = 500
    type = "internal_error"
    code: str | None = None

    def __init__(
        self, message: str, *, param: str | None = None, retry_after: int | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after

    def response(self) -> Response:
        headers = {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}
        return Response(
            error_json(self.message, self.type, param=self.param, code=self.code),
            status_code=self.status,
            headers=headers,
            media_type="application/json",
        )

    def sse(self) -> bytes:
        """The in-band form, for failures after streaming began."""
        return sse_event(error_body(self.message, self.type, param=self.param, code=self.code))


class BadRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class ModelNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class ServiceUnavailable(GatewayError):
    """Retryable by the client: always carries Retry-After."""

    status = 503
    type = "service_unavailable"


class Overloaded(ServiceUnavailable):
    code = "gateway_overloaded"


class DeadlineExceeded(ServiceUnavailable):
    """No prefill (or decode) accepted the request before its TTFT deadline."""

    code = "ttft_deadline_exceeded"


class BadGateway(GatewayError):
    status = 502
    type = "upstream_error"
    code = "upstream_error"


# -- upstream (instance) failures; never shown to a client as-is ---------------------------


class UpstreamError(Exception):
    """An instance failed to serve a request."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(f"{url}: {message}")
        self.url = url


class UpstreamRejected(UpstreamError):
    """429: the instance has no free slot right now (the P/D-Serve rejection)."""


class UpstreamUnreachable(UpstreamError):
    """Connect failure, reset or timeout before an answer: try another instance."""


class UpstreamStatus(UpstreamError):
    """A non-2xx, non-429 answer."""

    def __init__(self, url: str, status: int, body: bytes) -> None:
        super().__init__(url, f"HTTP {status}")
        self.status = status
        self.body = body

    @property
    def is_client_error(self) -> bool:
        return 400 <= self.status < 500


class UpstreamProtocolError(UpstreamError):
    """The answer does not follow the P/D handshake (e.g. no kv_transfer_params)."""
