"""The strategies experiment: for each workload and each strategy's cluster (`Shape`),

1. **capacity**, EcoServe's goodput: the highest Poisson arrival rate at which
   `StrategiesPlan.attainment_target` (90%) of the requests meet both their TTFT and their
   TPOT SLO, searched on one fresh cluster (the rate doubled until it misses, then the
   interval bisected);
2. **loads**: for every seed, a fresh cluster driven by Poisson arrivals at each share of
   *that strategy's* capacity in `StrategiesPlan.loads`, in ascending order.

Every shim and the gateway are their own processes, with a private Redis, as deployed.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp

from pdgate.loadtest.lib.log import Log, to_stderr
from pdgate.loadtest.scheduling.clusters import open_cluster
from pdgate.loadtest.scheduling.open_loop import Arrivals
from pdgate.loadtest.scheduling.runner import Point, Timing, run_point
from pdgate.loadtest.strategies.plan import Shape, StrategiesPlan

__all__ = ["Capacity", "Outcome", "Result", "load_key", "run_experiment"]


def load_key(fraction: float) -> str:
    """A load's key in the JSON and the tables: "0.5", "1", "2"."""
    return f"{fraction:g}"


@dataclass(frozen=True, slots=True)
class Capacity:
    """The highest rate found to meet the attainment target, and every rate tried."""

    rps: float
    found: bool  # False: even the lowest rate tried missed the target (rps is that rate)
    probes: tuple[tuple[float, float], ...]  # (rate, SLO attainment), in the order tried


@dataclass
class Outcome:
    """One strategy's cluster on one workload (and interconnect): its capacity and its
    points per load, one per seed."""

    shape: Shape
    capacity: Capacity
    search: list[Point]  # the capacity search's points
    points: dict[str, list[Point]] = field(default_factory=dict)  # load key -> per seed


@dataclass
class Result:
    plan: StrategiesPlan
    outcomes: list[Outcome]
    wall_s: float = 0.0


Measure = Callable[[float, Timing], Awaitable[Point]]


@contextlib.asynccontextmanager
async def _cluster(
    session: aiohttp.ClientSession, shape: Shape, plan: StrategiesPlan, log: Log, *, seed: int
) -> AsyncIterator[Measure]:
    """A fresh cluster of `shape`; what it yields measures one point at a Poisson rate."""
    workload = plan.workload_for(shape.workload, seed)
    arrivals = Arrivals(kind="poisson", max_in_flight=plan.max_in_flight)
    async with open_cluster(shape.spec, shape.mode, "processes") as cluster:
        await cluster.wait_ready(session)
        streams = itertools.count()

        async def measure(rate: float, timing: Timing) -> Point:
            # Each point its own random stream, the same for every strategy at that place.
            point = await run_point(
                cluster, session, workload, 0, timing, user_offset=next(streams) * 100_000,
                seed=seed, name=shape.strategy, arrivals=arrivals, rate_rps=rate,
            )  # fmt: skip
            s = point.summary
            log(
                f"  {shape.strategy:>13} {shape.instances:>13} "
                + ("" if shape.kv_gbps is None else f"{shape.kv_gbps:g}Gb/s ")
                + f"seed={seed} rate={rate:.2f}/s slo={s.success_rate:6.1%} (ttft "
                f"{s.ttft_attainment:.0%}, tpot {s.tpot_attainment:.0%}) "
                f"goodput={s.goodput_rps:5.2f}/s ttft_p99={s.ttft_p99_s:.2f}s "
                f"tpot_p99={1000 * s.tpot_p99_s:.0f}ms "
                f"switch={1000 * point.phase_switch_wait_s:.0f}ms "
                f"cpu={point.host_cpu:.2f} ({point.wall_s:.0f}s)"
            )
            return point

        yield measure


async def _capacity(
    session: aiohttp.ClientSession, shape: Shape, plan: StrategiesPlan, log: Log
) -> tuple[Capacity, list[Point]]:
    """Double the rate until it misses the target, then bisect (on one cluster)."""
    target = plan.attainment_target
    log(f"{shape.workload}: {shape.strategy} ({shape.instances}): capacity search")
    points: list[Point] = []
    probes: list[tuple[float, float]] = []

    async def meets(rate: float) -> bool:
        point = await measure(rate, plan.sweep_timing)
        points.append(point)
        probes.append((rate, point.summary.success_rate))
        return point.summary.success_rate >= target

    async with _cluster(session, shape, plan, log, seed=plan.seeds[0]) as measure:
        rate = plan.start_rps * plan.gpus
        passed: float | None = None
        failed: float | None = None
        for _ in range(8):  # 2^8 x the start: far past anything a sim GPU serves
            if await meets(rate):
                passed = rate
                if failed is not None:
                    break
                rate *= 2
            else:
                failed = rate
                if passed is not None:
                    break
                rate /= 2
        if passed is not None and failed is not None:
            lo, hi = passed, failed
            for _ in range(plan.bisections):
                mid = (lo + hi) / 2
                if await meets(mid):
                    lo = mid
                else:
                    hi = mid
            passed = lo
    found = passed is not None
    capacity = Capacity(passed if passed is not None else min(r for r, _ in probes), found,
                        tuple(probes))  # fmt: skip
    log(
        f"{shape.workload}: {shape.strategy}: capacity {capacity.rps:.2f} req/s at "
        f">= {target:.0%} SLO attainment ({capacity.rps / plan.gpus:.2f} per GPU)"
        + ("" if found else ": not found, the lowest rate tried missed it")
    )
    return capacity, points


async def run_experiment(plan: StrategiesPlan, log: Log = to_stderr) -> Result:
    plan.check()
    began = time.monotonic()
    outcomes: list[Outcome] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for workload in plan.workloads:
            for shape in plan.shapes(workload):
                capacity, search = await _capacity(session, shape, plan, log)
                outcome = Outcome(shape, capacity, search)
                for seed in plan.seeds:
                    async with _cluster(session, shape, plan, log, seed=seed) as measure:
                        for f in sorted(plan.loads):
                            point = await measure(f * capacity.rps, plan.timing)
                            outcome.points.setdefault(load_key(f), []).append(point)
                outcomes.append(outcome)
    return Result(plan, outcomes, wall_s=time.monotonic() - began)
