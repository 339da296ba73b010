"""In-process registry: the default when no Redis URL is configured (`pdgate up`, tests).

Everything lives in one event loop, so no locks are needed: every method runs to completion
without awaiting.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from pdgate.registry.base import (
    EventKind,
    InstanceRecord,
    RegistryError,
    RegistryEvent,
    RegistryUnavailable,
)

logger = logging.getLogger(__name__)


class _Subscription:
    """One `events()` consumer. Registered at creation, so "from now on" means now."""

    def __init__(self, on_close: Callable[[_Subscription], None], queue_size: int) -> None:
        self._on_close = on_close
        # None is the end-of-stream marker (overflow or registry closed).
        self._queue: asyncio.Queue[RegistryEvent | None] = asyncio.Queue(queue_size)
        self._ended = False

    def offer(self, event: RegistryEvent) -> bool:
        """Queue `event`; False (and the stream ends) when the consumer is too far behind."""
        try:
            self._queue.put_nowait(event)
        except asyncio.QueueFull:
            self.end()
            return False
        return True

    def end(self) -> None:
        if self._ended:
            return
        self._ended = True
        # Whatever is still queued is stale once the consumer must re-poll anyway.
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put_nowait(None)

    def __aiter__(self) -> _Subscription:
        return self

    async def __anext__(self) -> RegistryEvent:
        event = await self._queue.get()
        if event is None:
            self._queue.put_nowait(None)  # keep later calls ending too
            raise StopAsyncIteration
        return event

    async def wait_subscribed(self) -> None:
        return None

    async def aclose(self) -> None:
        self._on_close(self)
        self.end()


class MemoryRegistry:
    """`Registry` kept in a dict: id -> (record, monotonic expiry)."""

    def __init__(
        self,
        *,
        max_instances: int = 4096,
        queue_size: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_instances <= 0 or queue_size <= 0:
            raise ValueError("max_instances and queue_size must be positive")
        self._max_instances = max_instances
        self._queue_size = queue_size
        self._clock = clock
        self._records: dict[str, tuple[InstanceRecord, float]] = {}
        self._subscribers: set[_Subscription] = set()
        self._closed = False

    async def put(self, record: InstanceRecord, ttl_s: float, *, announce: bool = False) -> None:
        self._check_open()
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        now = self._clock()
        if record.id not in self._records and len(self._records) >= self._max_instances:
            # Pruning is O(n): only pay for it when the bound is actually reached.
            self._prune(now)
            if len(self._records) >= self._max_instances:
                raise RegistryError(f"registry full ({self._max_instances} instances)")
        self._records[record.id] = (record, now + ttl_s)
        if announce:
            self._publish(RegistryEvent(EventKind.JOIN, record.id, record))

    async def remove(self, instance_id: str) -> None:
        self._check_open()
        self._records.pop(instance_id, None)
        # Published even if the record had already expired, like the Redis registry does.
        self._publish(RegistryEvent(EventKind.LEAVE, instance_id))

    async def snapshot(self) -> list[InstanceRecord]:
        self._check_open()
        self._prune(self._clock())
        return [record for record, _ in self._records.values()]

    def generation(self) -> str | None:
        return None  # one process's memory: it never loses its state while in use

    def events(self) -> _Subscription:
        sub = _Subscription(self._subscribers.discard, self._queue_size)
        if self._closed:
            sub.end()
        else:
            self._subscribers.add(sub)
        return sub

    async def aclose(self) -> None:
        self._closed = True
        for sub in self._subscribers:
            sub.end()
        self._subscribers.clear()
        self._records.clear()

    def _prune(self, now: float) -> None:
        expired = [i for i, (_, expiry) in self._records.items() if expiry <= now]
        for instance_id in expired:
            del self._records[instance_id]

    def _publish(self, event: RegistryEvent) -> None:
        dropped = [sub for sub in self._subscribers if not sub.offer(event)]
        for sub in dropped:
            self._subscribers.discard(sub)
            logger.warning(
                "registry event subscriber fell %d events behind; dropped (it re-polls)",
                self._queue_size,
            )

    def _check_open(self) -> None:
        if self._closed:
            raise RegistryUnavailable("memory registry is closed")
