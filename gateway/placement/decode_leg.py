"""The decode leg of a prefilled request: a decode that takes its KV, until its deadline.

The prefill's ``kv_transfer_params`` go to a decode chosen by the decode policy; a 429 tries
the next one (up to ``decode_candidates`` a round), then waits for a freed slot or a
back-off, until the deadline. While it waits for a decode that exists but is full, the
request waits in its line in `DecodeWaits` (resumed streams first, then by deadline; one
waiter woken per freed slot) and its queue holds its prefills (drain.py). A request that
finds others waiting before it for those decodes joins the line behind them. The leg always
streams, whatever the client asked: its first event is the moment the KV has left the
prefill (the decode pulls it before it generates), which is when the prefill's slot frees.

Failover: a decode that was never reached (refused, reset, timed out) is replaced by the
next one with the same ``kv_transfer_params`` (the KV is still at the prefill); one that
answered with an error status may have consumed the KV, so `place` raises `DecodeLost` and
the caller places the request again, prefill included (gateway/stream/relay.py). Either
counts against the retry budget, as prefill failovers do, unless the decode is known to be
gone (a refused connection ejects it at once; gateway/instances/health.py).
"""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import Any

from pdgate.config.aio import Backoff
from pdgate.config.settings import GatewaySettings
from pdgate.config.wire import UNKNOWN_KV_SOURCE, Role
from pdgate.gateway.admission.retry_after import RetryAfter
from pdgate.gateway.errors import (
    BadGateway,
    DeadlineExceeded,
    DecodeLost,
    UpstreamError,
    UpstreamRejected,
    UpstreamStatus,
)
from pdgate.gateway.instances.health import RetryBudget, spends_budget
from pdgate.gateway.instances.tracker import InstanceTracker, Lease
from pdgate.gateway.observe.metrics import GatewayMetrics
from pdgate.gateway.placement.decode_attempt import (
    DecodeAttempts,
    client_error,
    out_of_time,
    retry_or_fail,
)
from pdgate.gateway.placement.drain import DecodeCapacity, DecodeTurn, DecodeWaits
from pdgate.gateway.placement.handoff import Handoffs
from pdgate.gateway.placement.placed import LegRequest
from pdgate.gateway.upstream.base import DecodeStream, upstream_error_code
from pdgate.policies.base import InstanceLoad, Ranker, RequestInfo

__all__ = ["DecodeLegs", "declaring", "until_decode_room"]


