"""How late the event loop runs a timer: the gateway's own saturation signal.

CPU time says how busy the process is; loop lag says what a request feels. A gateway whose
loop is saturated, or blocked by one long callback, answers everything late, health probes
included. The monitor sleeps `interval_s` in a loop and observes how much later than asked it
woke: into a histogram (``pdgate_event_loop_lag_seconds``) in the gateway, so a scrape gives
its quantiles; into a list of samples in the benchmarks' in-process cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

__all__ = ["LoopLagMonitor"]


class LoopLagMonitor:
    """Pass the event loop's lateness (seconds) to `observe` every `interval_s` until stopped.

    One timer and one observation per interval: at the default 0.1 s, ten wake-ups a second,
    nothing next to a request's cost."""

    def __init__(self, observe: Callable[[float], None], interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self._observe = observe
        self._interval = interval_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="pdgate-loop-lag")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self._interval
        observe = self._observe
        while True:
            asked = loop.time() + interval
            await asyncio.sleep(interval)
            observe(max(0.0, loop.time() - asked))
