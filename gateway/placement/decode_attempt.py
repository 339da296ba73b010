"""One try at a decode, for every way the gateway asks one: the decode leg of a disaggregated
request (gateway/placement/decode_leg.py), a local prefill (gateway/placement/local_prefill.py)
and an aggregated instance's whole request (gateway/placement/aggregated.py).

The try counts against the instance while it runs (open stream, request in flight) and has
its own trace span. When it fails, it gives those counts back, counts its outcome and notes
it on the instance (a 429: busy for a while; a failure: towards ejection) before the error
goes on to the caller, which decides what to try next.

Every leg's tries share the helpers below: whether the request's own time ran out
(`out_of_time`), the counts of a failed call (`release_after`), an instance's 4xx in the
client's words (`client_error`) and another try only within the retry budget
(`retry_or_fail`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from prometheus_client import Counter

from pdgate.config.tracing import Span, Tracing
from pdgate.gateway.errors import (
    BadGateway,
    BadRequest,
    GatewayError,
    PayloadTooLarge,
    UpstreamError,
    UpstreamRejected,
    UpstreamStatus,
    UpstreamUnreachable,
)
from pdgate.gateway.instances.health import Ejector, RetryBudget
from pdgate.gateway.instances.tracker import InstanceTracker, Lease
from pdgate.gateway.observe.metrics import GatewayMetrics, Labelled
from pdgate.gateway.upstream.base import (
    DecodeStream,
    Upstream,
    upstream_error_message,
    upstream_error_param,
)
from pdgate.policies.base import InstanceLoad

__all__ = [
    "PREFILL_PATH",
    "DecodeAttempts",
    "client_error",
    "out_of_time",
    "release_after",
    "retry_or_fail",
]

log = logging.getLogger("pdgate.dispatch")

PREFILL_PATH = "pdgate.prefill_path"  # span attribute: "local" or "disaggregated"


class DecodeAttempts:
    def __init__(
        self,
        tracker: InstanceTracker,
        upstream: Upstream,
        counter: Labelled[Counter],
        ejector: Ejector,
        tracing: Tracing,
    ) -> None:
        """`counter`: attempts by outcome (``pdgate_decode_attempts``)."""
        self._tracker = tracker
        self._upstream = upstream
        self._counter = counter
        self._ejector = ejector
        self._tracing = tracing

    async def open(
        self,
        inst: InstanceLoad,
        body: dict[str, Any],
        path: str,
        *,
        request_id: str,
        deadline: float,
        parent: Span | None,
        local: bool = False,
        held: tuple[Lease, Lease] | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[DecodeStream, Lease, Lease]:
        """The decode's open stream with its open-stream and in-flight leases, which the
        caller now owns; a failure raises the `open_decode` error, already accounted for
        (and gives the leases back). The connection must be made by `deadline`
        (``time.monotonic()``). `local`: the body is the whole request (no
        ``kv_transfer_params``). `held`: the open-stream and in-flight leases the caller
        already holds on `inst` (a queue's grant), used instead of new ones. `headers`: more
        to send."""
        if held is not None:
            stream, inflight = held
        else:
            stream, inflight = self._tracker.open_stream(inst.id), self._tracker.begin(inst.id)
        span = self._tracing.start("pdgate.decode_attempt", parent=parent)
        headers = dict(headers or {})
        self._tracing.inject(span, headers)
        if span.is_recording():
            span.set_attribute("pdgate.instance", inst.id)
            span.set_attribute("server.address", inst.url)
            if local:
                span.set_attribute(PREFILL_PATH, "local")
        try:
            response = await self._upstream.open_decode(
                inst.url,
                body,
                request_id=request_id,
                connect_timeout_s=max(deadline - time.monotonic(), 0.001),
                headers=headers,
                path=path,
            )
        except BaseException as exc:
            release_after(exc, stream, inflight)
            _end(span, self._note_failure(inst, exc, deadline))
            raise
        _end(span, "accepted")
        self._counter.labels("accepted").inc()
        return response, stream, inflight

    def _note_failure(self, inst: InstanceLoad, exc: BaseException, deadline: float) -> str:
        """Count the failed attempt and mark `inst`; the attempt's outcome."""
        if not isinstance(exc, UpstreamError):
            return "abandoned"  # cancelled: nothing to say about the instance
        if not isinstance(exc, UpstreamStatus | UpstreamRejected) and out_of_time(deadline):
            # The attempt's timeout was the request's deadline, not the decode's header
            # timeout: a decode too busy to answer in the time left has not failed.
            outcome = "deadline"
        elif isinstance(exc, UpstreamRejected):
            self._tracker.rejected(inst.id)
            outcome = "rejected"
        elif isinstance(exc, UpstreamStatus) and exc.is_client_error:
            outcome = "client_error"  # about the request, not the instance
        else:
            log.warning("decode %s failed: %s", inst.id, exc)
            self._tracker.failed(inst.id)
            if isinstance(exc, UpstreamUnreachable) and exc.refused:
                self._ejector.dead(inst.id, "decode")
            else:
                self._ejector.failure(inst.id, "decode")
            outcome = "failed"
        self._counter.labels(outcome).inc()
        return outcome


def out_of_time(deadline: float) -> bool:
    """Whether `deadline` (``time.monotonic()``) has passed, give or take a timer's lateness."""
    return time.monotonic() >= deadline - 0.001


def release_after(exc: BaseException, *leases: Lease) -> None:
    """Give back the counts of a call that failed with `exc`. A rejected or unreachable
    instance never took the request, so its end is no sign of a freed slot."""
    took_slot = not isinstance(exc, UpstreamRejected | UpstreamUnreachable)
    for lease in leases:
        lease.release(slot_freed=took_slot)


def client_error(exc: UpstreamStatus) -> GatewayError:
    """An instance said the request itself is bad: tell the client in its words."""
    message = upstream_error_message(exc)
    if exc.status == 413:
        return PayloadTooLarge(message)
    return BadRequest(message, param=upstream_error_param(exc))


def retry_or_fail(
    budget: RetryBudget,
    metrics: GatewayMetrics,
    exc: UpstreamError,
    what: str,
    *,
    free: bool = False,
) -> None:
    """Another try after a failed one, if the retry budget allows; a `free` one (the
    instance is known to be gone: `spends_budget`) always."""
    if not free and not budget.withdraw():
        # A fleet-wide failure must not multiply the load on what is left.
        metrics.retry_budget_exhausted.inc()
        raise BadGateway(f"{what}; not retried") from exc


def _end(span: Span, outcome: str) -> None:
    if span.is_recording():
        span.set_attribute("pdgate.outcome", outcome)
    span.end()
