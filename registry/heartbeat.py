"""Instance side of membership: keep this instance's record alive in the registry.

The record lives ``ttl_s`` after each refresh, so an instance that dies without
deregistering (kill -9, lost host) disappears by itself; a clean `stop()` removes it at once.
A registry outage never takes the instance down: the heartbeat keeps retrying, and its first
success after an outage is announced, because a restarted Redis has forgotten everyone.
"""

from __future__ import annotations

import asyncio
import logging

from pdgate.config.aio import Backoff, ExponentialBackoff, cancel_and_wait
from pdgate.registry.base import (
    InstanceRecord,
    InstanceState,
    Registry,
    RegistryAuthError,
    RegistryError,
)

logger = logging.getLogger(__name__)


class Heartbeat:
    def __init__(
        self,
        registry: Registry,
        record: InstanceRecord,
        *,
        interval_s: float,
        ttl_s: float,
        backoff: Backoff | None = None,
        stop_timeout_s: float = 1.0,
    ) -> None:
        if interval_s <= 0 or ttl_s <= interval_s:
            raise ValueError("need 0 < interval_s < ttl_s")
        self._registry = registry
        self._record = record
        self._interval_s = interval_s
        self._ttl_s = ttl_s
        # After a failure, retry sooner than the interval (never later): the record is
        # already on its way to expiry, and a restarted Redis should see us quickly.
        self._backoff = backoff or ExponentialBackoff(min(0.1, interval_s), interval_s)
        self._stop_timeout_s = stop_timeout_s
        # Serialises puts, so a slow periodic refresh cannot land after (and undo) a state change.
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._failures = 0  # consecutive failed puts
        self._announce = True  # the next successful put publishes JOIN
        self._stopped = False

    @property
    def record(self) -> InstanceRecord:
        return self._record

    @property
    def registered(self) -> bool:
        """Whether the last refresh succeeded (for health endpoints)."""
        return self._task is not None and self._failures == 0 and not self._announce

    async def start(self) -> None:
        """Register now if possible, then keep refreshing in the background. Never raises
        for registry failures: those are logged and retried."""
        if self._task is not None or self._stopped:
            raise RuntimeError("heartbeat already started or stopped")
        failure = await self._beat()
        if isinstance(failure, RegistryAuthError):
            # Bad credentials will not heal by retrying: fail start-up, loudly.
            raise failure
        self._task = asyncio.create_task(self._run(), name=f"heartbeat:{self._record.id}")

    async def update(self, record: InstanceRecord) -> None:
        """Advertise `record` (same id) from now on, in the state the current one is in; a
        change is announced at once (what the instance serves changed, e.g. an adapter
        loaded), an equal record costs nothing."""
        if record.id != self._record.id:
            raise ValueError("a heartbeat keeps one instance id")
        record = record.with_state(self._record.state)
        if record == self._record:
            return
        self._record = record
        self._announce = True
        if self._task is not None and not self._stopped:
            await self._beat()

    async def set_state(self, state: InstanceState) -> None:
        """Change the advertised state and announce it (retried by the loop if it fails)."""
        self._record = self._record.with_state(state)
        self._announce = True
        if self._task is not None and not self._stopped:
            await self._beat()

    async def stop(self) -> None:
        """Stop refreshing and deregister (best effort, bounded by ``stop_timeout_s``)."""
        if self._stopped:
            return
        self._stopped = True
        task, self._task = self._task, None
        if task is None:
            return  # never started: nothing was registered
        await cancel_and_wait([task])
        try:
            async with asyncio.timeout(self._stop_timeout_s), self._lock:
                await self._registry.remove(self._record.id)
        except (RegistryError, TimeoutError) as exc:
            logger.warning(
                "could not deregister %s (its record expires within %.1fs): %s",
                self._record.id,
                self._ttl_s,
                exc,
            )

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_beat = loop.time() + self._interval_s
        while True:
            if self._failures:
                next_beat = loop.time() + min(
                    self._interval_s, self._backoff.delay(self._failures - 1)
                )
            await asyncio.sleep(max(0.0, next_beat - loop.time()))
            # Fixed rate, not fixed delay: a slow put must not stretch the period toward the TTL.
            next_beat += self._interval_s
            await self._beat()

    async def _beat(self) -> Exception | None:
        async with self._lock:
            record, announce = self._record, self._announce
            try:
                await self._registry.put(record, self._ttl_s, announce=announce)
            except Exception as exc:  # an instance must outlive registry bugs too
                self._failed(exc)
                return exc
            if record is self._record:
                self._announce = False
            if self._failures:
                logger.info(
                    "heartbeat for %s restored after %d failed attempts; re-announced",
                    record.id,
                    self._failures,
                )
                self._failures = 0
        return None

    def _failed(self, exc: Exception) -> None:
        self._failures += 1
        self._announce = True
        if self._failures == 1:
            # Once per outage: a dead Redis would otherwise log every tick on every instance.
            logger.warning(
                "heartbeat for %s failed; retrying until the registry is back: %s",
                self._record.id,
                exc,
                exc_info=not isinstance(exc, RegistryError),
            )
        else:
            logger.debug("heartbeat for %s failed again: %s", self._record.id, exc)