class DecodeLegs:
    """Places decode legs: ranks the decodes, tries them in rounds, waits between rounds."""

    def __init__(
        self,
        settings: GatewaySettings,
        tracker: InstanceTracker,
        attempts: DecodeAttempts,
        policy: Ranker,
        *,
        waits: DecodeWaits,
        backoff: Backoff,
        budget: RetryBudget,
        metrics: GatewayMetrics,
        handoffs: Handoffs | None = None,
        retry_after: RetryAfter,
        capacity: DecodeCapacity | None = None,
    ) -> None:
        """`handoffs`: which decodes take a stock prefill's KV (handoff.py); `retry_after`
        and `capacity`: what a request refused for want of a decode is told to wait."""
        self._retry_after = retry_after
        self._capacity = capacity
        self._handoffs = handoffs
        self._candidates = settings.decode_candidates
        self._tracker = tracker
        self._attempts = attempts
        self._policy = policy
        self._waits = waits
        self._backoff = backoff
        self._budget = budget
        self._metrics = metrics

    async def place(
        self,
        req: LegRequest,
        body: dict[str, Any],
        path: str,
        *,
        extension: str | None = None,
        avoid: Collection[str] = (),
        connector: str | None = None,
    ) -> tuple[InstanceLoad, DecodeStream, list[Lease]]:
        """A decode that opened `req`'s stream with `body` (one declaring `extension`, if
        given; of a stock prefill's `connector`, if given; those in `avoid` tried last), its
        stream and the leases the caller now owns."""
        info, deadline = req.info, req.deadline
        round_no = 0
        failures: list[str] = []
        waits = self._waits
        # In the line for a decode slot (drain.py): the queue holds its prefills meanwhile.
        turn: DecodeTurn | None = None
        placed = False
        try:
            while True:
                candidates = declaring(self._tracker, Role.DECODE, info, extension)
                if connector is not None and self._handoffs is not None:
                    candidates = self._handoffs.decodes(connector, candidates)
                if (
                    turn is None
                    and candidates
                    and waits.ahead(info.model, info.group, deadline, resumed=req.retry)
                ):
                    # Others wait before it for these decodes: behind them, not past them.
                    turn = waits.join(info.model, info.group, deadline, resumed=req.retry)
                    await waits.wait(turn, self._wait_s(round_no, deadline))
                    round_no += 1
                    continue
                ranked = self._policy.rank(info, candidates)
                if avoid:
                    ranked = [c for c in ranked if c.id not in avoid] + [
                        c for c in ranked if c.id in avoid
                    ]
                result = await self._round(req, body, path, ranked, failures)
                if result is not None:
                    placed = True
                    return result
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if failures and not ranked:
                        last = failures[-1]
                        raise BadGateway(f"every decode instance failed; last error: {last}")
                    what = (
                        "no decode instance is available"
                        if not ranked
                        else "no decode instance accepted the request before its TTFT deadline"
                    )
                    raise DeadlineExceeded(what, retry_after=self._room(info))
                if turn is None and candidates:
                    # Decodes there are, all full: wait in line for a freed slot.
                    turn = waits.join(info.model, info.group, deadline, resumed=req.retry)
                if turn is not None:
                    await waits.wait(turn, self._wait_s(round_no, deadline))
                else:
                    await self._tracker.wait_freed(self._wait_s(round_no, deadline))
                round_no += 1
        finally:
            if turn is not None:
                waits.leave(turn, placed=placed)

    def _wait_s(self, round_no: int, deadline: float) -> float:
        return min(self._backoff.delay(round_no), deadline - time.monotonic())

    def _room(self, info: RequestInfo) -> float:
        """Until the decodes have taken the prefilled requests waiting for them."""
        waiting = self._waits.waiting(info.model, info.group)
        return until_decode_room(self._retry_after, self._capacity, info, waiting)

    async def _round(
        self,
        req: LegRequest,
        body: dict[str, Any],
        path: str,
        ranked: list[InstanceLoad],
        failures: list[str],
    ) -> tuple[InstanceLoad, DecodeStream, list[Lease]] | None:
        """One round: the first of `ranked` (up to `decode_candidates`) that accepts the
        decode leg; None when none did (full, or failing: each failure added to `failures`)."""
        deadline = req.deadline
        for inst in ranked[: self._candidates]:
            if time.monotonic() >= deadline:
                break
            try:
                response, stream, inflight = await self._attempts.open(
                    inst,
                    body,
                    path,
                    request_id=req.request_id,
                    deadline=deadline,
                    parent=req.span,
                )
            except UpstreamRejected:
                continue
            except UpstreamStatus as exc:
                if upstream_error_code(exc) == UNKNOWN_KV_SOURCE:
                    # The decode does not know this prefill yet: its view of the
                    # registry lags ours (as across a Redis failover). It pulled
                    # nothing, so another decode, or this one after a back-off, may.
                    failures.append(str(exc))
                    continue
                if exc.is_client_error:
                    raise client_error(exc) from exc
                # It answered: its KV pull may have consumed the prefill's copy, so
                # another decode cannot be given the same kv_transfer_params.
                raise DecodeLost("the decode instance failed") from exc
            except UpstreamError as exc:
                if out_of_time(deadline):
                    # The request's own time ran out while the decode was answering
                    # (a busy decode, past capacity): shed it as the queue does, not as
                    # a broken decode.
                    raise DeadlineExceeded(
                        "no decode instance answered before the TTFT deadline",
                        retry_after=self._room(req.info),
                    ) from exc
                failures.append(str(exc))
                retry_or_fail(
                    self._budget,
                    self._metrics,
                    exc,
                    "the decode instances are failing",
                    free=not spends_budget(self._tracker, inst.id, exc),
                )
                continue  # never reached it: the KV is still at the prefill
            return inst, response, [stream, inflight]
        return None


def declaring(
    tracker: InstanceTracker, role: Role, info: RequestInfo, extension: str | None
) -> list[InstanceLoad]:
    """The ready instances of `role` for `info`'s model and group, those declaring
    `extension` only (if given)."""
    loads = tracker.loads(role, info.model, info.group)
    if extension is None:
        return loads
    records = tracker.records()
    return [
        c for c in loads if (rec := records.get(c.id)) is not None and extension in rec.extensions
    ]


def until_decode_room(
    retry_after: RetryAfter, capacity: DecodeCapacity | None, info: RequestInfo, waiting: int
) -> float:
    """What a request refused for want of a decode is told: until the decodes of `info`'s
    model and group, at their pace (slots over the time a request holds one), have taken the
    `waiting` requests (itself included) beyond their free slots. The floor where that pace
    is not known (`DecodeCapacity.bound`)."""
    bound = None if capacity is None else capacity.bound(info.model, info.group)
    if bound is None:
        return retry_after.floor_s
    return retry_after.drain(waiting - bound.free, bound.per_s)
