"""The gateway-held queue (P/D-Serve section 3.5): requests wait here, never in a prefill.

One `WaitQueue` per (model, group). Which waiting request goes next, in order:

1. **Priority class**: strictly the most urgent class with waiters (0 before 1 before 2).
2. **A start guard** (off unless `guard_s` > 0): a request that earliest-deadline-first would
   not pick, whose latest start (its deadline minus a *pessimistic* estimate of its prefill)
   is within `guard_s`, goes first, so EDF cannot starve a long-deadline, long-prompt request
   (a document) until it is too late to start. A request past its latest start is left to
   EDF and early drop: by the estimate it would fail anyway, and letting such requests go
   first (least slack first) is the overload domino: past capacity, a guard that used the
   optimistic estimate and kept late requests lost most of the successes EDF kept.
3. **Per-tenant fairness by token cost** (a virtual token counter, as in VTC, Sheng et al.
   2024): each tenant is charged the token cost of what it sends (prompt + max output
   tokens, divided by its weight), and the tenant charged least goes next; a tenant that
   comes back after being idle starts at the least charged active tenant's count, so idling
   earns no credit.
4. **Within a tenant**: FIFO or earliest-deadline-first.

A request a prefill rejected goes back to its old place (its keys are kept and its charge
refunded), so a rejection never costs it its turn. So does the retry of a request the
queue refused, sent again after its Retry-After (`Waiter.place`, places.py): it goes where
its first try stood, ahead of the requests that came since. Expiry is the waiter's own
business: it stops waiting at its deadline and leaves the queue.

**429 or 503, the one rule.** 429 (`OVER_SHARE`: back off, the fleet is busy *for you*)
means other tenants are waiting too and the request's tenant already holds its share of the
queue; 503 (`FULL`: no capacity) means the queue is full and every tenant in it is within
its share, so nobody could be let in. A tenant's share is the queue's bound split among the
tenants with waiters (the newcomer's included) by their weights; it is enforced once the
queue is half full (below that, anyone may queue), and a tenant alone may fill the queue. A
request whose tenant is under its share is never refused while another tenant is over its
share: it takes the place of that tenant's newest request (`displace_for`), and that request
is the one told 429. So a heavy tenant cannot turn a light tenant's requests into 503s by
filling the queue first.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from pdgate.config import QueueOrder
from pdgate.config.tracing import Span
from pdgate.config.wire import COMPLETIONS_PATH
from pdgate.policies.base import RequestInfo

if TYPE_CHECKING:
    from pdgate.gateway.placement.handoff import OnSend

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
    key: tuple[float, int] = (0.0, 0)  # order within its tenant (0: not queued yet)
    # Its place kept from an earlier try that the queue refused (places.py): the order value
    # (deadline in EDF, arrival in FIFO) that try had.
    place: float | None = None
    state: WaiterState = WaiterState.QUEUED
    attempts: int = 0  # prefill calls made for it
    rejections: int = 0
    attempt_task: asyncio.Task[None] | None = field(default=None, repr=False)
    span: Span | None = field(default=None, repr=False)  # the request's trace span
    # Latest start: the deadline minus a pessimistic estimate of its prefill (the start guard).
    latest_start: float = float("inf")
    charged: float = 0.0  # its tenant's counter was charged this much when it was sent
    held_since: float | None = None  # monotonic: first held for a busy prefill's cache
    path: str = COMPLETIONS_PATH  # the API its prefill leg goes to
    # Admitted before: a failover, or a stream continuing after its decode broke. Drain
    # admission judges arrivals: it neither refuses nor sweeps one whose client waited already
    # (or holds part of its answer).
    admitted: bool = False
    # Called as its prefill leg goes to a stock server (the prefill, its legs); returns what
    # to call when that attempt ends (True: answered 200). The push flow sends the decode
    # leg with it (gateway/placement/push.py).
    on_send: OnSend | None = field(default=None, repr=False)

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

    def pop_head(self) -> None:
        heapq.heappop(self.entries)

    def compact(self, live: int) -> None:
        # Lazy deletion must not let removed entries pile up behind a long-lived head.
        if len(self.entries) > 2 * live + 64:
            self.entries = [e for e in self.entries if e[1].state is WaiterState.QUEUED]
            heapq.heapify(self.entries)


@dataclass
class _Tenant:
    heap: _Heap = field(default_factory=_Heap)
    queued: int = 0
    weight: float = 1.0  # its share weight, as its latest request said


@dataclass
class _Class:
    tenants: dict[str, _Tenant] = field(default_factory=dict)  # tenants with waiters
    latest_start: _Heap = field(default_factory=_Heap)  # all waiters, by latest start
    queued: int = 0


class WaitQueue:
    def __init__(self, max_size: int, order: QueueOrder, *, guard_s: float = 0.0) -> None:
        self._max_size = max_size
        self._order = order
        self._guard_s = guard_s
        self._classes: dict[int, _Class] = {}
        self._counters: dict[str, float] = {}  # tenant -> tokens charged (insertion = LRU)
        self._deadlines = _Heap()  # every queued waiter by deadline (fleet heads)
        self._live = 0
        self._seq = itertools.count(1)
        self._nonempty = asyncio.Event()
        self._arrived = asyncio.Event()  # replaced (after being set) on every insertion

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
        """Queue a new waiter, unless the queue is full (`FULL`) or, once it is half full,
        its tenant already holds its share (`OVER_SHARE`). After `FULL`, `displace_for` may
        make room for it at an over-share tenant's expense."""
        if self._over_share(waiter):
            return Admission.OVER_SHARE
        if self.full:
            return Admission.FULL
        seq = next(self._seq)
        waiter.key = (self._arrival_order(waiter, seq), seq)
        self._insert(waiter)
        return Admission.OK

    @property
    def max_size(self) -> int:
        return self._max_size

    def place_of(self, waiter: Waiter) -> float:
        """`waiter`'s order value in this queue: its kept place, its key's if it was queued
        here, else an arrival's now (its deadline in EDF, its arrival in FIFO)."""
        if waiter.place is None and waiter.key[1]:
            return waiter.key[0]
        return self._arrival_order(waiter)

    def _arrival_order(self, waiter: Waiter, seq: int | None = None) -> float:
        """An arrival's order value: its kept place, else its deadline (EDF) or its sequence
        number (FIFO: `seq`, or the next one, drawn only then)."""
        if waiter.place is not None:
            return waiter.place
        if self._order is QueueOrder.EDF:
            return waiter.deadline
        return float(next(self._seq) if seq is None else seq)

    def _queued_by_tenant(self) -> dict[str, tuple[int, float]]:
        """Tenant -> (queued, weight) over every class."""
        out: dict[str, tuple[int, float]] = {}
        for cls in self._classes.values():
            for name, t in cls.tenants.items():
                queued, _ = out.get(name, (0, t.weight))
                out[name] = (queued + t.queued, t.weight)
        return out

    def _shares(self, newcomer: Waiter) -> tuple[dict[str, tuple[int, float]], float]:
        """Queued and weight per active tenant (the newcomer's included), and the queue's bound
        per unit of weight."""
        tenants = self._queued_by_tenant()
        queued, _ = tenants.get(newcomer.tenant, (0, 0.0))
        tenants[newcomer.tenant] = (queued, max(newcomer.info.weight, 1e-6))
        return tenants, self._max_size / sum(w for _, w in tenants.values())

    def overflow(self) -> int:
        """The requests that must leave before the queue has room for one more."""
        return max(0, self._live - self._max_size + 1)

    def share(self, waiter: Waiter) -> float:
        """The part of the queue's turns that `waiter`'s tenant gets while the tenants with
        waiters (its own included) all have some: its weight over theirs."""
        tenants, per_weight = self._shares(waiter)
        return tenants[waiter.tenant][1] * per_weight / self._max_size

    def _over_share(self, waiter: Waiter) -> bool:
        if self._live * 2 < self._max_size:
            return False
        tenants, per_weight = self._shares(waiter)
        if len(tenants) < 2:
            return False  # alone: the bound is its only limit (FULL)
        mine, weight = tenants[waiter.tenant]
        return mine >= weight * per_weight

    def displace_for(self, waiter: Waiter) -> Waiter | None:
        """Make room in a full queue for `waiter`, whose tenant is under its share: take out
        the newest request of the tenant furthest over its share and return it (the caller
        tells it 429). None when every tenant is within its share (the newcomer gets 503)."""
        tenants, per_weight = self._shares(waiter)
        mine, weight = tenants[waiter.tenant]
        if mine >= weight * per_weight:
            return None
        excess = {n: q - w * per_weight for n, (q, w) in tenants.items() if n != waiter.tenant}
        victim_tenant = max(excess, key=lambda n: excess[n], default=None)
        if victim_tenant is None or excess[victim_tenant] <= 0:
            return None
        newest: Waiter | None = None
        for priority, cls in self._classes.items():
            tenant = cls.tenants.get(victim_tenant)
            if tenant is None:
                continue
            for _, w in tenant.heap.entries:
                # Its least urgent class first, then its latest in its own order.
                if w.state is WaiterState.QUEUED and (
                    newest is None or (priority, w.key) > (newest.info.priority, newest.key)
                ):
                    newest = w
        if newest is not None:
            self.remove(newest)
        return newest

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
        tenant.weight = max(waiter.info.weight, 1e-6)
        if self._guard_s > 0 and time.monotonic() <= waiter.latest_start < float("inf"):
            cls.latest_start.push((waiter.latest_start, waiter.key[1]), waiter)
        cls.queued += 1
        self._deadlines.push((waiter.deadline, waiter.key[1]), waiter)
        self._live += 1
        self._nonempty.set()
        arrived, self._arrived = self._arrived, asyncio.Event()
        arrived.set()

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

    def ahead(self, waiter: Waiter, at: float | None = None) -> int:
        """A lower bound of the other queued requests that would go before `waiter` were it
        queued now at order value `at`: every request of a more urgent class, and those of
        its own tenant and class that its order puts first. By default it goes where its
        kept place puts it, else after all of them in FIFO and after those due no later in
        EDF. Other tenants' are not counted: fair sharing may let it pass them. O(its
        tenant's queued) unless it goes last in FIFO."""
        priority = waiter.info.priority
        n = sum(c.queued for p, c in self._classes.items() if p < priority)
        cls = self._classes.get(priority)
        tenant = None if cls is None else cls.tenants.get(waiter.tenant)
        if tenant is None:
            return n
        at = waiter.place if at is None else at
        if at is None and self._order is not QueueOrder.EDF:
            queued = waiter.key[1] and waiter.state is WaiterState.QUEUED  # itself
            return n + tenant.queued - bool(queued)
        live = (
            (k, w)
            for k, w in tenant.heap.entries
            if w.state is WaiterState.QUEUED and w is not waiter
        )
        if at is not None:
            return n + sum(1 for k, _ in live if k[0] < at)
        return n + sum(1 for _, w in live if w.deadline <= waiter.deadline)

    def waiters(self) -> list[Waiter]:
        """Every queued waiter, in no particular order."""
        return [w for _, w in self._deadlines.entries if w.state is WaiterState.QUEUED]

    def beyond_reach(self, reach: Callable[[float], float], now: float) -> list[Waiter]:
        """The queued waiters that the pace cannot reach before their deadlines: more
        requests surely ahead of each (as `ahead` counts them) than `reach(its time left)`,
        the grants to count on in that time. O(n log n)."""
        out: list[Waiter] = []
        before = 0  # queued in more urgent classes
        for priority in sorted(self._classes):
            cls = self._classes[priority]
            for tenant in cls.tenants.values():
                live = sorted(
                    (e for e in tenant.heap.entries if e[1].state is WaiterState.QUEUED),
                    key=lambda e: e[0],
                )
                out += [w for i, (_, w) in enumerate(live) if before + i > reach(w.deadline - now)]
            before += cls.queued
        return out

    def peek(self) -> Waiter | None:
        """The waiter that goes next (see the module docstring)."""
        if not self._live:
            return None
        cls = self._classes[min(self._classes)]
        name = min(cls.tenants, key=lambda n: self._counters.get(n, 0.0))
        head = cls.tenants[name].heap.head()
        if self._guard_s > 0:
            urgent = self._guarded(cls)
            if urgent is not None and (head is None or urgent.key > head.key):
                return urgent
        return head

    def _guarded(self, cls: _Class) -> Waiter | None:
        """The request of `cls` whose latest start comes first, if it is within the guard."""
        now = time.monotonic()
        guard = cls.latest_start
        urgent = guard.head()
        while urgent is not None and urgent.latest_start < now:
            guard.pop_head()  # too late to start in time: EDF and early drop decide
            urgent = guard.head()
        if urgent is not None and urgent.latest_start <= now + self._guard_s:
            return urgent
        return None

    def pop(self) -> Waiter | None:
        waiter = self.peek()
        if waiter is not None:
            self.take(waiter)
        return waiter

    def take(self, waiter: Waiter) -> None:
        """Take a queued waiter out to send it (the head, or one that passes a held head),
        charging its tenant."""
        assert waiter.state is WaiterState.QUEUED
        waiter.state = WaiterState.IN_FLIGHT
        waiter.charged = waiter.cost
        self._counters[waiter.tenant] = self._counters.get(waiter.tenant, 0.0) + waiter.charged
        self._forget(waiter)

    def ordered(self, limit: int) -> list[Waiter]:
        """Up to `limit` queued waiters in the order they would go (the head first), without
        taking them: whom a free prefill may take while the head is held for another.
        O(queued): called only while a head is held."""
        out: list[Waiter] = []
        head = self.peek()
        if head is None or limit <= 0:
            return out
        out.append(head)
        for _, cls in sorted(self._classes.items()):
            # Replay the tenants' counters as pops would move them.
            counters = {n: self._counters.get(n, 0.0) for n in cls.tenants}
            lines = {
                n: iter(
                    heapq.nsmallest(
                        limit,
                        (e for e in t.heap.entries if e[1].state is WaiterState.QUEUED),
                    )
                )
                for n, t in cls.tenants.items()
            }
            nxt = {n: next(line, None) for n, line in lines.items()}
            while len(out) < limit:
                ready = [n for n, e in nxt.items() if e is not None]
                if not ready:
                    break
                name = min(ready, key=lambda n: counters[n])
                entry = nxt[name]
                assert entry is not None
                waiter = entry[1]
                nxt[name] = next(lines[name], None)
                if waiter is head:
                    continue
                out.append(waiter)
                counters[name] += waiter.cost
            if len(out) >= limit:
                break
        return out

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

    def wait_arrival(self) -> Coroutine[Any, Any, bool]:
        """Until the next waiter is queued (a new one, or one put back). The event is taken
        at the call, so an arrival before the first await still counts."""
        return self._arrived.wait()
