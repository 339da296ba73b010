"""One measured point: a number of closed-loop users against a running cluster.

warm-up (discarded) -> snapshot -> measurement window -> snapshot -> drain (every request
issued in the window is followed to its end). The point carries the client-side summary,
the server-side counter deltas and how busy both processes were, so a CPU-bound run can be
told from a scheduler effect.
"""

from __future__ import annotations

import asyncio
import math
import os
import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from loadtest.closed_loop import ClosedLoop
from loadtest.probes import Counters, delta, read_counters
from loadtest.process import ClusterProcess
from loadtest.stats import Summary, summarize
from loadtest.workload import Workload

__all__ = ["Point", "Timing", "run_point"]

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True, slots=True)
class Timing:
    warmup_s: float
    measure_s: float
    drain_s: float = 60.0  # a bound; the drain ends when the last request does


@dataclass(frozen=True, slots=True)
class Point:
    mode: str
    users: int
    summary: Summary
    counters: Counters  # server-side deltas over the window
    cluster_cpu: float  # cores used by the cluster process during the window (1.0 = one core)
    client_cpu: float  # cores used by the load generator
    host_cpu: float  # cores busy on the whole machine (NaN where /proc/stat is missing)
    loop_lag: dict[str, float]  # cluster event-loop lag during the window, ms
    wall_s: float  # the whole point, warm-up and drain included

    @property
    def prefix_hit_rate(self) -> float:
        total = self.counters.get("shim_prefix_cache_total_tokens", 0.0)
        return self.counters.get("shim_prefix_cache_hit_tokens", 0.0) / total if total else math.nan

    @property
    def rejections_429(self) -> float:
        """429s answered by prefills (every one is a retry for on-demand forwarding and a
        failed request for the baseline, whose prefills only reject when their queue is full)."""
        return self.counters.get("shim_rejected", 0.0)

    @property
    def retries_per_request(self) -> float:
        """Rejected prefill attempts per request issued in the window (NaN without pdgate's
        metrics, e.g. behind another router)."""
        n = self.summary.requests
        if not n or "attempts_rejected" not in self.counters:
            return math.nan
        return self.counters["attempts_rejected"] / n

    def row(self) -> dict[str, Any]:
        s = self.summary
        return {
            "mode": self.mode,
            "users": self.users,
            "requests": s.requests,
            "success_rate": s.success_rate,
            "goodput_rps": s.goodput_rps,
            "throughput_rps": s.throughput_rps,
            "ttft_p50_s": s.ttft_p50_s,
            "ttft_p99_s": s.ttft_p99_s,
            "e2e_p50_s": s.e2e_p50_s,
            "e2e_p99_s": s.e2e_p99_s,
            "prefix_hit_rate": self.prefix_hit_rate,
            "prefill_429s": self.rejections_429,
            "retries_per_request": self.retries_per_request,
            "gateway_503s": s.status_counts.get(503, 0),
            "cluster_cpu_cores": self.cluster_cpu,
            "client_cpu_cores": self.client_cpu,
            "host_cpu_cores": self.host_cpu,
            "loop_lag_p99_ms": self.loop_lag.get("lag_p99_ms", math.nan),
            **{f"success_{k}": v for k, v in s.success_by_scenario.items()},
        }


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _host_busy_s() -> float:
    """CPU seconds the whole machine spent busy (all processes, all cores), from /proc/stat:
    other jobs on a shared two-core box show up as busy time neither process accounts for."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return math.nan
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / _CLK_TCK


async def run_point(
    cluster: ClusterProcess,
    session: aiohttp.ClientSession,
    workload: Workload,
    users: int,
    timing: Timing,
    *,
    user_offset: int = 0,
    fronts: Sequence[str] | None = None,
) -> Point:
    """`fronts`: base URLs the users send to, when not the cluster's own gateways (another
    router); the gateways' metrics are then left out of the counters."""
    assert cluster.urls is not None
    urls = cluster.urls
    metrics_from = urls.gateways if fronts is None else []
    began = time.monotonic()
    loop = ClosedLoop(
        session,
        [url + "/v1/completions" for url in (urls.gateways if fronts is None else fronts)],
        cluster.spec.model,
        workload,
        users,
        user_offset=user_offset,
        ramp_s=min(0.5, timing.warmup_s / 2),
    )
    loop.start()
    await asyncio.sleep(timing.warmup_s)
    before, child0 = await asyncio.gather(
        read_counters(session, metrics_from, urls.prefills), cluster.stats()
    )
    own0, host0 = _own_cpu_s(), _host_busy_s()
    loop.open_window()
    await asyncio.sleep(timing.measure_s)
    window = loop.close_window()
    after, child1 = await asyncio.gather(
        read_counters(session, metrics_from, urls.prefills), cluster.stats()
    )
    own1, host1 = _own_cpu_s(), _host_busy_s()
    elapsed = child1["wall_s"] - child0["wall_s"]
    cancelled = await loop.stop(timing.drain_s)
    if cancelled:
        raise RuntimeError(f"{cancelled} requests did not end within {timing.drain_s} s")
    return Point(
        mode=cluster.mode.name,
        users=users,
        summary=summarize(loop.results, window),
        counters=delta(before, after),
        cluster_cpu=(child1["cpu_s"] - child0["cpu_s"]) / elapsed,
        client_cpu=(own1 - own0) / elapsed,
        host_cpu=(host1 - host0) / elapsed,
        loop_lag={k: v for k, v in child1.items() if k.startswith("lag_")},
        wall_s=time.monotonic() - began,
    )
