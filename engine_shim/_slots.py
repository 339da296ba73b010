"""Admission slots of one instance, with an optional bounded FIFO of waiters.

A `Slot` is released exactly once whatever path a request takes (release is idempotent),
so counts cannot drift. A freed slot goes straight to the oldest waiter, never to a request
that arrives later (no barging), which keeps the local queue strictly FIFO.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque


class PoolFull(Exception):
    """No free slot and no room to wait for one."""


class Slot:
    __slots__ = ("_pool", "_released")

    def __init__(self, pool: SlotPool) -> None:
        self._pool = pool
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._pool._hand_back()


class SlotPool:
    def __init__(self, capacity: int, *, queue_limit: int = 0) -> None:
        if capacity <= 0 or queue_limit < 0:
            raise ValueError("capacity must be positive and queue_limit non-negative")
        self.capacity = capacity
        self.queue_limit = queue_limit
        self._used = 0
        self._waiters: deque[asyncio.Future[Slot]] = deque()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def used(self) -> int:
        return self._used

    @property
    def free(self) -> int:
        return self.capacity - self._used

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def try_acquire(self) -> Slot | None:
        """A slot if one is free and nobody waits for it, else None."""
        if self._used >= self.capacity or self._waiters:
            return None
        self._used += 1
        self._idle.clear()
        return Slot(self)

    async def acquire(self) -> Slot:
        """A slot, waiting in FIFO order if needed; raises `PoolFull` when the queue is full."""
        slot = self.try_acquire()
        if slot is not None:
            return slot
        if len(self._waiters) >= self.queue_limit:
            raise PoolFull(f"all {self.capacity} slots are taken and the queue is full")
        waiter: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                waiter.result().release()  # handed over just as we were cancelled
            else:
                with contextlib.suppress(ValueError):  # _hand_back may have dropped it
                    self._waiters.remove(waiter)
            raise

    def _hand_back(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(Slot(self))  # the slot changes hands; `used` is unchanged
                return
        self._used -= 1
        if self._used == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no slot is taken."""
        await self._idle.wait()
