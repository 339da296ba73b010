"""The push flow (vLLM's ``NixlPushConnector``, the xPyD flow of seed 004): the decode is
chosen before the prefill leg, and told the prefill while the prefill computes.

With a push connector the prefill writes the KV into the decode's blocks, once the decode
has registered them with it (push_scheduler.py, push_worker.py): so for a request whose
group's prefills push, the dispatcher first reserves a decode (`PushDecodes.reserve`): the
best-ranked one with room, its open stream and slot counted from that moment (the slot is
held while the prefill waits in the queue and computes; a request that finds every decode
full waits for a freed one, until its deadline). Then the prefill leg goes through the
queue as any other, and when the queue sends it to a prefill whose engine, side channel and
``tp_size`` this gateway knows (its earlier answers said them: `Handoffs.learn`), the decode
leg goes out at once with them (`PushDecode.on_send`): the decode allocates its blocks and
registers them with the prefill while the prefill computes, and the prefill writes into
them as soon as it is done. A prefill not yet known gets the decode leg after its answer,
as vLLM's ``toy_push_proxy_server.py`` sends it (then with the answer's
``remote_request_id``).

Failures:

* the prefill attempt is refused (429) or fails: the decode leg sent with it is closed
  (the decode drops the request); the reserved slot stays for the next attempt, which gets
  a new leg id and a new decode leg; when the request gives up (its deadline, its client
  gone) the reservation is released (`PushDecode.release`);
* the decode cannot be reached: the request is placed on another decode after the
  prefill's answer, with the same leg id, so the prefill's blocks still find their
  registration (`PushDecode.take` returns None; the dispatcher's usual decode leg);
* the decode is lost after it took the leg and before the push (it answered an error, or
  its stream broke before its first event): the request is placed again, prefill included
  (`DecodeLost`, the relay's failover), under a new leg id; the prefill's unpushed blocks
  are freed by its lease.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Coroutine
from typing import Any

from pdgate.config.aio import Backoff
from pdgate.config.tracing import Span
from pdgate.config.wire import Role
from pdgate.gateway.admission.retry_after import RetryAfter
from pdgate.gateway.errors import DeadlineExceeded, UpstreamRejected, UpstreamUnreachable
from pdgate.gateway.instances.tracker import InstanceTracker, Lease
from pdgate.gateway.placement.decode_attempt import DecodeAttempts
from pdgate.gateway.placement.decode_leg import until_decode_room
from pdgate.gateway.placement.drain import DecodeCapacity, DecodeWaits
from pdgate.gateway.placement.handoff import PUSH, Handoffs, StockLeg
from pdgate.gateway.placement.placed import as_stream
from pdgate.gateway.upstream.base import DecodeStream
from pdgate.policies.base import InstanceLoad, Ranker, RequestInfo

__all__ = ["PushDecode", "PushDecodes"]

log = logging.getLogger("pdgate.push")


class PushDecode:
    """A decode reserved for one request before its prefill leg; see the module docstring.
    Whoever holds it calls `release()` when the request ends without taking it."""

    def __init__(
        self,
        inst: InstanceLoad,
        leases: tuple[Lease, Lease],
        decodes: DecodeAttempts,
        handoffs: Handoffs,
        *,
        body: dict[str, Any],
        path: str,
        deadline: float,
        span: Span | None,
    ) -> None:
        self.inst = inst
        # Its open stream and slot, until a decode leg there takes them over. A leg being
        # opened counts on its own (the decode is then counted twice for a moment, never
        # less than it holds).
        self._leases: tuple[Lease, Lease] | None = leases
        self._decodes = decodes
        self._handoffs = handoffs
        self._body = body  # the client's body for the decode leg (kv_transfer_params added)
        self._path = path
        self._deadline = deadline
        self._span = span
        # The decode leg sent with the current prefill attempt, and that attempt's leg.
        self._opened: asyncio.Task[tuple[DecodeStream, Lease, Lease]] | None = None
        self._leg: StockLeg | None = None

    def on_send(self, prefill: InstanceLoad, leg: StockLeg) -> Callable[[bool], None]:
        """The queue sends the prefill leg `leg` to `prefill` now: the decode leg goes at
        once if the prefill's coordinates are known. Returns what the queue calls when that
        attempt ends (True: the prefill answered 200)."""
        self._drop_opened()
        params = self._handoffs.push_params(leg) if leg.connector == PUSH else None
        if params is None or self._leases is None:
            return _ignore
        self._leg = leg
        opened = self._opened = asyncio.ensure_future(self._open(leg, params))

        def ended(answered: bool) -> None:
            if not answered and self._opened is opened:
                self._drop_opened()

        return ended

    def _open(
        self, leg: StockLeg, params: dict[str, Any]
    ) -> Coroutine[Any, Any, tuple[DecodeStream, Lease, Lease]]:
        return self._decodes.open(
            self.inst,
            as_stream({**self._body, "kv_transfer_params": params}),
            self._path,
            request_id=leg.leg_id,
            deadline=self._deadline,
            parent=self._span,
        )

    def _drop_opened(self) -> None:
        """Close the decode leg of an attempt that failed (the decode drops the request) and
        give back what it counts; the reservation stays."""
        task, self._opened, self._leg = self._opened, None, None
        if task is None:
            return
        if not task.done():
            task.cancel()  # the open gives its counts back itself
            return
        if not task.cancelled() and task.exception() is None:
            stream, *counts = task.result()
            stream.close()
            for lease in counts:
                lease.release()

    async def take(
        self,
        leg: StockLeg | None,
        answered: dict[str, Any] | None,
        body: dict[str, Any],
        path: str,
    ) -> tuple[InstanceLoad, DecodeStream, list[Lease]] | None:
        """The decode leg of the granted prefill attempt `leg`, with the client's `body` to
        `path`: the one sent with the prefill leg, or, when none was (its prefill unknown
        then, or the body changed since), one sent now with `answered`'s params
        (toy_push_proxy_server.py). None when the reserved decode refused it or could not
        be reached: the caller places the decode leg as usual (the same leg id keeps the
        prefill's match). Raises `UpstreamStatus` for a decode that answered an error."""
        task = None
        if leg is not None and leg is self._leg and body is self._body and path == self._path:
            task, self._opened, self._leg = self._opened, None, None
        self._drop_opened()
        self._body, self._path = body, path
        try:
            if task is None:
                # A prefill of another connector (a mixed group) pairs with its own decodes.
                if leg is None or leg.connector != PUSH:
                    return None
                params = leg.decode_params(answered)
                if params is None:
                    return None
                task = asyncio.ensure_future(self._open(leg, params))
            try:
                stream, held_stream, held_slot = await task
            except (UpstreamRejected, UpstreamUnreachable):
                return None  # it never took the leg: another decode may, with the same id
            return self.inst, stream, [held_stream, held_slot]
        finally:
            # The leg (taken or not) counts on its own from here: the reservation goes, and
            # its slot was not freed by that.
            leases, self._leases = self._leases, None
            for lease in leases or ():
                lease.release(slot_freed=False)

    def release(self) -> None:
        """The request ends without this decode: its leg (if one went) is closed, its counts
        given back. Idempotent."""
        self._drop_opened()
        leases, self._leases = self._leases, None
        for lease in leases or ():
            lease.release()


def _ignore(answered: bool) -> None:
    return None


class PushDecodes:
    """Reserves decodes for push requests (`reserve`); one per gateway's dispatcher."""

    def __init__(
        self,
        tracker: InstanceTracker,
        decodes: DecodeAttempts,
        handoffs: Handoffs,
        policy: Ranker,
        backoff: Backoff,
        *,
        retry_after: RetryAfter,
        waits: DecodeWaits,
        capacity: DecodeCapacity | None = None,
    ) -> None:
        """`retry_after`, `waits` (the prefilled requests waiting for a decode) and
        `capacity`: what a request that found no decode is told to wait."""
        self._tracker = tracker
        self._decodes = decodes
        self._handoffs = handoffs
        self._policy = policy
        self._backoff = backoff
        self._retry_after = retry_after
        self._waits = waits
        self._capacity = capacity
        # Requests waiting in `reserve` for a decode with room, by model and group: bounded
        # by the requests waiting, each counted once while it waits.
        self._reserving: dict[tuple[str, str | None], int] = {}

    def pushes(self, info: RequestInfo) -> bool:
        """Whether `info`'s prefills push their KV (NixlPushConnector)."""
        return self._tracker.pushed(info.model, info.group)

    async def reserve(
        self,
        info: RequestInfo,
        *,
        body: dict[str, Any],
        path: str,
        deadline: float,
        span: Span | None,
        avoid: Collection[str] = (),
    ) -> PushDecode:
        """The best-ranked push decode with room, its open stream and slot held from now; a
        request that finds every one full waits for a freed slot until `deadline`
        (`DeadlineExceeded`, as one with no decode at all)."""
        round_no = 0
        line = (info.model, info.group)
        waiting = False  # counted in `_reserving`
        try:
            while True:
                loads = self._tracker.loads(Role.DECODE, info.model, info.group)
                candidates = self._handoffs.decodes(PUSH, loads)
                ranked = self._policy.rank(info, [c for c in candidates if not c.ejected])
                ranked = [c for c in ranked if c.id not in avoid] + [
                    c for c in ranked if c.id in avoid
                ]
                for inst in ranked:
                    if self._tracker.has_room(inst.id, inst.capacity):
                        leases = (self._tracker.open_stream(inst.id), self._tracker.begin(inst.id))
                        return PushDecode(
                            inst,
                            leases,
                            self._decodes,
                            self._handoffs,
                            body=body,
                            path=path,
                            deadline=deadline,
                            span=span,
                        )
                if not waiting:
                    waiting = True
                    self._reserving[line] = self._reserving.get(line, 0) + 1
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._no_room(info, decodes=bool(candidates))
                await self._tracker.wait_freed(min(self._backoff.delay(round_no), remaining))
                round_no += 1
        finally:
            if waiting:
                left = self._reserving[line] - 1
                if left:
                    self._reserving[line] = left
                else:
                    del self._reserving[line]

    def _no_room(self, info: RequestInfo, *, decodes: bool) -> DeadlineExceeded:
        """The deadline passed with no push decode reserved. With none at all, a new one
        shows at the gateway's next read of the membership. With all full, until their pace
        has taken those waiting beyond their free slots: the push requests waiting here and
        the prefilled requests waiting for a decode of the same model and group (a push
        decode that refused its leg sends its request there), which the same slots serve."""
        if not decodes:
            return DeadlineExceeded(
                "no decode instance for a push prefill before the TTFT deadline",
                retry_after=self._retry_after.membership(),
            )
        line = (info.model, info.group)
        waiting = self._reserving.get(line, 0) + self._waits.waiting(*line)
        return DeadlineExceeded(
            "no decode instance had room for a push prefill before the TTFT deadline",
            retry_after=until_decode_room(self._retry_after, self._capacity, info, waiting),
        )
