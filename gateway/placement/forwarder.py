"""On-demand forwarding of queued requests to idle prefills (P/D-Serve section 3.5).

(The same queue serves an aggregated group, ``role = AGGREGATED``: there a grant is a slot
on an instance and no call is made; the caller sends the whole request, dispatch.py.)

One `PrefillForwarder` per (model, group) owns that queue, with the parts beside it: its
admission (admission.py: what the queue takes, refuses and sheds, with the drain pace it
judges by), its measured prefill times (prefill_time.py, `QueueTimes`) and its calls
(prefill_call.py: sent, settled, released). The forwarder looks at the head request, asks
the policy to rank the prefills that may take it (not recently rejected, fewer requests in
flight than their slots), takes slots through the fleet's leases and forms a run for the
best one (batching.py): with batch forwarding, the following requests too while that
prefill has room, so it runs a full batch. The run's calls are sent; a 429 puts the request
back at its old place in the queue and marks the prefill busy until one of our requests
there frees its slot (or `reject_hold_s` passes: other gateways share it). With nobody to
send to, the forwarder sleeps until a slot frees or a back-off passes: no busy loop. Each
request waits for its grant only until its deadline.

A prefill slot counts as taken from the call until the KV has left the prefill: a decode
pulled it (the decode's first byte says so, see `Placement.first_byte`) or it was released.
Until the prefill answers, the call also counts as computing there, fleet-wide: with
``prefill_admit = idle`` a prefill is sent a new run only when it computes nothing (its
free slots may be next to slots still holding KV), and with several gateways a run takes
only requests due before the most urgent one queued at another gateway.

Each call also counts its prompt work against the prefill until the answer (token-work load:
estimated tokens of the part the prefill does not hold in cache, at a tokens-per-character
ratio learned from the answers' ``usage``), with its expected duration (from recent calls,
by the characters the prefill computed). A policy with a holder (``affinity_hold``) uses
those to hold a request for the busy prefill holding its prefix when that is expected to
finish sooner (policies/completion.py); the requests behind it may take the free prefill.

The queue's prefill times and its grants are shared with the fleet's other gateways
(`samples_out`, `samples_in`): early drop, the start guard, batch forming and try timeouts
estimate with the whole fleet's calls, and drain admission paces with its grants.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Sequence

from pdgate.config.wire import Role
from pdgate.gateway.errors import GatewayError
from pdgate.gateway.placement.admission import QueueAdmission
from pdgate.gateway.placement.batching import BatchForming, batch_size
from pdgate.gateway.placement.leases import SlotLease, monotonic_ms_left
from pdgate.gateway.placement.placed import PrefillGrant
from pdgate.gateway.placement.prefill_call import PrefillCall, PrefillCalls
from pdgate.gateway.placement.prefill_time import QueueTimes
from pdgate.gateway.placement.queue import Waiter, WaiterState, WaitQueue
from pdgate.gateway.placement.shared import Shared
from pdgate.policies.base import InstanceLoad, Ranker

__all__ = ["PrefillForwarder"]


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
        self.waiting = 0  # requests waiting for a prefill grant: queued or being tried
        self.times = QueueTimes(shared.admission.prefill_estimate_quantile)
        # By prompt characters (early drop, the start guard, try timeouts); by the characters
        # the prefill computed (its cache's share taken off, as its answer says): the
        # expected prefill times the hold-or-go choice compares; tokens per character.
        self.prefill_times = self.times.prefill_times
        self.compute_times = self.times.compute_times
        self.token_ratio = self.times.token_ratio
        # An aggregated instance's slot is the whole request: no decode bounds its pace or
        # holds its queue.
        prefill = role is Role.PREFILL
        self.admission = QueueAdmission(
            queue,
            self.prefill_times,
            shared.metrics,
            shared.admission,
            model=model,
            group=group,
            decode_capacity=shared.decode_capacity if prefill else None,
            decode_waits=shared.decode_waits if prefill else None,
        )
        self._forming = BatchForming(
            queue,
            policy,
            shared.tracker,
            shared.index,
            self.compute_times,
            self.token_ratio,
            self.admission.hopeless,
            self.prefill_times.handover_s,
        )
        self._calls = PrefillCalls(
            model,
            group,
            shared,
            self.times,
            self._forming,
            retry=self._retry,
            expire=self.admission.expire,
        )

    @property
    def policy_name(self) -> str:
        return self._policy.name

    @property
    def idle(self) -> bool:
        return not self.waiting and (self._task is None or self._task.done())

    async def acquire(self, waiter: Waiter) -> PrefillGrant:
        """Queue `waiter` and wait for a prefill to accept it, until its deadline; raises
        what its admission says instead of queueing it (admission.py).

        A grant that lands as the caller gives up (deadline, cancellation) in the same loop
        iteration is closed here: whoever abandons a result closes it."""
        self.admission.admit(waiter)
        self.waiting += 1
        self._forming.remember(waiter)
        self._wake()
        returned = False
        wait = self._shared.tracing.start("pdgate.queue_wait", parent=waiter.span)
        # The deadline fails the future itself: one timer, where asyncio.timeout and a
        # shield cost a context manager, a timer and three callbacks per request.
        expiry = asyncio.get_running_loop().call_later(
            max(waiter.deadline - time.monotonic(), 0), self.admission.expire, waiter
        )
        try:
            grant: PrefillGrant = await waiter.future
            returned = True
            self.admission.granted(time.monotonic())
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
        return self.times.samples_out(self.admission.take_grants())

    def samples_in(self, packed: Sequence[str], *, fresh: bool = True) -> None:
        """The other gateways' samples and grants for this queue (`samples_out` there).
        Grants count toward the drain pace only when `fresh` (just synced: the pace now,
        not a warm start's history)."""
        granted = self.times.samples_in(packed)
        if granted and fresh:
            self.admission.reported(time.monotonic(), granted)
        if self.role is Role.PREFILL:
            self._tracker.set_speeds(self.model, self.group, self.compute_times.speeds())

    def head_in_ms(self) -> float | None:
        """Milliseconds to the deadline of this queue's most urgent request (None: empty)."""
        head = self.queue.peek()
        return None if head is None else monotonic_ms_left(head.deadline)

    async def _run(self) -> None:
        round_no = 0
        admission = self.admission
        while True:
            head = self.queue.peek()
            if head is None:
                admission.drained(time.monotonic())
                return  # restarted by the next acquire()
            if admission.hopeless(head):
                continue
            if admission.decodes_full():
                # A request prefilled now would wait for a decode, out of this queue's
                # order and out of drain admission's sight (drain.py, `DecodeWaits`). The
                # fleet is at capacity, the decodes' (drain.py): its grants are the pace.
                admission.saturated(time.monotonic())
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
                admission.saturated(time.monotonic())
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
                self._calls.hand_out(sent, target)
                continue
            self._calls.send(sent, target)
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
    ) -> PrefillCall:
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
        handoffs = self._shared.handoffs
        return PrefillCall(
            waiter,
            self._tracker.open_stream(inst.id),
            self._tracker.begin(inst.id, also=slot.release),
            self._tracker.computing(inst.id, also=slot.computed),
            self._tracker.work(inst.id, self.token_ratio.tokens(uncached), expected_s),
            secrets.token_hex(16),
            span,
            expected_cached=expected_cached,
            leg=None if handoffs is None else handoffs.stock_leg(inst.id, waiter.request_id),
        )

    def shed(self, error: GatewayError) -> None:
        """The gateway stops: what waits here and what would queue fails with `error`
        (`QueueAdmission.shed`); requests already sent to a prefill go on."""
        self.admission.shed(error)

    def _retry(self, waiter: Waiter) -> None:
        """Back in the queue at its old place, after a 429 or a failed call."""
        shed = self.admission.shedding
        if shed is not None and not waiter.future.done():
            waiter.future.set_exception(shed)
        if waiter.future.done() or waiter.state is WaiterState.DONE:
            return
        if time.monotonic() >= waiter.deadline:
            return  # acquire() is about to time out and answer 503
        self.queue.requeue(waiter)
        self._wake()
