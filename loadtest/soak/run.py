"""The soak: steady streaming load on one gateway, as deployed, with its RSS sampled.

Does the gateway's memory stay flat after warm-up? Everything it keeps per request (the
prefix-affinity index, per-instance state, metrics, queues) must be bounded, so under steady
load its resident memory should stop growing once the process is warm. The cluster is the
scheduling suite's, deployed as separate processes (loadtest/scheduling/clusters.py: one
``pdgate gateway`` and every shim its own process, a private Redis), so the gateway's RSS is
its own and nothing else's. The load is the scheduling workload's closed loop: every prompt
carries a unique tag after its scenario's prefix, so an index keyed by prompt blocks would
grow with every request if it were unbounded.

The gateway's ``VmRSS`` is read every `SoakPlan.sample_s` (loadtest/lib/rss.py), next to the
number of requests issued so far; the verdict compares the first sample after the warm-up
with the last, and fits a line through every sample after the warm-up.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

from pdgate.loadtest.lib.log import Log
from pdgate.loadtest.lib.rss import RssSampler, growth
from pdgate.loadtest.lib.stats import summarize
from pdgate.loadtest.scheduling.closed_loop import ClosedLoop
from pdgate.loadtest.scheduling.clusters import ProcessCluster
from pdgate.loadtest.scheduling.modes import ClusterSpec, Mode
from pdgate.loadtest.scheduling.workload import Workload

__all__ = ["QUICK", "SoakPlan", "run_soak"]

_DRAIN_S = 60.0  # bound on the requests in flight at the end (they end within seconds)


@dataclass(frozen=True, slots=True)
class SoakPlan:
    policy: str = "least_sse"  # GatewaySettings.prefill_policy; every other setting default
    duration_s: float = 180.0  # the whole run, warm-up included
    warmup_s: float = 30.0  # RSS before this is the process getting warm, not growth
    sample_s: float = 5.0
    users: int = 16
    prefills: int = 2
    prefill_capacity: int = 4
    decodes: int = 1
    sim_profile: str = "llama-3.1-8b-h100"
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.warmup_s < self.duration_s:
            raise ValueError("need 0 <= warmup_s < duration_s")
        if self.sample_s <= 0 or self.users < 1:
            raise ValueError("sample_s and users must be positive")

    def spec(self) -> ClusterSpec:
        return ClusterSpec(
            sim_profile=self.sim_profile,
            prefills=self.prefills,
            prefill_capacity=self.prefill_capacity,
            decodes=self.decodes,
            prefix_cache_blocks=None,  # the profile's own: nothing here is about the cache
        )

    def mode(self) -> Mode:
        # The gateway's defaults (dispatch=queue, FIFO) with only the policy chosen.
        return Mode(self.policy, admission="reject", dispatch="queue",
                    prefill_policy=self.policy, queue_order="fifo")  # fmt: skip


QUICK = SoakPlan(duration_s=30.0, warmup_s=10.0, sample_s=1.0, users=8)


async def run_soak(plan: SoakPlan, log: Log) -> dict[str, Any]:
    began = time.monotonic()
    spec = plan.spec()
    connector = aiohttp.TCPConnector(limit=0)
    async with (
        ProcessCluster(spec, plan.mode()) as cluster,
        aiohttp.ClientSession(connector=connector) as session,
    ):
        await cluster.wait_ready(session)
        gateway = cluster.deployed.gateways[0]
        log(f"soak: {plan.policy}, {plan.users} users, {plan.duration_s:g} s, pid {gateway.pid}")
        loop = ClosedLoop(
            session,
            [cluster.urls.gateways[0] + "/v1/completions"],
            spec.model,
            Workload(seed=plan.seed),
            plan.users,
            ramp_s=min(1.0, plan.warmup_s / 2),
        )
        sampler = RssSampler(gateway.pid, plan.sample_s, count=lambda: loop.issued)
        sampler.start()  # t = 0: the idle gateway, before the first request
        loop.start()
        try:
            await _sleep_logging(plan.warmup_s, sampler, log)
            loop.open_window()
            await _sleep_logging(plan.duration_s - plan.warmup_s, sampler, log)
            window = loop.close_window()
            await sampler.finish()  # the end of the run, on the dot (the drain is not the run)
            cluster.deployed.check_alive()
            cancelled = await loop.stop(_DRAIN_S)
        finally:
            await loop.stop(0.0)  # on a failure above: no user may outlive the run
            await sampler.stop()  # raises if a reading failed (the gateway died)
        if cancelled:
            raise RuntimeError(f"{cancelled} requests did not end within {_DRAIN_S:g} s")
    summary = summarize(loop.results, window)
    grown = growth(sampler.samples, plan.warmup_s)
    first = sampler.samples[0]
    return {
        "policy": plan.policy,
        "duration_s": plan.duration_s,
        "warmup_s": plan.warmup_s,
        "users": plan.users,
        "requests": loop.issued,
        "requests_after_warmup": grown.requests,
        "success_rate": summary.success_rate,
        "goodput_rps": summary.goodput_rps,
        "status_counts": {str(k): v for k, v in summary.status_counts.items()},
        "rss_start_kib": first.rss_kib,
        "rss_warm_kib": grown.warm_kib,
        "rss_end_kib": grown.end_kib,
        "rss_max_kib": grown.max_kib,
        "growth_kib": grown.growth_kib,
        "growth_pct": grown.growth_pct,
        "growth_kib_per_min": grown.slope_kib_per_min,
        "growth_kib_per_1k_requests": grown.kib_per_1k_requests,
        "samples": [[round(s.t_s, 3), s.rss_kib, s.requests] for s in sampler.samples],
        "plan": asdict(plan),
        "wall_s": time.monotonic() - began,
    }


async def _sleep_logging(seconds: float, sampler: RssSampler, log: Log) -> None:
    """Sleep, with a progress line about every 30 s (a soak is long and otherwise silent)."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        await asyncio.sleep(min(30.0, left))
        if sampler.samples:
            last = sampler.samples[-1]
            log(f"  t={last.t_s:5.0f}s rss={last.rss_kib / 1024:6.1f} MiB requests={last.requests}")
