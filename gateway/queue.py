"""The gateway-held queue (P/D-Serve section 3.5): requests wait here, never in a prefill.

One `WaitQueue` per (model, group). Which waiting request goes next, in order:

1. **Priority class**: strictly the most urgent class with waiters (0 before 1 before 2).
2. **A deadline guard**: a request whose latest start (its deadline minus an estimate of its
   prefill) is within `guard_s` goes first, so earliest-deadline-first cannot starve a
   long-deadline request (a long document) until it is too late to start.
3. **Per-tenant fairness by token cost** (a virtual token counter, as in VTC, Sheng et al.
   2024): each tenant is charged the token cost of what it sends (prompt + max output
   tokens, divided by its weight), and the tenant charged least goes next; a tenant that
   comes back after being idle starts at the least charged active tenant's count, so idling
   earns no credit.
4. **Within a tenant**: FIFO or earliest-deadline-first.

A request a prefill rejected goes back to its old place (its keys are kept and its charge
refunded), so a rejection never costs it its turn. Bounded: the queue holds `max_size`
requests, and once it is half full a tenant holding more than its share (`max_size` / active
tenants) is refused with `OVER_SHARE` (the caller answers 429: back off, the fleet is busy
for you) while `FULL` (503: no capacity) is for everyone. Expiry is the waiter's own
business: it stops waiting at its deadline and leaves the queue.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from pdgate.config import QueueOrder
from pdgate.config.tracing import Span
from pdgate.config.wire import COMPLETIONS_PATH
from pdgate.policies.base import RequestInfo

__all__ = ["Admission", "WaitQueue", "Waiter", "WaiterState"]

_MAX_TENANTS = 4096  # counters of idle tenants beyond this are forgotten (oldest first)


class WaiterState(StrEnum):
    QUEUED = "queued"
    IN_FLIGHT = "in_flight"  # sent to a prefill, answer pending
    DONE = "done"


class Admission(StrEnum):
    OK = "ok"
    FULL = "full"  # no room for anyone: 503
    OVER_SHARE = "over_share"  # this tenant holds more than its share: 429


@dataclass(eq=False)
class Waiter:
    """One request waiting for a prefill. Resolved by the forwarder through `future`."""

    info: RequestInfo
    body: dict[str, Any]  # the prefill-leg body
    request_id: str
    deadline: float  # monotonic
    future: asyncio.Future[Any]
    key: tuple[float, int] = (0.0, 0)  # order within its tenant
    state: WaiterState = WaiterState.QUEUED
    attempts: int = 0  # prefill calls made for it
    rejections: int = 0
    attempt_task: asyncio.Task[None] | None = field(default=None, repr=False)
    span: Span | None = field(default=None, repr=False)  # the request's trace span
    # Latest start: the deadline minus an (optimistic) estimate of its prefill.
    latest_start: float = float("inf")
    charged: float = 0.0  # its tenant's counter was charged this much when it was sent
    path: str = COMPLETIONS_PATH  # the API its prefill leg goes to

    @property
    def done(self) -> bool:
        return self.state is WaiterState.DONE or self.future.done()

    @property
    def tenant(self) -> str:
        return self.info.tenant

    @property
    def cost(self) -> float:
        return (self.info.prompt_chars / 4 + self.info.max_tokens) / max(self.info.weight, 1e-6)


class _Heap:
    """A min-heap with lazy deletion of waiters no longer queued."""

    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: list[tuple[tuple[float, int], Waiter]] = []

    def push(self, key: tuple[float, int], waiter: Waiter) -> None:
        heapq.heappush(self.entries, (key, waiter))

    def head(self) -> Waiter | None:
        while self.entries and self.entries[0][1].state is not WaiterState.QUEUED:
            heapq.heappop(self.entries)
        return self.entries[0][1] if self.entries else None

    def compact(self, live: int) -> None:
        # Lazy deletion must not let removed entries pile up behind a long-lived head.
        if len(self.entries) > 2 * live + 64:
            self.entries = [e for e in self.entries if e[1].state is WaiterState.QUEUED]
            heapq.heapify(self.entries)


@dataclass
class _Tenant:
    heap: _Heap = field(default_factory=_Heap)
    queued: int = 0


@dataclass
class _Class:
    tenants: dict[str, _Tenant] = field(default_factory=dict)  # tenants with waiters
    latest_start: _Heap = field(default_factory=_Heap)  # all waiters, by latest start
    queued: int = 0


class WaitQueue:
    def __init__(self, max_size: int, order: QueueOrder, *, guard_s: float = 0.25) -> None:
        self._max_size = max_size
        self._order = order
        self._guard_s = guard_s
        self._classes: dict[int, _Class] = {}
        self._counters: dict[str, float] = {}  # tenant -> tokens charged (insertion = LRU)
        self._deadlines = _Heap()  # every queued waiter by deadline (fleet heads)
        self._live = 0
        self._seq = itertools.count()
        self._nonempty = asyncio.Event()

    def __len__(self) -> int:
        return self._live

    @property
    def full(self) -> bool:
        return self._live >= self._max_size

    def tenants(self) -> Iterator[tuple[int, str, int, float]]:
        """(priority, tenant, queued, tokens charged) of the tenants with waiters."""
        for priority, cls in sorted(self._classes.items()):
            for name, t in cls.tenants.items():
                yield priority, name, t.queued, self._counters.get(name, 0.0)

    def push(self, waiter: Waiter) -> Admission:
        """Queue a new waiter, unless the queue (or this tenant's share of it) is full."""
        if self.full:
            return Admission.FULL
        if self._live * 2 >= self._max_size:
            active = {n for c in self._classes.values() for n in c.tenants} | {waiter.tenant}
            mine = sum(
                c.tenants[waiter.tenant].queued
                for c in self._classes.values()
                if waiter.tenant in c.tenants
            )
            if len(active) > 1 and mine >= self._max_size / len(active):
                return Admission.OVER_SHARE
        seq = next(self._seq)
        waiter.key = (waiter.deadline, seq) if self._order is QueueOrder.EDF else (float(seq), seq)
        self._insert(waiter)
        return Admission.OK

    def requeue(self, waiter: Waiter) -> None:
        """Put back a waiter a prefill rejected, at its old place, its charge refunded. Never
        refused: it was counted against the bound when it first came in."""
        if waiter.charged:
            self._counters[waiter.tenant] = self._counters.get(waiter.tenant, 0.0) - waiter.charged
            waiter.charged = 0.0
        self._insert(waiter)

    def _insert(self, waiter: Waiter) -> None:
        waiter.state = WaiterState.QUEUED
        cls = self._classes.setdefault(waiter.info.priority, _Class())
        tenant = cls.tenants.get(waiter.tenant)
        if tenant is None:
            tenant = cls.tenants[waiter.tenant] = _Tenant()
            self._activate(cls, waiter.tenant)
        tenant.heap.push(waiter.key, waiter)
        tenant.queued += 1
        cls.latest_start.push((waiter.latest_start, waiter.key[1]), waiter)
        cls.queued += 1
        self._deadlines.push((waiter.deadline, waiter.key[1]), waiter)
        self._live += 1
        self._nonempty.set()

    def _activate(self, cls: _Class, name: str) -> None:
        """A tenant with nothing waiting comes back: no credit for having been idle."""
        others = [self._counters.get(n, 0.0) for n in cls.tenants if n != name]
        floor = min(others) if others else None
        counter = self._counters.pop(name, 0.0)  # re-inserted: most recently used last
        self._counters[name] = max(counter, floor) if floor is not None else counter
        while len(self._counters) > _MAX_TENANTS:
            oldest = next(iter(self._counters))
            if any(oldest in c.tenants for c in self._classes.values()):
                break  # never forget an active tenant; the bound is on idle ones
            del self._counters[oldest]

    def remove(self, waiter: Waiter) -> None:
        """Take a queued waiter out (expired, cancelled); it is skipped when reached."""
        if waiter.state is WaiterState.QUEUED:
            waiter.state = WaiterState.DONE
            self._forget(waiter)

    def _forget(self, waiter: Waiter) -> None:
        cls = self._classes[waiter.info.priority]
        tenant = cls.tenants[waiter.tenant]
        tenant.queued -= 1
        cls.queued -= 1
        self._live -= 1
        if not tenant.queued:
            del cls.tenants[waiter.tenant]
        else:
            tenant.heap.compact(tenant.queued)
        if not cls.queued:
            del self._classes[waiter.info.priority]
        else:
            cls.latest_start.compact(cls.queued)
        self._deadlines.compact(self._live)
        if not self._live:
            self._nonempty.clear()

    def peek(self) -> Waiter | None:
        """The waiter that goes next (see the module docstring)."""
        if not self._live:
            return None
        cls = self._classes[min(self._classes)]
        urgent = cls.latest_start.head()
        if urgent is not None and urgent.latest_start <= time.monotonic() + self._guard_s:
            return urgent
        name = min(cls.tenants, key=lambda n: self._counters.get(n, 0.0))
        return cls.tenants[name].heap.head()

    def pop(self) -> Waiter | None:
        waiter = self.peek()
        if waiter is None:
            return None
        waiter.state = WaiterState.IN_FLIGHT
        waiter.charged = waiter.cost
        self._counters[waiter.tenant] = self._counters.get(waiter.tenant, 0.0) + waiter.charged
        self._forget(waiter)
        return waiter

    def deadline_after(self, skip: int) -> float | None:
        """The `skip`-th earliest deadline of the queued waiters (0 = the earliest), None if
        fewer are queued. O(n log k): the heap also holds removed entries."""
        if skip >= self._live:
            return None
        entries = self._deadlines.entries
        dead = len(entries) - self._live
        for _, waiter in heapq.nsmallest(skip + 1 + dead, entries):
            if waiter.state is WaiterState.QUEUED:
                if skip == 0:
                    return waiter.deadline
                skip -= 1
        return None

    async def wait_nonempty(self) -> None:
        await self._nonempty.wait()
