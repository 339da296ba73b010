"""Running a plan in the simulator, as deployed: its prefills and decodes as separate shim
processes with the roofline's timing of their GPU type and parallelism, a gateway, a private
Redis, and Poisson arrivals at the plan's rate of prompts of the planned lengths."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import aiohttp

from pdgate.loadtest.lib.children import run_main
from pdgate.loadtest.lib.log import to_stderr
from pdgate.loadtest.plan.planner import Plan
from pdgate.loadtest.scheduling.clusters import ProcessCluster
from pdgate.loadtest.scheduling.modes import ClusterSpec, Mode, mode_named
from pdgate.loadtest.scheduling.open_loop import Arrivals
from pdgate.loadtest.scheduling.runner import Timing, run_point
from pdgate.loadtest.scheduling.workload import Scenario, Workload

__all__ = ["verify"]

_WARMUP_S = 5.0


def cluster_of(plan: Plan) -> tuple[ClusterSpec, Mode]:
    """The sim cluster and on-demand-forwarding mode that stand for `plan`."""
    model = plan.spec.model
    spec = ClusterSpec(
        model=f"sim-{model}",
        prefills=plan.prefill.instances,
        decodes=plan.decode.instances,
        prefill_capacity=1,
        decode_capacity=plan.decode.batch,
        prefix_cache_blocks=None,
        gateway_ttft_timeout_s=plan.spec.ttft_slo_s,
    )
    base = mode_named("least_sse")
    mode = replace(
        base,
        name="plan",
        prefill={**base.prefill, "sim_profile": plan.prefill.sim_profile(model)},
        decode={**base.decode, "sim_profile": plan.decode.sim_profile(model)},
    )
    return spec, mode


def workload_of(plan: Plan, seed: int) -> Workload:
    s = plan.spec
    spread = round(s.prompt_tokens * s.prompt_spread)
    scenario = Scenario(
        "plan",
        prefix_tokens=0,
        body_min=max(1, s.prompt_tokens - spread),
        body_max=s.prompt_tokens + spread,
        max_tokens=s.output_tokens,
        ttft_deadline_s=s.ttft_slo_s,
        tpot_slo_s=s.tpot_slo_s,
    )
    return Workload([scenario], seed=seed)


async def _run(plan: Plan, window_s: float, seed: int) -> dict[str, Any]:
    spec, mode = cluster_of(plan)
    rate = plan.spec.rate_rps
    to_stderr(
        f"verifying: {spec.prefills} x {plan.prefill.sim_profile(plan.spec.model)} prefills, "
        f"{spec.decodes} x {plan.decode.sim_profile(plan.spec.model)} decodes, "
        f"{rate:g} req/s for {window_s:g} s"
    )
    connector = aiohttp.TCPConnector(limit=0)
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        ProcessCluster(spec, mode) as cluster,
    ):
        await cluster.wait_ready(session)
        # In-flight bound: ten times the requests Little's law expects at once.
        expected = rate * (plan.spec.ttft_slo_s + plan.spec.output_tokens * plan.spec.tpot_slo_s)
        point = await run_point(
            cluster, session, workload_of(plan, seed), 0,
            Timing(warmup_s=_WARMUP_S, measure_s=window_s), seed=seed, name="plan",
            arrivals=Arrivals(kind="poisson", max_in_flight=max(64, math.ceil(10 * expected))),
            rate_rps=rate,
        )  # fmt: skip
    s = point.summary
    return {
        "slo_attainment": s.success_rate,
        "ttft_attainment": s.ttft_attainment,
        "tpot_attainment": s.tpot_attainment,
        "requests": s.requests,
        "ttft_p99_s": s.ttft_p99_s,
        "tpot_p99_s": s.tpot_p99_s,
        "window_s": window_s,
        "host_cpu_cores": point.host_cpu,
    }


def verify(plan: Plan, *, window_s: float, seed: int) -> dict[str, Any]:
    return run_main(_run(plan, window_s, seed))
