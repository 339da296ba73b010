"""Aggregated and partial groups: one instance computes the prompt and streams the answer.

An aggregated group (its instances compute prompts and decode them: docs/strategies.md) has
one leg. The request waits in the same kind of queue as a prefill leg (deadline order, fleet
slot leases, drain admission: queues.py) for a slot on one instance, ranked by the
aggregated policy, or by rolling activation for a partial group (partial.py); that instance
is sent the whole request and streams the whole answer. A 429 or a failure gives the slot
back and the request queues again, until its deadline; a failure counts against the retry
budget.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from pdgate.config.wire import TPOT_SLO_HEADER, TTFT_LEFT_HEADER, Role
from pdgate.gateway.admission.retry_after import RetryAfter
from pdgate.gateway.errors import DeadlineExceeded, UpstreamError, UpstreamRejected, UpstreamStatus
from pdgate.gateway.instances.health import Ejector, RetryBudget, spends_budget
from pdgate.gateway.instances.tracker import InstanceTracker
from pdgate.gateway.observe.metrics import GatewayMetrics
from pdgate.gateway.placement.decode_attempt import (
    DecodeAttempts,
    client_error,
    out_of_time,
    retry_or_fail,
)
from pdgate.gateway.placement.forwarder import PrefillForwarder
from pdgate.gateway.placement.partial import PhaseView
from pdgate.gateway.placement.placed import LegRequest, Placement, as_stream, whole
from pdgate.gateway.placement.queue import Waiter
from pdgate.gateway.placement.queues import Queues

__all__ = ["WholeRequests"]


class WholeRequests:
    """Places a request of an aggregated (or partial) group on one instance."""

    def __init__(
        self,
        tracker: InstanceTracker,
        queues: Queues,
        attempts: DecodeAttempts,
        *,
        ejector: Ejector,
        budget: RetryBudget,
        metrics: GatewayMetrics,
        retry_after: RetryAfter,
    ) -> None:
        """`retry_after`: what a request whose instance did not answer in time is told."""
        self._retry_after = retry_after
        self._tracker = tracker
        self._queues = queues
        self._attempts = attempts
        self._ejector = ejector
        self._budget = budget
        self._metrics = metrics

    async def place(self, req: LegRequest, forward: dict[str, Any], path: str) -> Placement:
        """An instance that computes the prompt and decodes it takes the whole request:
        its placement, once the instance answered."""
        info = req.info
        body = as_stream(forward)  # as the decode leg of a disaggregated request
        view: PhaseView | None = None
        if self._tracker.partial(info.model, info.group):
            view = self._queues.phase_view(info)
        fwd = self._queues.get(info, Role.AGGREGATED, view)
        while True:
            waiter = Waiter(
                info=info,
                body={},
                request_id=req.request_id,
                deadline=req.deadline,
                future=asyncio.get_running_loop().create_future(),
                span=req.span,
                path=path,
            )
            slot = await fwd.acquire(waiter)
            inst = slot.instance
            slot.take()  # its two leases are the stream's now
            try:
                response, stream, inflight = await self._attempts.open(
                    inst,
                    body,
                    path,
                    request_id=req.request_id,
                    deadline=req.deadline,
                    parent=req.span,
                    local=True,
                    held=(slot.stream, slot.inflight),
                    headers=_whole_headers(req),
                )
            except UpstreamRejected:
                continue  # marked busy: the queue tries the others first
            except UpstreamStatus as exc:
                if exc.is_client_error:
                    raise client_error(exc) from exc
                self._retry_or_fail(inst.id, exc)
                continue
            except UpstreamError as exc:
                if out_of_time(req.deadline):
                    raise DeadlineExceeded(
                        "no instance answered before the TTFT deadline",
                        retry_after=self._late(fwd, waiter),
                    ) from exc
                self._retry_or_fail(inst.id, exc)
                continue
            # The prompt's work on the instance, until the first byte says it is computed.
            tokens = info.prompt_chars // 4 + 1
            on_first_byte = partial(self._ejector.success, inst.id)
            if view is not None:
                on_first_byte = partial(_prefilled, view, tokens, slot.answered_at, on_first_byte)
            placement = whole(
                response,
                inst,
                stream,
                inflight,
                self._tracker.work(inst.id, tokens),
                on_first_byte=on_first_byte,
                attempts=slot.attempts,
                rejections=slot.rejections,
            )
            if view is not None:
                view.routed(inst.id, placement, info.tpot_s)
            return placement

    def _late(self, fwd: PrefillForwarder, waiter: Waiter) -> float:
        """What a request is told whose instance took it and did not answer before its
        deadline. With no ready instance left that is not ejected, the wait until the
        gateway's next read of the membership, when a new one shows. Otherwise the instance
        was busy or slow, and its retry meets the queue: the queue tells it what it tells a
        request that expired in it, its place kept (admission.py). The instance that failed
        it tells nothing of when another has room."""
        info = waiter.info
        loads = self._tracker.loads(Role.AGGREGATED, info.model, info.group)
        if all(c.ejected for c in loads):
            return self._retry_after.membership()
        return fwd.admission.answered_late(waiter)

    def _retry_or_fail(self, instance_id: str, exc: UpstreamError) -> None:
        retry_or_fail(
            self._budget,
            self._metrics,
            exc,
            "the aggregated instances are failing",
            free=not spends_budget(self._tracker, instance_id, exc),
        )


def _prefilled(view: PhaseView, tokens: int, granted_at: float, then: Callable[[], None]) -> None:
    """A partial group's first byte: the view learns how long the prompt took."""
    view.prefilled(time.monotonic() - granted_at, tokens)
    then()


def _whole_headers(req: LegRequest) -> dict[str, str]:
    """What an aggregated instance is told of a request's SLOs (its phases hold to them)."""
    headers = {TTFT_LEFT_HEADER: _ms_left(req.deadline)}
    if req.info.tpot_s is not None:
        headers[TPOT_SLO_HEADER] = str(max(1, round(1000 * req.info.tpot_s)))
    return headers


def _ms_left(deadline: float) -> str:
    return str(max(1, round(1000 * (deadline - time.monotonic()))))
