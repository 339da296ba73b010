"""RSS sampling on a real process, and the growth figures the soak reports."""

from __future__ import annotations

import asyncio
import math
import sys

import pytest

from pdgate.loadtest.lib import procfs
from pdgate.loadtest.lib.children import Child
from pdgate.loadtest.lib.rss import RssSample, RssSampler, growth

# Allocates (and touches) 64 MiB when told to, then says so.
_GROWER = (
    "import sys\n"
    "print('ready', flush=True)\n"
    "held = []\n"
    "for line in sys.stdin:\n"
    "    held.append(bytearray(64 << 20))\n"
    "    print('grown', flush=True)\n"
)


async def test_the_sampler_sees_a_real_process_grow() -> None:
    child = Child("grower", [sys.executable, "-c", _GROWER], quits_on_eof=True, replies=True)
    await child.start("^ready")
    try:
        requests = [0]
        sampler = RssSampler(child.pid, 0.05, count=lambda: requests[0])
        sampler.start()
        await asyncio.sleep(0.3)
        before = sampler.take()
        requests[0] = 1000
        assert await child.ask(b"grow") == b"grown\n"
        await asyncio.sleep(0.3)
        after = await sampler.finish()
        assert sampler.samples[-1] == after and sampler.samples[-2].t_s < after.t_s
        # VmRSS agrees with /proc/PID/statm's resident pages, and the 64 MiB show.
        assert after.rss_kib - before.rss_kib >= 60 * 1024
        assert abs(procfs.rss_kib(child.pid) - after.rss_kib) < 4 * 1024
        assert len(sampler.samples) >= 8  # the background task kept sampling
        assert [s.t_s for s in sampler.samples] == sorted(s.t_s for s in sampler.samples)
        g = growth(sampler.samples, warmup_s=0.0)
        assert g.growth_kib >= 60 * 1024 and g.requests == 1000
        assert g.kib_per_1k_requests == pytest.approx(g.growth_kib)
        assert g.slope_kib_per_min > 0
    finally:
        await child.stop()


async def test_a_sampler_of_a_dead_process_raises_at_stop() -> None:
    child = Child("short", [sys.executable, "-c", "print('ready', flush=True)"])
    await child.start("ready")
    pid = child.pid
    await child.wait(10)
    await child.stop()
    sampler = RssSampler(pid, 0.01)
    sampler.start()
    await asyncio.sleep(0.05)
    with pytest.raises(FileNotFoundError, match=str(pid)):
        await sampler.stop()


def _samples(kib: list[int], requests: list[int]) -> list[RssSample]:
    return [RssSample(float(t), k, r) for t, (k, r) in enumerate(zip(kib, requests, strict=True))]


def test_growth_after_warm_up() -> None:
    # Warm-up to t=2 (the first sample at or after it is the baseline), then +60 KiB/s.
    samples = _samples([1000, 5000, 8000, 8060, 8120, 8180], [0, 10, 20, 30, 40, 50])
    g = growth(samples, warmup_s=2.0)
    assert (g.warm_kib, g.end_kib, g.max_kib) == (8000, 8180, 8180)
    assert g.growth_kib == 180 and g.requests == 30
    assert g.growth_pct == pytest.approx(2.25)
    assert g.slope_kib_per_min == pytest.approx(60 * 60)
    assert g.kib_per_1k_requests == pytest.approx(6000)


def test_flat_memory_is_zero_growth_and_no_requests_is_unknown() -> None:
    flat = growth(_samples([500, 800, 800, 800], [0, 5, 5, 5]), warmup_s=1.0)
    assert flat.growth_kib == 0 and flat.slope_kib_per_min == 0
    assert math.isnan(flat.kib_per_1k_requests)  # no request after the warm-up
    with pytest.raises(ValueError, match="warm-up"):
        growth(_samples([1, 2], [0, 0]), warmup_s=5.0)
