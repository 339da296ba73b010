"""The gateway-held queue (P/D-Serve section 3.5): requests wait here, never in a prefill.

One `WaitQueue` per (model, group). Bounded: a full queue refuses at once (the caller answers
503 + Retry-After). Order is FIFO or earliest-deadline-first. A request that a prefill
rejected goes back to its old place (its key is kept), so a rejection never costs it its turn.
Expiry is the waiter's own business: it stops waiting at its deadline and leaves the queue.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from config import QueueOrder
from policies.base import RequestInfo


class WaiterState(StrEnum):
    QUEUED = "queued"
    IN_FLIGHT = "in_flight"  # sent to a prefill, answer pending
    DONE = "done"


@dataclass(eq=False)
class Waiter:
    """One request waiting for a prefill. Resolved by the forwarder through `future`."""

    info: RequestInfo
    body: dict[str, Any]  # the prefill-leg body
    request_id: str
    deadline: float  # monotonic
    future: asyncio.Future[Any]
    key: tuple[float, int] = (0.0, 0)
    state: WaiterState = WaiterState.QUEUED
    attempts: int = 0  # prefill calls made for it
    rejections: int = 0
    attempt_task: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def done(self) -> bool:
        return self.state is WaiterState.DONE or self.future.done()


class WaitQueue:
    def __init__(self, max_size: int, order: QueueOrder) -> None:
        self._max_size = max_size
        self._order = order
        self._heap: list[tuple[tuple[float, int], Waiter]] = []
        self._live = 0  # queued waiters; the heap may also hold removed ones (lazy deletion)
        self._seq = itertools.count()
        self._nonempty = asyncio.Event()

    def __len__(self) -> int:
        return self._live

    @property
    def full(self) -> bool:
        return self._live >= self._max_size

    def push(self, waiter: Waiter) -> bool:
        """Queue a new waiter; False when the queue is full."""
        if self.full:
            return False
        seq = next(self._seq)
        waiter.key = (waiter.deadline, seq) if self._order is QueueOrder.EDF else (float(seq), seq)
        self._insert(waiter)
        return True

    def requeue(self, waiter: Waiter) -> None:
        """Put back a waiter a prefill rejected, at its old place. Never refused: it was
        counted against the bound when it first came in."""
        self._insert(waiter)

    def _insert(self, waiter: Waiter) -> None:
        waiter.state = WaiterState.QUEUED
        heapq.heappush(self._heap, (waiter.key, waiter))
        self._live += 1
        self._nonempty.set()

    def remove(self, waiter: Waiter) -> None:
        """Take a queued waiter out (expired, cancelled); it is skipped when reached."""
        if waiter.state is WaiterState.QUEUED:
            waiter.state = WaiterState.DONE
            self._live -= 1
            self._compact()

    def peek(self) -> Waiter | None:
        self._drop_dead_head()
        return self._heap[0][1] if self._heap else None

    def pop(self) -> Waiter | None:
        self._drop_dead_head()
        if not self._heap:
            return None
        _, waiter = heapq.heappop(self._heap)
        self._live -= 1
        waiter.state = WaiterState.IN_FLIGHT
        if not self._live:
            self._nonempty.clear()
        return waiter

    async def wait_nonempty(self) -> None:
        await self._nonempty.wait()

    def _drop_dead_head(self) -> None:
        while self._heap and self._heap[0][1].state is not WaiterState.QUEUED:
            heapq.heappop(self._heap)
        if not self._live:
            self._nonempty.clear()

    def _compact(self) -> None:
        # Lazy deletion must not let removed entries pile up behind a long-lived head.
        if len(self._heap) > 2 * self._live + 64:
            self._heap = [(k, w) for k, w in self._heap if w.state is WaiterState.QUEUED]
            heapq.heapify(self._heap)
        if not self._live:
            self._nonempty.clear()
