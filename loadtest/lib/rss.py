"""Sampling a process's resident memory over time, and what the samples say: is it flat
after warm-up, and how much does it grow per minute and per request?"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdgate.loadtest.lib import procfs

__all__ = ["Growth", "RssSample", "RssSampler", "growth"]

_MAX_SAMPLES = 100_000  # a day at one sample per second: bounds a forgotten sampler


@dataclass(frozen=True, slots=True)
class RssSample:
    t_s: float  # since the sampler started
    rss_kib: int
    requests: int  # what the `count` callable said at that moment (requests issued so far)


class RssSampler:
    """Reads ``VmRSS`` of `pid` every `period_s` in a background task, with a request count
    next to each reading. `take` adds one reading at once (e.g. at the end of a run)."""

    def __init__(self, pid: int, period_s: float, count: Callable[[], int] = lambda: 0) -> None:
        if period_s <= 0:
            raise ValueError("period_s must be positive")
        self._pid = pid
        self._period = period_s
        self._count = count
        self._t0 = time.monotonic()
        self._task: asyncio.Task[None] | None = None
        self.samples: list[RssSample] = []

    def take(self) -> RssSample:
        sample = RssSample(time.monotonic() - self._t0, procfs.rss_kib(self._pid), self._count())
        if len(self.samples) < _MAX_SAMPLES:
            self.samples.append(sample)
        return sample

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._task = asyncio.create_task(self._run(), name=f"rss-{self._pid}")

    async def _run(self) -> None:
        next_at = time.monotonic()
        while True:
            self.take()
            # On a fixed grid, so a slow read does not stretch every later period.
            next_at += self._period
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))

    async def finish(self) -> RssSample:
        """Stop sampling and end on a reading taken now (unless one was just taken)."""
        await self.stop()
        last = self.samples[-1] if self.samples else None
        if last is not None and time.monotonic() - self._t0 - last.t_s < self._period / 10:
            return last
        return self.take()

    async def stop(self) -> None:
        """Stop sampling; a read that failed (the process died) is raised here."""
        task, self._task = self._task, None
        if task is None:
            return
        if task.done():
            task.result()
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@dataclass(frozen=True, slots=True)
class Growth:
    warm_kib: int  # the first sample at or after the warm-up
    end_kib: int  # the last sample
    max_kib: int  # the largest sample after the warm-up
    growth_kib: int  # end - warm
    growth_pct: float
    slope_kib_per_min: float  # least-squares fit over the samples after the warm-up
    kib_per_1k_requests: float  # growth over the requests issued between the two samples
    requests: int  # issued between the warm sample and the last one


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    n = len(xs)
    if n < 2:
        return math.nan
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return math.nan
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var


def growth(samples: Sequence[RssSample], warmup_s: float) -> Growth:
    """How RSS moved after `warmup_s` (seconds since the sampler started)."""
    after = [s for s in samples if s.t_s >= warmup_s]
    if not after:
        raise ValueError(f"no sample at or after the warm-up ({warmup_s:g} s)")
    warm, end = after[0], after[-1]
    grown = end.rss_kib - warm.rss_kib
    requests = end.requests - warm.requests
    slope = _slope([s.t_s for s in after], [float(s.rss_kib) for s in after])
    return Growth(
        warm_kib=warm.rss_kib,
        end_kib=end.rss_kib,
        max_kib=max(s.rss_kib for s in after),
        growth_kib=grown,
        growth_pct=100.0 * grown / warm.rss_kib if warm.rss_kib else math.nan,
        slope_kib_per_min=60.0 * slope,
        kib_per_1k_requests=1000.0 * grown / requests if requests > 0 else math.nan,
        requests=requests,
    )
