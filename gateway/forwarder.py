"""On-demand forwarding of queued requests to idle prefills (P/D-Serve section 3.5).

One `PrefillForwarder` per (model, group) owns that queue. It looks at the head request,
asks the policy to rank the prefills that have room (not recently rejected, fewer of our
requests in flight than their capacity), sends the head to the best one and, with batch
forwarding, keeps sending the following requests to that same prefill while it has room, so
it runs a full batch. A 429 puts the request back at its old place in the queue and marks the
prefill busy until one of our requests to it finishes (or a short hold passes: other
gateways share it). With nobody to send to, the forwarder sleeps until a slot frees or a
back-off passes: no busy loop. Each request waits for its grant only until its deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from config import Role
from gateway.affinity import PrefixIndex
from gateway.errors import (
    DeadlineExceeded,
    GatewayError,
    Overloaded,
    UpstreamError,
    UpstreamRejected,
    UpstreamStatus,
)
from gateway.instances import InstanceTracker, Lease
from gateway.metrics import GatewayMetrics
from gateway.prefill_time import PrefillTimes
from gateway.queue import Waiter, WaiterState, WaitQueue
from gateway.upstream import Upstream
from policies.base import Backoff, InstanceLoad, PrefillPolicy

log = logging.getLogger("pdgate.forwarder")

_MAX_REMEMBERED = 4096


@dataclass
class PrefillGrant:
    """A prefill accepted and computed the request; the leases now belong to the caller."""

    instance: InstanceLoad
    reply: dict[str, Any]
    stream: Lease
    inflight: Lease
    attempts: int
    rejections: int


@dataclass
class _Call:
    """One prefill call about to be made for one waiter, with what it holds."""

    waiter: Waiter
    stream: Lease
    inflight: Lease
    kv_id: str  # our name for the KV handle, to release it without the answer
    started: float = 0.0  # monotonic, when the call was sent

    def release(self, *, slot_freed: bool) -> None:
        self.stream.release(slot_freed=slot_freed)
        self.inflight.release(slot_freed=slot_freed)


@dataclass
class ForwardingOptions:
    batch_forwarding: bool = True
    batch_endpoint: bool = False  # one batch call per run (pdgate shims only)
    retry_after_s: int = 1
    # Answer 503 at once for a queued request even an optimistic prefill cannot serve in time.
    early_drop: bool = True
    # The quantile of recent prefill rates behind the early-drop estimate.
    prefill_estimate_quantile: float = 0.1
    client_error: Callable[[UpstreamStatus], GatewayError] = field(
        default=lambda exc: GatewayError(str(exc))
    )


class PrefillForwarder:
    def __init__(
        self,
        model: str,
        group: str | None,
        queue: WaitQueue,
        tracker: InstanceTracker,
        upstream: Upstream,
        policy: PrefillPolicy,
        backoff: Backoff,
        metrics: GatewayMetrics,
        index: PrefixIndex | None,
        options: ForwardingOptions,
    ) -> None:
        self.model = model
        self.group = group
        self.queue = queue
        self._tracker = tracker
        self._upstream = upstream
        self._policy = policy
        self._backoff = backoff
        self._metrics = metrics
        self._index = index
        self._options = options
        self._task: asyncio.Task[None] | None = None
        self._hashes: dict[int, list[bytes]] = {}  # id(waiter) -> prompt block hashes
        self.waiting = 0  # requests waiting for a prefill grant: queued or being tried
        self._cleanups: set[asyncio.Task[None]] = set()
        # Prefill URLs that answered 404/405 to the batch endpoint (LRU-bounded).
        self._no_batch_endpoint: OrderedDict[str, None] = OrderedDict()
        self.prefill_times = PrefillTimes(quantile=options.prefill_estimate_quantile)

    @property
    def idle(self) -> bool:
        return not self.waiting and (self._task is None or self._task.done())

    async def acquire(self, waiter: Waiter) -> PrefillGrant:
        """Queue `waiter` and wait for a prefill to accept it, until its deadline."""
        if not self.queue.push(waiter):
            raise _queue_full(self._options.retry_after_s)
        self.waiting += 1
        if self._index is not None:
            self._hashes[id(waiter)] = self._index.hashes(waiter.info.prompt)
        self._wake()
        try:
            remaining = waiter.deadline - time.monotonic()
            grant: PrefillGrant = await asyncio.wait_for(
                asyncio.shield(waiter.future), max(remaining, 0)
            )
            return grant
        except TimeoutError:
            raise DeadlineExceeded(
                "no prefill instance accepted the request before its TTFT deadline",
                retry_after=self._options.retry_after_s,
            ) from None
        finally:
            self.waiting -= 1
            self._withdraw(waiter)

    def _withdraw(self, waiter: Waiter) -> None:
        """The waiter stops waiting (granted, expired, cancelled): take it out everywhere."""
        self._hashes.pop(id(waiter), None)
        self.queue.remove(waiter)
        if not waiter.future.done():
            waiter.future.cancel()
        if waiter.attempt_task is not None and not waiter.attempt_task.done():
            # Early intervention: an attempt still running past the deadline (or for a client
            # that left) is cancelled, which aborts the HTTP call and frees the prefill slot.
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

    async def _run(self) -> None:
        round_no = 0
        while True:
            head = self.queue.peek()
            if head is None:
                return  # restarted by the next acquire()
            if self._hopeless(head):
                continue
            target = self._first_with_room(head)
            if target is None:
                # Everyone is full or just rejected: wait for one of our requests to finish
                # somewhere (the likeliest moment a prefill accepts again) or a back-off.
                await self._tracker.wait_freed(self._backoff.delay(round_no))
                round_no += 1
                continue
            round_no = 0
            sent = [self._reserve(head, target)]
            while self._options.batch_forwarding and self._tracker.has_room(
                target.id, target.capacity
            ):
                nxt = self.queue.peek()
                if nxt is None:
                    break
                if self._hopeless(nxt):
                    continue
                sent.append(self._reserve(nxt, target))
            if (
                self._options.batch_endpoint
                and len(sent) > 1
                and target.url not in self._no_batch_endpoint
            ):
                self._background(self._attempt_batch(sent, target))
            else:
                for call in sent:
                    call.waiter.attempt_task = asyncio.create_task(self._attempt(call, target))
            # Let the attempts start (and fast 429s arrive) before ranking again.
            await asyncio.sleep(0)

    def _hopeless(self, waiter: Waiter) -> bool:
        """Drop `waiter` (503 now) if even an optimistic prefill would end past its deadline."""
        if not self._options.early_drop:
            return False
        remaining = waiter.deadline - time.monotonic()
        if not self.prefill_times.hopeless(waiter.info.prompt_chars, remaining):
            return False
        self.queue.remove(waiter)
        self._metrics.early_drops.inc()
        if not waiter.future.done():
            waiter.future.set_exception(
                DeadlineExceeded(
                    "the request cannot be prefilled before its TTFT deadline",
                    retry_after=self._options.retry_after_s,
                )
            )
        return True

    def _first_with_room(self, waiter: Waiter) -> InstanceLoad | None:
        ranked = self._policy.rank(self._with_affinity(waiter), self._candidates())
        return next((c for c in ranked if self._tracker.has_room(c.id, c.capacity)), None)

    def _candidates(self) -> list[InstanceLoad]:
        return self._tracker.loads(Role.PREFILL, self.model, self.group)

    def _with_affinity(self, waiter: Waiter) -> Any:
        hashes = self._hashes.get(id(waiter))
        if self._index is None or not hashes:
            return waiter.info
        return replace(waiter.info, prefix_blocks=self._index.match(hashes))

    def _reserve(self, waiter: Waiter, inst: InstanceLoad) -> _Call:
        """Take the waiter out of the queue and count it against `inst` before the call."""
        popped = self.queue.pop()
        assert popped is waiter
        waiter.attempts += 1
        return _Call(
            waiter,
            self._tracker.open_stream(inst.id),
            self._tracker.begin(inst.id),
            uuid.uuid4().hex,
        )

    async def _attempt(self, call: _Call, inst: InstanceLoad) -> None:
        waiter = call.waiter
        call.started = time.monotonic()
        try:
            remaining = max(waiter.deadline - time.monotonic(), 0.001)
            reply = await self._upstream.prefill(
                inst.url,
                waiter.body,
                request_id=waiter.request_id,
                timeout_s=remaining,
                kv_id=call.kv_id,
            )
        except UpstreamRejected:
            self._settle(call, inst, 429, None)
        except UpstreamStatus as exc:
            self._settle(call, inst, exc.status, exc)
        except UpstreamError as exc:
            self._settle(call, inst, 502, exc)
        except asyncio.CancelledError:
            # Abandoned mid-call (deadline, client gone): the prefill may have finished just
            # now and hold KV for an answer nobody reads. Release it by the id we chose.
            # Not a freed slot: a prefill drops an abandoned prompt only at its next step
            # (pdgate shims hold the slot until then), so this is no moment to send it more.
            call.release(slot_freed=False)
            self._background(
                self._upstream.release_kv_id(inst.url, call.kv_id, request_id=waiter.request_id)
            )
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
        try:
            async for index, status, body in self._upstream.prefill_batch(
                inst.url,
                [c.waiter.body for c in calls],
                kv_ids=[c.kv_id for c in calls],
                request_id=calls[0].waiter.request_id,
                timeout_s=max(last_deadline - time.monotonic(), 0.001),
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
                self._remember_no_batch(inst.url)
                for call in calls:
                    call.waiter.attempt_task = asyncio.create_task(self._attempt(call, inst))
                return
            for call in pending.values():
                self._settle(call, inst, 502, exc)
        except UpstreamError as exc:
            for call in pending.values():
                self._settle(call, inst, 502, exc)
        except asyncio.CancelledError:  # gateway shutdown
            for call in pending.values():
                call.release(slot_freed=False)
            raise
        else:
            for call in pending.values():  # the prefill never answered for these
                self._settle(call, inst, 502, UpstreamError(inst.url, "missing from batch answer"))

    def _remember_no_batch(self, url: str) -> None:
        log.info("prefill %s has no batch endpoint; sending it one request per call", url)
        self._no_batch_endpoint[url] = None
        while len(self._no_batch_endpoint) > _MAX_REMEMBERED:
            self._no_batch_endpoint.popitem(last=False)

    def _settle(self, call: _Call, inst: InstanceLoad, status: int, answer: Any) -> None:
        """One prefill call's outcome, whichever way it was made."""
        waiter, counter = call.waiter, self._metrics.prefill_attempts
        if status == 200:
            if waiter.future.done():
                # The waiter left while the prefill computed: free the KV held for it.
                call.release(slot_freed=True)
                params = answer.get("kv_transfer_params") or {}
                self._background(self._upstream.release_kv(params, request_id=waiter.request_id))
                return
            counter.labels("accepted").inc()
            self.prefill_times.record(waiter.info.prompt_chars, time.monotonic() - call.started)
            hashes = self._hashes.get(id(waiter))
            if self._index is not None and hashes:
                self._index.record(hashes, inst.id)
            waiter.future.set_result(
                PrefillGrant(
                    inst, answer, call.stream, call.inflight, waiter.attempts, waiter.rejections
                )
            )
        elif status == 429:
            call.release(slot_freed=False)
            self._tracker.rejected(inst.id)
            counter.labels("rejected").inc()
            waiter.rejections += 1
            self._retry(waiter)
        elif 400 <= status < 500:
            call.release(slot_freed=True)
            counter.labels("client_error").inc()
            if not waiter.future.done():
                if not isinstance(answer, UpstreamStatus):
                    answer = UpstreamStatus(inst.url, status, orjson.dumps(answer))
                waiter.future.set_exception(self._options.client_error(answer))
        else:
            call.release(slot_freed=False)
            self._tracker.failed(inst.id)
            counter.labels("failed").inc()
            log.warning("prefill %s failed: %s", inst.id, answer)
            self._retry(waiter)

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._cleanups.add(task)  # keep a reference until done (bounded by in-flight calls)
        task.add_done_callback(self._cleanups.discard)

    def _retry(self, waiter: Waiter) -> None:
        if waiter.future.done() or waiter.state is WaiterState.DONE:
            return
        if time.monotonic() >= waiter.deadline:
            return  # acquire() is about to time out and answer 503
        self.queue.requeue(waiter)
        self._wake()


def _queue_full(retry_after_s: int) -> GatewayError:
    return Overloaded(
        "the gateway's queue for this model and group is full", retry_after=retry_after_s
    )
