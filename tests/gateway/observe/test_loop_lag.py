"""The gateway times its own event loop: a stalled loop shows in /metrics."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import pytest

from pdgate.gateway.observe.loop_lag import LoopLagMonitor
from pdgate.gateway.observe.metrics import LoopHistogram
from tests._cluster import Processes


def _lag_buckets(text: str) -> dict[str, float]:
    return {
        le: float(v)
        for le, v in re.findall(r'pdgate_event_loop_lag_seconds_bucket\{le="([^"]+)"\} (\S+)', text)
    }


async def test_a_blocked_loop_is_observed_as_late_as_it_was_blocked() -> None:
    histogram = LoopHistogram("lag_seconds", "Lag", (0.01, 0.1, 1))
    monitor = LoopLagMonitor(histogram.observe, 0.02)
    monitor.start()
    await asyncio.sleep(0.1)  # a few timely wake-ups
    time.sleep(0.3)  # noqa: ASYNC251 (one callback holding the loop is the point)
    await asyncio.sleep(0.1)
    await monitor.stop()
    family = next(histogram.collect())
    buckets = {s.labels["le"]: s.value for s in family.samples if s.name.endswith("_bucket")}
    assert buckets["0.01"] >= 3  # the timely ones
    assert buckets["+Inf"] - buckets["0.1"] == 1  # the one blocked, 0.3 s late
    assert buckets["1.0"] == buckets["+Inf"]


async def test_stopping_twice_and_a_zero_interval() -> None:
    monitor = LoopLagMonitor(LoopHistogram("lag_seconds", "Lag", (0.1,)).observe, 0.01)
    monitor.start()
    await monitor.stop()
    await monitor.stop()
    with pytest.raises(ValueError, match="interval_s"):
        LoopLagMonitor(LoopHistogram("lag_seconds", "Lag", (0.1,)).observe, 0)


def test_a_gateway_process_stopped_for_a_while_reports_it(processes: Processes) -> None:
    """SIGSTOP the gateway for 0.6 s: once it runs again, its loop-lag histogram holds a wake-up
    at least 0.5 s late, which no other observation of a healthy idle gateway comes near."""
    url = processes.gateway(env={"PDGATE_GATEWAY_LOOP_LAG_INTERVAL_S": "0.05"})
    pid = processes.procs[-1].proc.pid
    time.sleep(0.3)
    before = _lag_buckets(httpx.get(url + "/metrics").text)
    assert before["+Inf"] >= 2 and before["+Inf"] == before["0.5"]
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(0.6)
    finally:
        os.kill(pid, signal.SIGCONT)
    time.sleep(0.2)
    after = _lag_buckets(httpx.get(url + "/metrics").text)
    assert after["+Inf"] - after["0.25"] >= 1
