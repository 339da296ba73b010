"""The gateway's exception tree, written out once.

`GatewayError`s are what a client sees: each knows its HTTP status and OpenAI error type.
`UpstreamError`s are what an instance did; aiohttp errors are mapped to them at the boundary
(gateway/upstream/base.py) and the dispatcher decides which become a `GatewayError`.
"""

from __future__ import annotations

import errno
from collections.abc import Mapping
from typing import Any

from pdgate.config.openai_api import OpenAIError


class GatewayError(OpenAIError):
    """What a client sees: each subclass fixes its status, OpenAI error type and code, given
    as keywords of its class line (what it leaves out it inherits)."""

    status = 500
    type = "internal_error"
    code: str | None = None

    def __init_subclass__(
        cls,
        *,
        status: int | None = None,
        type_: str | None = None,
        code: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init_subclass__(**kwargs)
        if status is not None:
            cls.status = status
        if type_ is not None:
            cls.type = type_
        if code is not None:
            cls.code = code

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        retry_after: float | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        cls = type(self)
        super().__init__(
            cls.status,
            message,
            type_=cls.type,
            code=cls.code,
            param=param,
            retry_after=retry_after,
            headers=headers,
        )


class BadRequest(GatewayError, status=400, type_="invalid_request_error"): ...


class ContextLengthExceeded(BadRequest, code="context_length_exceeded"):
    """The prompt plus ``max_tokens`` do not fit in the model's context: no retry can help."""


class _ClientFault(GatewayError, type_="invalid_request_error"):
    """The request is at fault, though not its body's fields (those are `BadRequest`)."""


class RequestTimeout(_ClientFault, status=408, code="request_timeout"): ...


class PayloadTooLarge(_ClientFault, status=413, code="payload_too_large"): ...


class Unauthorized(_ClientFault, status=401, code="invalid_api_key"): ...


class Forbidden(_ClientFault, status=403, code="forbidden"): ...


class RateLimited(GatewayError, status=429, type_="rate_limit_error", code="rate_limit_exceeded"):
    """429: the client's key is over its requests per minute (gateway/admission/auth.py)."""


class NotFound(_ClientFault, status=404, code="not_found"): ...


class ModelNotFound(_ClientFault, status=404, code="model_not_found"): ...


class ServiceUnavailable(GatewayError, status=503, type_="service_unavailable"):
    """Retryable by the client: always carries Retry-After."""


class Overloaded(ServiceUnavailable, code="gateway_overloaded"): ...


class ShuttingDown(ServiceUnavailable, code="shutting_down"):
    """The gateway is stopping: another gateway can serve the request."""


class DeadlineExceeded(ServiceUnavailable, code="ttft_deadline_exceeded"):
    """No prefill (or decode) accepted the request before its TTFT deadline."""


class OverShare(GatewayError, status=429, type_="rate_limit_error", code="tenant_over_share"):
    """429, the one rule (gateway/placement/queue.py, "429 or 503"): other tenants are waiting
    too and this tenant already holds its share of the queue, so back off and retry; a request of a
    tenant under its share takes the place of an over-share tenant's newest, which gets this.
    503 means the fleet has no capacity for anyone: the deadline passed with no prefill free,
    the request could not be prefilled in time, or the queue is full with every tenant
    within its share."""


class BadGateway(GatewayError, status=502, type_="upstream_error", code="upstream_error"): ...


class DecodeLost(BadGateway):
    """A decode answered the decode leg with an error status before streaming: its KV pull may
    have consumed the prefill's copy, so the request must be placed again, prefill included."""


def from_openai_error(exc: OpenAIError) -> GatewayError:
    """A shared-schema or body-reading error as one of the gateway's own types, so its
    handlers and metrics see one tree."""
    kind: type[GatewayError] = {413: PayloadTooLarge, 408: RequestTimeout}.get(
        exc.status, BadRequest
    )
    return kind(exc.message, param=exc.param)


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

    @property
    def refused(self) -> bool:
        """Its connection was refused: nothing listens there, the instance is gone (a busy
        or hung instance still accepts connections, a stopped one does not)."""
        cause = self.__cause__
        while cause is not None:
            if isinstance(cause, ConnectionRefusedError) or (
                isinstance(cause, OSError) and cause.errno == errno.ECONNREFUSED
            ):
                return True
            cause = cause.__cause__
        return False


class DecodeSilent(UpstreamUnreachable):
    """A decode stopped answering every stream it serves (gateway/upstream/stalls.py): it is
    ejected, and each of its streams moves on."""


# The statuses by which an instance says the request itself is bad: the client hears them.
# Any other 4xx is the instance's or the fleet's fault, not the client's (401/403: the
# gateway's credentials; 404/405: a wrong URL or a model it stopped serving; 409, 408, ...):
# a failure like a 5xx, tried on another instance and counted towards ejection.
_CLIENT_FAULTS = frozenset({400, 413, 422})


def is_client_fault(status: int) -> bool:
    return status in _CLIENT_FAULTS


class UpstreamStatus(UpstreamError):
    """A non-2xx, non-429 answer."""

    def __init__(self, url: str, status: int, body: bytes) -> None:
        super().__init__(url, f"HTTP {status}")
        self.status = status
        self.body = body

    @property
    def is_client_error(self) -> bool:
        return is_client_fault(self.status)


class UpstreamProtocolError(UpstreamError):
    """The answer does not follow the P/D handshake (e.g. no kv_transfer_params)."""
