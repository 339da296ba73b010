"""On-demand forwarding of queued requests to idle prefills (P/D-Serve section 3.5).

(The same queue serves an aggregated group, ``role = AGGREGATED``: there a grant is a slot
on an instance and no call is made; the caller sends the whole request, dispatch.py.)

One `PrefillForwarder` per (model, group) owns that queue. It looks at the head request,
asks the policy to rank the prefills that may take it (not recently rejected, fewer requests
in flight than their slots), sends the head to the best one and, with batch forwarding, keeps
sending the following requests to that same prefill while it has room, so it runs a full
batch. A 429 puts the request back at its old place in the queue and marks the prefill busy
until one of our requests there frees its slot (or `reject_hold_s` passes: other gateways
share it). With nobody to send to, the forwarder sleeps until a slot frees or a back-off
passes: no busy loop. Each request waits for its grant only until its deadline.

A prefill slot counts as taken from the call until the KV has left the prefill: a decode
pulled it (the decode's first byte says so, see `Placement.first_byte`) or it was released.
Until the prefill answers, the call also counts as computing there, fleet-wide: with
``prefill_admit = idle`` a prefill is sent a new run only when it computes nothing (its
free slots may be next to slots still holding KV), and with several gateways a run takes
only requests due before the most urgent one queued at another gateway.
Every call that is abandoned (deadline, client gone, timeout, failure) releases its KV by the
id the gateway chose for it, and only then gives back the count: the prefill frees the slot
when the release arrives, not before.

A prefill computes a run as one batch, so every answer of a run comes when the whole run is
computed: each is timed at its share of the run's characters, what the prompt itself cost.
Those times (early drop, the start guard, batch forming, try timeouts) are shared with the
fleet's other gateways (`samples_out`, `samples_in`).

Each call also counts its prompt work against the prefill until the answer (token-work load:
estimated tokens of the part the prefill does not hold in cache, at a tokens-per-character
ratio learned from the answers' ``usage``), with its expected duration (from recent calls,
by the characters the prefill computed). A policy with a holder (``affinity_hold``) uses
those to hold a request for the busy prefill holding its prefix when that is expected to
finish sooner (policies/completion.py); the requests behind it may take the free prefill.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from pdgate.config.aio import Background, Backoff
from pdgate.config.tracing import Span, Tracing
from pdgate.config.wire import DECODE_MAX_TOKENS_HEADER, EXT_BATCH_PREFILL, Role
from pdgate.gateway.errors import (
    BadGateway,
    DeadlineExceeded,
    GatewayError,
    Overloaded,
    OverShare,
    UpstreamError,
    UpstreamRejected,
    UpstreamStatus,
    is_client_fault,
)
from pdgate.gateway.instances.affinity import PrefixLookup
from pdgate.gateway.instances.health import Ejector, RetryBudget
from pdgate.gateway.instances.tracker import InstanceTracker, Lease
from pdgate.gateway.observe.metrics import GatewayMetrics
from pdgate.gateway.observe.ratio import RatioAdvisor
from pdgate.gateway.placement.batching import BatchForming, batch_size
from pdgate.gateway.placement.decode_attempt import out_of_time
from pdgate.gateway.placement.drain import (
    ArrivalRate,
    DecodeCapacity,
    DecodeWaits,
    Pace,
    QueueDrain,
)
from pdgate.gateway.placement.leases import Fleet, SlotLease, monotonic_ms_left
from pdgate.gateway.placement.placed import PrefillGrant, release_counts
from pdgate.gateway.placement.prefill_time import (
    PrefillTimes,
    TokenRatio,
    cached_tokens,
    uncached_chars,
)
from pdgate.gateway.placement.queue import Admission, Waiter, WaiterState, WaitQueue
from pdgate.gateway.upstream.base import Upstream
from pdgate.policies.base import InstanceLoad, Ranker
from pdgate.registry.base import hardware_name

log = logging.getLogger("pdgate.forwarder")

_MAX_REMEMBERED = 4096
# The prefill-time quantile behind a request's latest start (the queue's start guard).
_GUARD_QUANTILE = 0.9
# How often drain admission looks through the whole queue (O(n log n)) for requests the pace
# cannot reach: often enough that none waits long for a 503 it will get anyway.
_SWEEP_S = 0.5
# The most grants one report of another gateway counts (a sync's worth is far fewer): a
# garbled report errs toward admitting, and no further.
_MAX_GRANTS_REPORTED = 100_000


@dataclass
class _Call:
    """One prefill call about to be made for one waiter, with what it holds."""

    waiter: Waiter
    stream: Lease
    inflight: Lease  # the prefill slot (with its fleet lease), until the KV has left
    computing: Lease  # the prefill computes it (fleet-wide), until it answers
    work: Lease  # the prompt tokens being computed, until the prefill answers
    kv_id: str  # our name for the KV handle, to release it without the answer
    span: Span
    started: float = 0.0  # monotonic, when the call was sent
    # The prompt characters sent to the prefill in the same run, this one's included: the
    # prefill computes the run as one batch, so each answer comes after the whole batch, and
    # the time the prompt itself cost is about its share of it (prefill is compute bound).
    run_chars: int = 0
    # Prompt tokens the KV-event index expects the prefill to find cached (None: unknown).
    expected_cached: int | None = None

    @property
    def share(self) -> float:
        chars = self.waiter.info.prompt_chars
        return chars / self.run_chars if self.run_chars > chars else 1.0

    def headers(self, tracing: Tracing) -> dict[str, str]:
        """The call's headers: the decode leg's max_tokens, and the trace context."""
        headers = {DECODE_MAX_TOKENS_HEADER: str(self.waiter.info.max_tokens)}
        tracing.inject(self.span, headers)
        return headers

    def release(self, *, slot_freed: bool) -> None:
        self.work.release()
        self.computing.release(slot_freed=slot_freed)
        self.stream.release(slot_freed=slot_freed)
        self.inflight.release(slot_freed=slot_freed)


@dataclass
class ForwardingOptions:
    batch_forwarding: bool = True
    batch_endpoint: bool = False  # one batch call per run (pdgate shims only)
    # Send only to a prefill computing nothing, fleet-wide (``prefill_admit = idle``): the
    # slot lease checks it in the same atomic step that takes the slots.
    admit_idle: bool = False
    retry_after_s: int = 1
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
    # Longest one prefill call may take before the request moves on (a prefill that accepted
    # the connection and hangs); None: adaptive, from recent prefill times.
    try_timeout_s: float | None = None
    client_error: Callable[[UpstreamStatus], GatewayError] = field(
        default=lambda exc: GatewayError(str(exc))
    )


@dataclass(frozen=True)
class Shared:
    """What every forwarder of one gateway shares (built once, in the dispatcher)."""

    tracker: InstanceTracker
    upstream: Upstream
    backoff: Backoff
    metrics: GatewayMetrics
    index: PrefixLookup | None
    options: ForwardingOptions
    background: Background
    fleet: Fleet
    ejector: Ejector
    budget: RetryBudget
    # Prefilled requests waiting for a decode (their queues hold with `decode_backpressure`).
    decode_waits: DecodeWaits
    tracing: Tracing = field(default_factory=Tracing.off)
    advisor: RatioAdvisor = field(default_factory=RatioAdvisor)
    # What the decodes can take, bounding drain admission's pace (None: no bound).
    decode_capacity: DecodeCapacity | None = None


class PrefillForwarder:
    def __init__(
        self,
        model: str,
        group: str | None,
        queue: WaitQueue,
        policy: Ranker,
        shared: Shared,
        *,
        role: Role = Role.PREFILL,
    ) -> None:
        """`role`: the instances the queue's requests go to: prefills, or aggregated
        instances (the whole request: a grant is a slot there, no call is made)."""
        self.model = model
        self.group = group
        self.role = role
        self.key = f"{model}|{group or ''}"  # this queue's name in the fleet
        if role is not Role.PREFILL:
            self.key += f"|{role.value}"
        self.queue = queue
        self._policy = policy
        self._shared = shared
        self._tracker = shared.tracker  # these three on every attempt: one lookup
        self._index = shared.index
        self._options = shared.options
        self._task: asyncio.Task[None] | None = None
        self._shed: GatewayError | None = None  # the gateway stops: what waiters get now
        self.waiting = 0  # requests waiting for a prefill grant: queued or being tried
        # Prefill URL + API path pairs whose batch endpoint answered 404/405 (LRU-bounded).
        self._no_batch_endpoint: OrderedDict[str, None] = OrderedDict()
        self.prefill_times = PrefillTimes(quantile=shared.options.prefill_estimate_quantile)
        # By the characters the prefill computed (its cache's share taken off, as its answer
        # says): the expected prefill times the hold-or-go choice compares.
        self.compute_times = PrefillTimes()
        self.token_ratio = TokenRatio()
        self._drain = QueueDrain()  # the fleet's grants: ours, and the others' as reported
        self._arrivals = ArrivalRate()  # those drain admission judges
        self._grants_new = 0  # ours since the last `samples_out`
        self._next_sweep = 0.0  # monotonic: when drain admission may sweep the queue next
        self._forming = BatchForming(
            queue,
            policy,
            shared.tracker,
            shared.index,
            self.compute_times,
            self.token_ratio,
            self._hopeless,
        )

    @property
    def policy_name(self) -> str:
        return self._policy.name

    @property
    def idle(self) -> bool:
        return not self.waiting and (self._task is None or self._task.done())

    async def acquire(self, waiter: Waiter) -> PrefillGrant:
        """Queue `waiter` and wait for a prefill to accept it, until its deadline.

        A grant that lands as the caller gives up (deadline, cancellation) in the same loop
        iteration is closed here: whoever abandons a result closes it."""
        if self._shed is not None:
            raise self._shed
        # Started by then, it most likely makes its deadline (the queue's start guard).
        estimate = self.prefill_times.upper_bound_s(waiter.info.prompt_chars, _GUARD_QUANTILE)
        if estimate is not None:
            waiter.latest_start = waiter.deadline - estimate
        if self._options.drain_admission and not waiter.admitted and self._too_late(waiter):
            self._shared.metrics.queue_sheds.labels("drain").inc()
            raise self._out_of_reach()
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
            self._shared.metrics.queue_sheds.labels("full").inc()
            raise _queue_full(self._options.retry_after_s)
        if admission is Admission.OVER_SHARE:
            self._shared.metrics.queue_sheds.labels("over_share").inc()
            raise self._over_share(waiter)
        self.waiting += 1
        self._forming.remember(waiter)
        self._wake()
        returned = False
        wait = self._shared.tracing.start("pdgate.queue_wait", parent=waiter.span)
        # The deadline fails the future itself: one timer, where asyncio.timeout and a
        # shield cost a context manager, a timer and three callbacks per request.
        expiry = asyncio.get_running_loop().call_later(
            max(waiter.deadline - time.monotonic(), 0), self._expire, waiter.future
        )
        try:
            grant: PrefillGrant = await waiter.future
            returned = True
            self._drain.granted(time.monotonic())
            self._grants_new += 1
            return grant
        finally:
            expiry.cancel()
            self.waiting -= 1
            self._withdraw(waiter, granted=returned)
            if wait.is_recording():
                wait.set_attribute("pdgate.queue", self.key)
                wait.set_attribute("pdgate.granted", returned)
                wait.set_attribute("pdgate.prefill_attempts", waiter.attempts)
            wait.end()

    def _too_late(self, waiter: Waiter) -> bool:
        """Would the requests ahead here, drained at the fleet's pace while this queue is
        saturated (and no faster than its decodes allow), hold `waiter` past its deadline?
        (drain.py; the exact count only past the cheap bound.) With `drain_sweep`, at most
        every `_SWEEP_S`, the queued requests the pace cannot reach either are refused too:
        those admitted while the pace still counted a backlog's first grants, which fill
        idle slots."""
        now = time.monotonic()
        self._arrivals.arrived(now)
        if not self.queue:
            return False
        pace = self._pace(now)
        if pace is None:
            return False
        # Under heavy overload admission keeps headroom below the reach, and the sweep as much
        # above it: a request admitted at the edge would be refused late by any dip in the
        # pace, and one refused late has waited for nothing while its place goes to a new
        # arrival, not to a grant (drain.py).
        headroom = self._headroom(now, pace)
        if self._options.drain_sweep and now >= self._next_sweep:
            self._next_sweep = now + _SWEEP_S
            self._sweep(pace, now, 1.0 + headroom)
        reachable = pace.reach(waiter.deadline - now) * (1.0 - headroom)
        return len(self.queue) > reachable and self.queue.ahead(waiter) > reachable

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

    def _headroom(self, now: float, pace: Pace) -> float:
        """The fraction of the reach kept to spare now: `drain_headroom` as far as the
        arrivals outrun the pace (drain.py)."""
        return self._options.drain_headroom * self._arrivals.headroom_part(now, pace.per_s)

    def _pace(self, now: float) -> Pace | None:
        """The measured pace, bounded by the decodes' (a prefill queue's only: an aggregated
        instance's slot is the whole request, and its grants are its pace)."""
        rate = self._drain.rate(now)
        capacity = self._shared.decode_capacity
        bound = None
        if capacity is not None and self.role is Role.PREFILL:
            bound = capacity.bound(self.model, self.group)
        if bound is None:
            return None if rate is None else Pace(rate)
        return replace(bound, rate=rate)

    def _sweep(self, pace: Pace, now: float, slack: float) -> None:
        for late in self.queue.beyond_reach(lambda s: pace.reach(s) * slack, now):
            if late.admitted:
                continue
            self.queue.remove(late)
            self._shared.metrics.queue_sheds.labels("drain").inc()
            if not late.future.done():
                late.future.set_exception(self._out_of_reach())

    def _out_of_reach(self) -> Overloaded:
        return Overloaded(
            "the gateway's queue for this model and group would not reach this request "
            "before its TTFT deadline",
            retry_after=self._options.retry_after_s,
        )

    def _expire(self, future: asyncio.Future[PrefillGrant]) -> None:
        if not future.done():
            future.set_exception(
                DeadlineExceeded(
                    "no prefill instance accepted the request before its TTFT deadline",
                    retry_after=self._options.retry_after_s,
                )
            )

    def _over_share(self, waiter: Waiter) -> OverShare:
        return OverShare(
            f"the fleet is busy and tenant {waiter.tenant!r} holds its share of the queue; "
            "back off and retry",
            retry_after=self._options.retry_after_s,
        )

    def _withdraw(self, waiter: Waiter, *, granted: bool) -> None:
        """The waiter stops waiting (granted, expired, cancelled): take it out everywhere."""
        self._forming.forget(waiter)
        self.queue.remove(waiter)
        future = waiter.future
        if not future.done():
            future.cancel()
        elif not granted and not future.cancelled() and future.exception() is None:
            future.result().close()  # granted just as the waiter gave up
        if waiter.attempt_task is not None and not waiter.attempt_task.done():
            # Early intervention: an attempt still running past the deadline (or for a client
            # that left) is cancelled, which aborts the HTTP call; its KV is then released.
            waiter.attempt_task.cancel()
        waiter.state = WaiterState.DONE

    def _wake(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(
                self._run(), name=f"forwarder:{self.model}:{self.group}"
            )

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def samples_out(self) -> str:
        """This queue's new prefill-time samples and grants for the fleet, packed ("":
        none)."""
        parts = [_sample("p", *x) for x in self.prefill_times.take_new()]
        parts += [_sample("c", *x) for x in self.compute_times.take_new()]
        if self._grants_new:
            parts.append(f"g {self._grants_new}")
            self._grants_new = 0
        return ";".join(parts)

    def samples_in(self, packed: Sequence[str], *, fresh: bool = True) -> None:
        """The other gateways' samples and grants for this queue (`samples_out` there).
        Grants count toward the drain pace only when `fresh` (just synced: the pace now,
        not a warm start's history). Malformed entries are skipped: another gateway's
        version may pack more, and an older one reads "g" as a malformed sample."""
        targets = {"p": self.prefill_times, "c": self.compute_times}
        granted = 0
        for entry in packed:
            for item in entry.split(";"):
                # "KIND CHARS SECONDS[ HARDWARE]"; an older gateway sends no hardware.
                # "g N": N grants since that gateway's last sync.
                kind, _, rest = item.partition(" ")
                if kind == "g":
                    with contextlib.suppress(ValueError):
                        granted += min(max(0, int(rest)), _MAX_GRANTS_REPORTED)
                    continue
                chars, _, rest = rest.partition(" ")
                secs, _, hardware = rest.partition(" ")
                target = targets.get(kind)
                try:
                    n, t, hw = int(chars), float(secs), hardware_name(hardware)
                except ValueError:
                    continue
                if target is not None and n >= 0 and t >= 0:
                    target.add_shared(n, t, hw)
        if granted and fresh:
            self._drain.granted(time.monotonic(), granted)
        if self.role is Role.PREFILL:
            self._tracker.set_speeds(self.model, self.group, self.compute_times.speeds())

    def head_in_ms(self) -> float | None:
        """Milliseconds to the deadline of this queue's most urgent request (None: empty)."""
        head = self.queue.peek()
        return None if head is None else monotonic_ms_left(head.deadline)

    async def _run(self) -> None:
        round_no = 0
        while True:
            head = self.queue.peek()
            if head is None:
                self._drain.drained(time.monotonic())
                return  # restarted by the next acquire()
            if self._hopeless(head):
                continue
            if self._decodes_full():
                # A request prefilled now would wait for a decode, out of this queue's
                # order and out of drain admission's sight (drain.py, `DecodeWaits`). The
                # fleet is at capacity, the decodes' (drain.py): its grants are the pace.
                self._drain.saturated(time.monotonic())
                await self._sleep(self._shared.backoff.delay(round_no), arrivals=False)
                round_no += 1
                continue
            loads = self._candidates()
            picked = self._forming.pick(head, loads)
            if picked is None:
                # The head waits for the busy prefill holding its prefix and nobody behind it
                # can use a free one: sleep until a slot frees, a request arrives or a
                # back-off passes.
                await self._sleep(self._shared.backoff.delay(round_no), arrivals=True)
                round_no += 1
                continue
            first, ranked = picked
            want = 1
            if ranked and self._options.batch_forwarding:
                want = batch_size(len(self.queue), ranked)
            slots = await self._shared.fleet.acquire(
                self.key,
                ranked,
                want,
                head_in_ms=monotonic_ms_left(first.deadline),
                next_head_in_ms=self._next_head_ms(want),
                idle=self._options.admit_idle and self.role is Role.PREFILL,
            )
            if slots.instance is None:
                # Everyone is full or just rejected: wait for a request to free a slot
                # somewhere (the likeliest moment a prefill accepts again) or a back-off. A
                # gateway that yielded to a more urgent one elsewhere retries after the
                # fleet's priority window. Either way the fleet is at capacity: its grants
                # from now until this queue empties are its pace (drain.py).
                self._drain.saturated(time.monotonic())
                if slots.yielded:
                    self._shared.metrics.fleet_yields.inc()
                    wait = self._shared.fleet.window_s
                else:
                    wait = self._shared.backoff.delay(round_no)
                await self._sleep(wait, arrivals=False)
                round_no += 1
                continue
            round_no = 0
            target = slots.instance
            leases = list(slots.leases)
            sent = [
                self._reserve(nxt, target, leases.pop(), uncached, took)
                for nxt, uncached, took in self._forming.members(
                    target, loads, len(leases), slots.others_due
                )
            ]
            for unused in leases:
                unused.release()
            if not sent:
                continue
            if self.role is Role.AGGREGATED:
                for call in sent:
                    self._hand_out(call, target)
                continue
            run_chars = sum(c.waiter.info.prompt_chars for c in sent)
            for call in sent:
                call.run_chars = run_chars
            # Each API has its own batch endpoint: one batch call per API in the run.
            by_path: dict[str, list[_Call]] = {}
            for call in sent:
                by_path.setdefault(call.waiter.path, []).append(call)
            for path, calls in by_path.items():
                if (
                    self._options.batch_endpoint
                    and len(calls) > 1
                    and self._speaks_batch(target)
                    and target.url + path not in self._no_batch_endpoint
                ):
                    self._shared.background.spawn(self._attempt_batch(calls, target))
                else:
                    for call in calls:
                        self._start_attempt(call, target)
            # Let the attempts start (and fast 429s arrive) before ranking again.
            await asyncio.sleep(0)

    async def _sleep(self, wait_s: float, *, arrivals: bool) -> None:
        """Until a slot frees somewhere or `wait_s` passes; with `arrivals`, also until a
        request is queued (it may be one that can use the prefill a held head leaves free)."""
        if not arrivals:
            await self._tracker.wait_freed(wait_s)
            return
        waits = {
            asyncio.ensure_future(self._tracker.wait_freed(wait_s)),
            asyncio.ensure_future(self.queue.wait_arrival()),
        }
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()

    def _decodes_full(self) -> bool:
        """Whether a prefilled request of this queue's model and group waits for a decode."""
        return (
            self._options.decode_backpressure
            and self.role is Role.PREFILL
            and self._shared.decode_waits.waiting(self.model, self.group) > 0
        )

    def _hopeless(self, waiter: Waiter) -> bool:
        """Drop `waiter` (503 now) if its prefill would likely end past its deadline."""
        if not self._options.early_drop:
            return False
        remaining = waiter.deadline - time.monotonic()
        if not self.prefill_times.hopeless(waiter.info.prompt_chars, remaining):
            return False
        self.queue.remove(waiter)
        self._shared.metrics.early_drops.inc()
        if not waiter.future.done():
            waiter.future.set_exception(
                DeadlineExceeded(
                    "the request cannot be prefilled before its TTFT deadline",
                    retry_after=self._options.retry_after_s,
                )
            )
        return True

    def _candidates(self) -> list[InstanceLoad]:
        return self._tracker.loads(self.role, self.model, self.group)

    def _next_head_ms(self, placing: int) -> float | None:
        """Ms to the deadline of the request that will head the queue once `placing` requests
        left it (None: empty). Only the fleet's deadline order needs it."""
        if not self._shared.fleet.shared:
            return None
        deadline = self.queue.deadline_after(placing)
        return None if deadline is None else monotonic_ms_left(deadline)

    def _reserve(
        self,
        waiter: Waiter,
        inst: InstanceLoad,
        slot: SlotLease,
        uncached: int,
        expected_s: float | None,
    ) -> _Call:
        """Take the waiter out of the queue and count it against `inst` before the call: its
        slot, its open stream and its prompt work (`uncached`: characters of the part `inst`
        does not hold in cache, as tokens; `expected_s`: the call's expected duration)."""
        self.queue.take(waiter)
        waiter.attempts += 1
        span = self._shared.tracing.start("pdgate.prefill_attempt", parent=waiter.span)
        if span.is_recording():
            span.set_attribute("pdgate.instance", inst.id)
            span.set_attribute("server.address", inst.url)
            span.set_attribute("pdgate.attempt", waiter.attempts)
        expected_cached = None
        blocks = self._forming.blocks(waiter)
        if self._index is not None and blocks is not None:
            expected_cached = self._index.expected_cached_tokens(blocks, inst.id)
            self._index.routed(blocks, inst.id)
        return _Call(
            waiter,
            self._tracker.open_stream(inst.id),
            self._tracker.begin(inst.id, also=slot.release),
            self._tracker.computing(inst.id, also=slot.computed),
            self._tracker.work(inst.id, self.token_ratio.tokens(uncached), expected_s),
            secrets.token_hex(16),
            span,
            expected_cached=expected_cached,
        )

    def _start_attempt(self, call: _Call, inst: InstanceLoad) -> None:
        """`_attempt` in a task of its own, which the waiter cancels when it gives up."""
        task = asyncio.create_task(self._attempt(call, inst))
        call.waiter.attempt_task = task
        task.add_done_callback(lambda done: _never_started(done, call))

    async def _attempt(self, call: _Call, inst: InstanceLoad) -> None:
        waiter = call.waiter
        call.started = time.monotonic()  # before any await: `_never_started` reads it
        try:
            remaining = max(waiter.deadline - time.monotonic(), 0.001)
            reply = await self._shared.upstream.prefill(
                inst.url,
                waiter.body,
                request_id=waiter.request_id,
                timeout_s=min(remaining, self._try_timeout_s(call, inst)),
                kv_id=call.kv_id,
                headers=call.headers(self._shared.tracing),
                path=waiter.path,
            )
        except UpstreamRejected:
            self._settle(call, inst, 429, None)
        except UpstreamStatus as exc:
            self._settle(call, inst, exc.status, exc)
        except UpstreamError as exc:
            if out_of_time(waiter.deadline):
                self._out_of_time(call, inst)
            else:
                self._settle(call, inst, 502, exc)
        except Exception:
            self._broke(call, inst)
        except asyncio.CancelledError:
            # Abandoned mid-call (deadline, client gone): the prefill may have finished just
            # now and hold KV for an answer nobody reads. Release it by the id we chose.
            # Not a freed slot: a prefill drops an abandoned prompt only at its next step
            # (pdgate shims hold the slot until then), so this is no moment to send it more.
            self._release_then_free(call, inst, slot_freed=False)
            _end(call.span, "abandoned")
            raise
        else:
            self._settle(call, inst, 200, reply)

    async def _attempt_batch(self, calls: list[_Call], inst: InstanceLoad) -> None:
        """One batch call for a run of waiters; each line settles its own waiter. The call is
        shared, so a waiter that leaves does not cancel it: its KV is released when its line
        comes back."""
        pending = dict(enumerate(calls))
        started = time.monotonic()
        for c in calls:
            c.started = started
        last_deadline = max(c.waiter.deadline for c in calls)
        try_timeout = max(self._try_timeout_s(c, inst) for c in calls)
        path = calls[0].waiter.path  # one API per batch call
        try:
            async for index, status, body in self._shared.upstream.prefill_batch(
                inst.url,
                [c.waiter.body for c in calls],
                kv_ids=[c.kv_id for c in calls],
                request_id=calls[0].waiter.request_id,
                timeout_s=min(max(last_deadline - time.monotonic(), 0.001), try_timeout),
                headers=calls[0].headers(self._shared.tracing),
                path=path,
                decode_max_tokens=[c.waiter.info.max_tokens for c in calls],
            ):
                call = pending.pop(index, None)
                if call is not None:
                    self._settle(call, inst, status, body)
        except UpstreamRejected:
            for call in pending.values():
                self._settle(call, inst, 429, None)
        except UpstreamStatus as exc:
            if exc.status in (404, 405) and len(pending) == len(calls):
                # Not a pdgate shim (e.g. plain vLLM): one call per request to it from now on.
                self._remember_no_batch(inst.url + path)
                for call in calls:
                    self._start_attempt(call, inst)
                return
            for call in pending.values():
                self._settle(call, inst, 502, exc)
        except UpstreamError as exc:
            for call in pending.values():
                if out_of_time(call.waiter.deadline):
                    self._out_of_time(call, inst)
                else:
                    self._settle(call, inst, 502, exc)
        except Exception:
            for call in pending.values():
                self._broke(call, inst)
        except asyncio.CancelledError:  # gateway shutdown
            for call in pending.values():
                self._release_then_free(call, inst, slot_freed=False)
                _end(call.span, "abandoned")
            raise
        else:
            for call in pending.values():  # the prefill never answered for these
                self._settle(call, inst, 502, UpstreamError(inst.url, "missing from batch answer"))

    def _out_of_time(self, call: _Call, inst: InstanceLoad) -> None:
        """The call's time was its request's: the prefill did not answer before the request's
        deadline. The request is shed (503), and the prefill, which may still be computing
        a prompt nobody waits for, is not counted as failed (a burst of short deadlines
        would eject healthy prefills); whatever it holds for the call is released."""
        self._release_then_free(call, inst, slot_freed=False)
        self._shared.metrics.prefill_attempts.labels("deadline").inc()
        _end(call.span, "deadline")
        self._expire(call.waiter.future)

    def _broke(self, call: _Call, inst: InstanceLoad) -> None:
        """The call failed on this side (a bug, not the prefill's doing): whatever the prefill
        may hold for it is released, its counts given back, and its request fails with a 500
        rather than being tried again elsewhere (it would break there too)."""
        log.exception("prefill call to %s failed in the gateway", inst.id)
        self._release_then_free(call, inst, slot_freed=False)
        _end(call.span, "failed")
        if not call.waiter.future.done():
            call.waiter.future.set_exception(GatewayError("internal gateway error"))

    def _try_timeout_s(self, call: _Call, inst: InstanceLoad) -> float:
        """How long one prefill call may take: the setting, or four times the slowest recent
        prefills of its run's length (at least 2 s): its answer comes when the prefill has
        computed the whole run. Past it the call counts as failed and the request moves on,
        instead of waiting on a prefill that hangs until its deadline."""
        if self._options.try_timeout_s is not None:
            return self._options.try_timeout_s
        slow = self.prefill_times.upper_bound_s(
            max(call.run_chars, call.waiter.info.prompt_chars),
            hardware=self._tracker.hardware(inst.id),
        )
        return float("inf") if slow is None else max(2.0, 4 * slow)

    def _hand_out(self, call: _Call, inst: InstanceLoad) -> None:
        """An aggregated instance's slot for the waiter: its caller sends it the whole
        request (dispatch.py). The grant holds the open stream and the slot (its fleet lease
        with it) until the caller's stream ends."""
        call.work.release()
        call.computing.release(slot_freed=False)
        _end(call.span, "granted")
        waiter = call.waiter
        if waiter.future.done():
            call.release(slot_freed=True)
            return
        self._remember_prefix(waiter, inst)
        waiter.future.set_result(
            PrefillGrant(
                inst,
                {},
                call.stream,
                call.inflight,
                release_counts,
                waiter.attempts,
                waiter.rejections,
            )
        )

    def _compare_cached(self, expected: int, usage: object) -> None:
        """The KV-event index's prediction against the engine's own count, where it gives
        one (vLLM: with ``--enable-prompt-tokens-details``)."""
        reported = cached_tokens(usage)
        if reported is None:
            return
        metrics = self._shared.metrics
        metrics.prefix_cached_tokens.labels("predicted").inc(expected)
        metrics.prefix_cached_tokens.labels("reported").inc(reported)
        outcome = "exact" if expected == reported else "over" if expected > reported else "under"
        metrics.prefix_predictions.labels(outcome).inc()

    def _remember_prefix(self, waiter: Waiter, inst: InstanceLoad) -> None:
        """`inst` computes the waiter's prompt: the affinity index learns it holds it."""
        blocks = self._forming.blocks(waiter)
        if self._index is not None and blocks is not None:
            self._index.record(blocks, inst.id)

    def _speaks_batch(self, inst: InstanceLoad) -> bool:
        """Whether `inst` registered the batch endpoint (pdgate shims do; stock servers get
        exactly vLLM's handshake). A 404/405 from one that claims it is remembered below."""
        record = self._tracker.records().get(inst.id)
        return record is not None and EXT_BATCH_PREFILL in record.extensions

    def _remember_no_batch(self, url: str) -> None:
        log.info("prefill %s has no batch endpoint; sending it one request per call", url)
        self._no_batch_endpoint[url] = None
        while len(self._no_batch_endpoint) > _MAX_REMEMBERED:
            self._no_batch_endpoint.popitem(last=False)

    def _release_then_free(
        self,
        call: _Call,
        inst: InstanceLoad,
        *,
        slot_freed: bool,
        kv_params: dict[str, Any] | None = None,
    ) -> None:
        """Release the call's KV at the prefill (by the answer's params when there is one, by
        our id otherwise), then give back the call's leases: the prefill frees the slot only
        when the release arrives, so counting it free earlier invites a 429."""
        held = (call.work, call.computing, call.stream, call.inflight)
        request_id = call.waiter.request_id
        self._free_after_release(
            inst, request_id, call.kv_id, kv_params, held, slot_freed=slot_freed
        )

    def _free_after_release(
        self,
        inst: InstanceLoad,
        request_id: str,
        kv_id: str,
        kv_params: dict[str, Any] | None,
        held: Sequence[Lease],
        *,
        slot_freed: bool,
    ) -> None:
        """As `_release_then_free`, from the call's parts (the grant's release must not hold
        the call: see `_settle`)."""
        held = tuple(held)

        async def run() -> None:
            try:
                if kv_params is not None:
                    await self._shared.upstream.release_kv(kv_params, request_id=request_id)
                else:
                    await self._shared.upstream.release_kv_id(
                        inst.url, kv_id, request_id=request_id
                    )
            finally:
                for lease in held:
                    lease.release(slot_freed=slot_freed)

        self._shared.background.spawn(run())

    def _settle(self, call: _Call, inst: InstanceLoad, status: int, answer: Any) -> None:
        """One prefill call's outcome, whichever way it was made."""
        waiter, counter = call.waiter, self._shared.metrics.prefill_attempts
        call.work.release()  # the prefill is no longer computing it, whatever the outcome
        call.computing.release(slot_freed=status == 200)
        _end(
            call.span,
            {200: "accepted", 429: "rejected"}.get(
                status, "client_error" if is_client_fault(status) else "failed"
            ),
            status,
        )
        if status == 200:
            params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
            if not isinstance(params, dict):
                self._settle(call, inst, 502, UpstreamError(inst.url, "no kv_transfer_params"))
                return
            if waiter.future.done():
                # The waiter left while the prefill computed: free the KV held for it.
                self._release_then_free(call, inst, slot_freed=True, kv_params=params)
                return
            counter.labels("accepted").inc()
            self._shared.ejector.success(inst.id)
            took = time.monotonic() - call.started
            chars = waiter.info.prompt_chars
            # What this prompt cost, not the batch it rode in: the estimates are of a prompt
            # sent alone (a run is then the sum of its members', `RunBudget`).
            own = took * call.share
            hardware = self._tracker.hardware(inst.id)
            self.prefill_times.record(chars, own, hardware=hardware)
            usage = answer.get("usage")
            self.token_ratio.observe(chars, usage)
            self.compute_times.record(max(1, uncached_chars(chars, usage)), own, hardware=hardware)
            if call.expected_cached is not None:
                self._compare_cached(call.expected_cached, usage)
            if hardware:
                self._tracker.set_speeds(self.model, self.group, self.compute_times.speeds())
            self._shared.advisor.prefill(inst.group, own, hardware)
            self._remember_prefix(waiter, inst)
            request_id, kv_id = waiter.request_id, call.kv_id
            waiter.future.set_result(
                PrefillGrant(
                    inst,
                    answer,
                    call.stream,
                    call.inflight,
                    # Not the call or the waiter: the grant is the waiter's future's result,
                    # and a reference back would make each request a cycle for the GC.
                    lambda leases: self._free_after_release(
                        inst, request_id, kv_id, params, leases, slot_freed=True
                    ),
                    waiter.attempts,
                    waiter.rejections,
                    on_handover=self.prefill_times.record_handover,
                )
            )
        elif status == 429:
            call.release(slot_freed=False)
            self._tracker.rejected(inst.id)
            counter.labels("rejected").inc()
            waiter.rejections += 1
            self._retry(waiter)
        elif is_client_fault(status):
            call.release(slot_freed=True)
            counter.labels("client_error").inc()
            if not waiter.future.done():
                if not isinstance(answer, UpstreamStatus):
                    answer = UpstreamStatus(inst.url, status, orjson.dumps(answer))
                waiter.future.set_exception(self._options.client_error(answer))
        else:
            # 5xx, timeout, connection lost, a bad answer: the prefill may have stored KV
            # before failing (or before our timeout fired). Nobody will fetch it.
            self._release_then_free(call, inst, slot_freed=False)
            self._tracker.failed(inst.id)
            self._shared.ejector.failure(inst.id, "prefill")
            counter.labels("failed").inc()
            log.warning("prefill %s failed: %s", inst.id, answer)
            if not self._shared.budget.withdraw():
                # A fleet-wide failure must not multiply the load on what is left.
                self._shared.metrics.retry_budget_exhausted.inc()
                if not waiter.future.done():
                    waiter.future.set_exception(
                        BadGateway("the prefill instances are failing; not retried")
                    )
                return
            self._retry(waiter)

    def shed(self, error: GatewayError) -> None:
        """The gateway stops: every queued request, and every one that would queue from now on
        (a new one, a retry), fails with `error` at once, so that its client can go to another
        gateway; requests already sent to a prefill go on."""
        self._shed = error
        for waiter in self.queue.waiters():
            if not waiter.future.done():
                waiter.future.set_exception(error)

    def _retry(self, waiter: Waiter) -> None:
        if self._shed is not None and not waiter.future.done():
            waiter.future.set_exception(self._shed)
        if waiter.future.done() or waiter.state is WaiterState.DONE:
            return
        if time.monotonic() >= waiter.deadline:
            return  # acquire() is about to time out and answer 503
        self.queue.requeue(waiter)
        self._wake()


def _never_started(task: asyncio.Task[None], call: _Call) -> None:
    """A task cancelled before its first step runs no line of its coroutine, so none of
    `_attempt`'s clean-up: nothing was sent, and the counts taken for it go back here."""
    if task.cancelled() and not call.started:
        call.release(slot_freed=True)
        _end(call.span, "abandoned")


def _end(span: Span, outcome: str, status: int | None = None) -> None:
    if span.is_recording():
        span.set_attribute("pdgate.outcome", outcome)
        if status is not None:
            span.set_attribute("http.response.status_code", status)
    span.end()


def _queue_full(retry_after_s: int) -> GatewayError:
    return Overloaded(
        "the gateway's queue for this model and group is full", retry_after=retry_after_s
    )


def _sample(kind: str, chars: int, seconds: float, hardware: str) -> str:
    """One measured sample as the fleet shares it (`Forwarder.samples_in` reads it)."""
    sample = f"{kind} {chars} {seconds:.6g}"
    return f"{sample} {hardware}" if hardware else sample
