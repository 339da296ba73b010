"""Admission and shedding for one (model, group) queue: take, refuse or shed a request.

The forwarder (forwarder.py) sends what its queue holds; this unit decides what the queue
holds. On arrival (`QueueAdmission.admit`) a request gets its latest start (the queue's start
guard: its deadline minus a pessimistic estimate of its prefill, queue.py), then, in order:

1. **Drain admission** (drain.py): refused with 503 and ``Retry-After`` when the fleet's recent
   pace, bounded by what the decodes can take, cannot bring it to the front of this queue
   before its deadline. Under heavy overload it keeps headroom below the pace's reach
   (`drain_headroom`), and at most every `_SWEEP_S` an arrival sweeps the queue for requests
   the pace cannot reach either (`drain_sweep`). A request admitted before (a failover, a
   stream continuing after its decode broke) is neither refused nor swept.
2. **The queue's bound and the tenants' shares** (queue.py, "429 or 503"): a full queue
   answers 503, unless the request's tenant is under its share, when it takes the place of an
   over-share tenant's newest request, which is told 429; a tenant over its share gets 429.

A refused request's place is kept for its retry (places.py): the same request sent again
goes where its first try stood, as its Retry-After counted. With places or without, the
refused requests told to come back count ahead of the next one refused, as far as the
queue's refused do come back (places.py, `AwaitedRetries`).

Once queued, a request is shed (503, without a prefill call) when its prefill would likely
end past its deadline (early drop, `hopeless`, checked by the forwarder at the head and while
it forms a batch) or when its deadline passes (`expire`). While a prefilled request of the
queue's model and group waits for a decode, the forwarder holds the queue's prefills
(`decodes_full`, drain.py's `DecodeWaits`). When the gateway stops, every queued request and
every one that would queue fails at once (`shed`).

The pace is made of what the forwarder reports: each grant (`granted`), the moments it finds
no prefill for a queued request (`saturated`) and the queue empties (`drained`), and the
grants the fleet's other gateways report (`reported`; this gateway's go out with its next
sync, `take_grants`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

from pdgate.gateway.admission.retry_after import RetryAfter
from pdgate.gateway.errors import DeadlineExceeded, GatewayError, Overloaded, OverShare
from pdgate.gateway.observe.metrics import GatewayMetrics
from pdgate.gateway.placement.drain import (
    ArrivalRate,
    DecodeCapacity,
    DecodeWaits,
    Pace,
    QueueDrain,
)
from pdgate.gateway.placement.places import AwaitedRetries, Places
from pdgate.gateway.placement.prefill_time import PrefillTimes
from pdgate.gateway.placement.queue import Admission, Waiter, WaitQueue

__all__ = ["AdmissionOptions", "QueueAdmission"]

# The prefill-time quantile behind a request's latest start (the queue's start guard).
_GUARD_QUANTILE = 0.9
# How often drain admission looks through the whole queue (O(n log n)) for requests the pace
# cannot reach: often enough that none waits long for a 503 it will get anyway.
_SWEEP_S = 0.5
# Places are kept for refused requests while arrivals come at most this many times as fast
# as the pace serves (`_tell`).
_PLACES_UP_TO = 2.0
# The refused requests followed for their retries, as a multiple of the queue's bound.
_AWAITED_PER_QUEUED = 4


@dataclass(frozen=True)
class AdmissionOptions:
    # What a refused request is told to wait (retry_after.py).
    retry_after: RetryAfter = field(default_factory=RetryAfter)
    # Answer 503 at once for a queued request even an optimistic prefill cannot serve in time.
    early_drop: bool = True
    # The quantile of recent prefill rates behind the early-drop estimate.
    prefill_estimate_quantile: float = 0.9
    # Answer 503 on arrival for a request the fleet's recent pace cannot bring to the front
    # of this queue in time.
    drain_admission: bool = True
    # ... and refuse the queued requests it cannot reach either (a sweep twice a second).
    drain_sweep: bool = True
    # Under heavy overload admit only within this fraction below what the pace reaches, so
    # that the pace's usual swings do not make the sweep refuse later what was admitted.
    drain_headroom: float = 0.3
    # Hold a queue's prefills while a prefilled request of its model and group waits for a
    # decode (drain.py, `DecodeWaits`).
    decode_backpressure: bool = True
    # Keep a refused request's place for its retry (places.py): first come, first served
    # across retries, at the price of throughput where the refused are the costly requests.
    retry_keeps_place: bool = False


class QueueAdmission:
    """What one queue takes, refuses and sheds, with the pace and headroom it judges by.

    `prefill_times` are the queue's measured prefill times (the forwarder records them): the
    start guard's and early drop's estimates. `decode_capacity` bounds the pace and
    `decode_waits` holds the queue for a decode; both None for a queue of aggregated
    instances (a slot there is the whole request: its grants are its pace)."""

    def __init__(
        self,
        queue: WaitQueue,
        prefill_times: PrefillTimes,
        metrics: GatewayMetrics,
        options: AdmissionOptions,
        *,
        model: str,
        group: str | None,
        decode_capacity: DecodeCapacity | None = None,
        decode_waits: DecodeWaits | None = None,
    ) -> None:
        self.queue = queue
        self._prefill_times = prefill_times
        self._metrics = metrics
        self._options = options
        self._model = model
        self._group = group
        self._decode_capacity = decode_capacity
        self._decode_waits = decode_waits
        self._shed: GatewayError | None = None  # the gateway stops: what waiters get now
        self._drain = QueueDrain()  # the fleet's grants: ours, and the others' as reported
        self._arrivals = ArrivalRate()  # those drain admission judges
        self._grants_new = 0  # ours since the last `take_grants`
        self._next_sweep = 0.0  # monotonic: when drain admission may sweep the queue next
        self._places = Places(queue.max_size) if options.retry_keeps_place else None
        self._awaited = AwaitedRetries(_AWAITED_PER_QUEUED * queue.max_size)

    @property
    def shedding(self) -> GatewayError | None:
        """What every request that would queue is told now (None: the gateway serves)."""
        return self._shed

    def admit(self, waiter: Waiter) -> None:
        """Queue `waiter`, or raise what it is told instead (503 or 429, module docstring)."""
        if self._shed is not None:
            raise self._shed
        if not waiter.admitted:
            now = time.monotonic()
            self._awaited.back(waiter.info, now)
            if self._places is not None:
                waiter.place = self._places.take(waiter.info, now)
                if waiter.place is not None:
                    self._metrics.queue_places.labels("taken").inc()
        # Started by then, it most likely makes its deadline (the queue's start guard).
        estimate = self._prefill_times.upper_bound_s(waiter.info.prompt_chars, _GUARD_QUANTILE)
        if estimate is not None:
            waiter.latest_start = waiter.deadline - estimate
        late = None
        if self._options.drain_admission and not waiter.admitted:
            late = self._too_late(waiter)
        if late is not None:
            self._metrics.queue_sheds.labels("drain").inc()
            raise self._out_of_reach(self._tell(waiter, late))
        admission = self.queue.push(waiter)
        if admission is Admission.FULL:
            # Under its tenant's share: it takes the place of an over-share tenant's newest
            # request (queue.py, "429 or 503").
            displaced = self.queue.displace_for(waiter)
            if displaced is not None:
                if not displaced.future.done():
                    displaced.future.set_exception(self._over_share(displaced))
                admission = self.queue.push(waiter)
        if admission is Admission.FULL:
            self._metrics.queue_sheds.labels("full").inc()
            now = time.monotonic()
            pace = self._pace(now)
            leave = self._retry_ahead(waiter)
            if pace is not None:  # and at least until the queue has room for it
                leave = max(leave, self._wait(self.queue.overflow(), pace.per_s, now))
            raise Overloaded(
                "the gateway's queue for this model and group is full",
                retry_after=self._tell(waiter, leave),
            )
        if admission is Admission.OVER_SHARE:
            self._metrics.queue_sheds.labels("over_share").inc()
            raise self._over_share(waiter)

    def _too_late(self, waiter: Waiter) -> float | None:
        """Would the requests ahead here, drained at the fleet's pace while this queue is
        saturated (and no faster than its decodes allow), hold `waiter` past its deadline?
        If so, the Retry-After to tell it; None: no. (drain.py; the exact count only past
        the cheap bound: a refusal storm's every arrival asks.) With `drain_sweep`, at most
        every `_SWEEP_S`, the queued requests the pace cannot reach either are refused too:
        those admitted while the pace still counted a backlog's first grants, which fill
        idle slots."""
        now = time.monotonic()
        self._arrivals.arrived(now)
        if not self.queue:
            return None
        pace = self._pace(now)
        if pace is None:
            return None
        # Under heavy overload admission keeps headroom below the reach, and the sweep as much
        # above it: a request admitted at the edge would be refused late by any dip in the
        # pace, and one refused late has waited for nothing while its place goes to a new
        # arrival, not to a grant (drain.py).
        headroom = self._headroom(now, pace)
        if self._options.drain_sweep and now >= self._next_sweep:
            self._next_sweep = now + _SWEEP_S
            self._sweep(pace, now, 1.0 + headroom)
        reachable = pace.reach(waiter.deadline - now) * (1.0 - headroom)
        if len(self.queue) <= reachable:
            return None
        ahead = self.queue.ahead(waiter)
        if ahead <= reachable:
            return None
        return self._wait(ahead - reachable, pace.per_s, now)

    def drain_view(self) -> tuple[float | None, float, float]:
        """Drain admission as it judges now: the grants a second it counts on (None: no pace
        yet, nothing refused), arrivals a second, and the fraction of the reach it holds back
        (`drain_headroom` as far as the arrivals outrun the pace)."""
        now = time.monotonic()
        pace = self._pace(now) if self._options.drain_admission else None
        arrivals = self._arrivals.per_s(now)
        if pace is None:
            return None, arrivals, 0.0
        return pace.per_s, arrivals, self._headroom(now, pace)

    def retries_view(self) -> tuple[int, float]:
        """The refused requests told to come back and not yet due, and the share of the
        queue's refused requests that came back when told (places.py, `AwaitedRetries`)."""
        return self._awaited.waiting(time.monotonic()), self._awaited.honour

    def _headroom(self, now: float, pace: Pace) -> float:
        """The fraction of the reach kept to spare now: `drain_headroom` as far as the
        arrivals outrun the pace (drain.py)."""
        return self._options.drain_headroom * self._arrivals.headroom_part(now, pace.per_s)

    def _pace(self, now: float) -> Pace | None:
        """The measured pace, bounded by the decodes' (a prefill queue's only: an aggregated
        instance's slot is the whole request, and its grants are its pace)."""
        rate = self._drain.rate(now)
        capacity = self._decode_capacity
        bound = None if capacity is None else capacity.bound(self._model, self._group)
        if bound is None:
            return None if rate is None else Pace(rate)
        return replace(bound, rate=rate)

    def _sweep(self, pace: Pace, now: float, slack: float) -> None:
        for late in self.queue.beyond_reach(lambda s: pace.reach(s) * slack, now):
            if late.admitted:
                continue
            self.queue.remove(late)
            self._metrics.queue_sheds.labels("drain").inc()
            if not late.future.done():
                late.future.set_exception(
                    self._out_of_reach(self._tell(late, self._retry_anew(late)))
                )

    def granted(self, now: float) -> None:
        """A prefill accepted one of this gateway's requests of the queue."""
        self._drain.granted(now)
        self._grants_new += 1

    def reported(self, now: float, count: int) -> None:
        """The fleet's other gateways report `count` grants for this queue since their last
        sync."""
        self._drain.granted(now, count)

    def take_grants(self) -> int:
        """This gateway's grants since the last call, for the fleet (`reported` there)."""
        grants, self._grants_new = self._grants_new, 0
        return grants

    def saturated(self, now: float) -> None:
        """The forwarder found no prefill for a queued request: the fleet is at capacity,
        and its grants from now until the queue empties are its pace (drain.py)."""
        self._drain.saturated(now)

    def drained(self, now: float) -> None:
        """The queue emptied."""
        self._drain.drained(now)

    def decodes_full(self) -> bool:
        """Whether a prefilled request of this queue's model and group waits for a decode."""
        waits = self._decode_waits
        return (
            waits is not None
            and self._options.decode_backpressure
            and waits.waiting(self._model, self._group) > 0
        )

    def hopeless(self, waiter: Waiter) -> bool:
        """Drop `waiter` (503 now) if its prefill would likely end past its deadline."""
        if not self._options.early_drop:
            return False
        remaining = waiter.deadline - time.monotonic()
        if not self._prefill_times.hopeless(waiter.info.prompt_chars, remaining):
            return False
        self.queue.remove(waiter)
        self._metrics.early_drops.inc()
        if not waiter.future.done():
            waiter.future.set_exception(
                DeadlineExceeded(
                    "the request cannot be prefilled before its TTFT deadline",
                    retry_after=self._tell(waiter, self._retry_anew(waiter)),
                )
            )
        return True

    def expire(self, waiter: Waiter) -> None:
        """The request's deadline passed with no prefill granted: 503."""
        if not waiter.future.done():
            waiter.future.set_exception(
                DeadlineExceeded(
                    "no prefill instance accepted the request before its TTFT deadline",
                    retry_after=self._tell(waiter, self._retry_anew(waiter)),
                )
            )

    def answered_late(self, waiter: Waiter) -> float:
        """`waiter` was granted, but its instance did not answer before its deadline (an
        aggregated instance: the slot is the whole request): the Retry-After to tell it,
        as to one that expired here, its place kept."""
        return self._tell(waiter, self._retry_anew(waiter))

    def shed(self, error: GatewayError) -> None:
        """The gateway stops: every queued request, and every one that would queue from now on
        (a new one, a retry), fails with `error` at once, so that its client can go to another
        gateway; requests already sent to a prefill go on."""
        self._shed = error
        for waiter in self.queue.waiters():
            if not waiter.future.done():
                waiter.future.set_exception(error)

    # -- what a refused request is told to wait (retry_after.py) ---------------------------

    def _retry_wait(
        self, ahead: int, budget_s: float | None, pace: Pace | None, now: float, share: float = 1.0
    ) -> float:
        """Until the pace (`share` of it) has served all but what it reaches within
        `budget_s` of the `ahead` requests before this one: a retry then is admitted, and
        reached in time, unless more urgent ones came meanwhile. Drain admission's headroom
        counts here as it does there."""
        if pace is None:
            return self._options.retry_after.drain(0, None)
        reach = 0.0 if budget_s is None else pace.reach(max(0.0, budget_s))
        reach *= (1.0 - self._headroom(now, pace)) * share
        return self._wait(ahead - reach, pace.per_s * share, now, share)

    def _wait(self, excess: float, per_s: float, now: float, share: float = 1.0) -> float:
        """Until `excess` requests have left at `per_s` a second, and the retries awaited
        before this one (`share` of them: a tenant's, at its share of the pace): they come
        back into the queue ahead of it (places.py, `AwaitedRetries`)."""
        awaited = self._awaited.expected(now) * share
        return self._options.retry_after.drain(excess + awaited, per_s)

    def _retry_ahead(self, waiter: Waiter, share: float = 1.0) -> float:
        """For an arrival: the requests ahead of it now, with its own time left."""
        now = time.monotonic()
        pace = self._pace(now)
        ahead = self.queue.ahead(waiter)
        return self._retry_wait(ahead, waiter.deadline - now, pace, now, share)

    def _retry_anew(self, waiter: Waiter) -> float:
        """For a request that waited here in vain, with its whole TTFT budget: its retry goes
        where it stood (its place is kept), or else behind every request of its tenant and
        the more urgent classes queued now."""
        now = time.monotonic()
        at = self.queue.place_of(waiter) if self._keeps_places(now) else math.inf
        ahead = self.queue.ahead(waiter, at=at)
        return self._retry_wait(ahead, waiter.info.ttft_s, self._pace(now), now)

    def _tell(self, waiter: Waiter, retry_after: float) -> float:
        """`waiter` is refused and told `retry_after`: await its retry, and keep its place
        for it while the queue can keep that promise. Once arrivals come more than twice
        as fast as the pace serves, more are refused than the pace serves: the retries
        holding places would alone outrun it, and each place kept would only move a
        failure onto a retry that waited longer. Past that, as without places, a retry is
        a new arrival."""
        now = time.monotonic()
        self._awaited.told(waiter.info, retry_after, now)
        if self._places is not None and self._keeps_places(now):
            self._places.keep(waiter.info, self.queue.place_of(waiter), retry_after, now)
            self._metrics.queue_places.labels("kept").inc()
        return retry_after

    def _keeps_places(self, now: float) -> bool:
        if self._places is None:
            return False
        pace = self._pace(now)
        return pace is None or self._arrivals.per_s(now) <= _PLACES_UP_TO * pace.per_s

    def _out_of_reach(self, retry_after: float) -> Overloaded:
        return Overloaded(
            "the gateway's queue for this model and group would not reach this request "
            "before its TTFT deadline",
            retry_after=retry_after,
        )

    def _over_share(self, waiter: Waiter) -> OverShare:
        """Its tenant's requests ahead of it go at the tenant's share of the pace."""
        return OverShare(
            f"the fleet is busy and tenant {waiter.tenant!r} holds its share of the queue; "
            "back off and retry",
            retry_after=self._tell(waiter, self._retry_ahead(waiter, self.queue.share(waiter))),
        )
