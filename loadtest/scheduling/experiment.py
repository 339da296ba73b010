"""The scheduling experiment (P/D-Serve Fig. 14a): success rate and goodput at loads A..4A.

1. **A** is the largest number of closed-loop users at which the *baseline* still meets the
   success target (99%): found by running the baseline at ascending user counts of
   `Plan.calibration_users` until a point misses it, or fixed by `Plan.base_users`.
2. Each series (a mode, in one deployment: clusters.py) then gets its own, fresh cluster of
   the same shape and is driven at ``k x A`` users for every k in `Plan.multiples`, in
   ascending order on that cluster (warm-up, window, drain at each level).
3. With several seeds, step 2 is repeated once per seed (a fresh cluster and other prompts
   each time): one run can be lucky, so the report gives min / median / max over seeds.

With ``parallel`` the series of one seed run at the same time, one cluster each; it trades
some CPU headroom (watch the loop lag and CPU columns) for wall-clock time.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import aiohttp

from pdgate.loadtest.lib.log import Log, to_stderr
from pdgate.loadtest.lib.router import RouterOptions, running_router
from pdgate.loadtest.lib.stats import Spread
from pdgate.loadtest.scheduling.clusters import open_cluster
from pdgate.loadtest.scheduling.modes import MODES, ClusterSpec, Mode, mode_named
from pdgate.loadtest.scheduling.runner import Point, Timing, run_point
from pdgate.loadtest.scheduling.workload import SCENARIOS, Scenario, Workload

__all__ = ["Plan", "Result", "Series", "run_experiment"]


@dataclass(frozen=True, slots=True)
class Series:
    """One line of the results: a mode in one deployment."""

    name: str  # the mode's name, or "mode@deploy" when several deployments are compared
    mode: Mode
    deploy: str


@dataclass(frozen=True, slots=True)
class Plan:
    spec: ClusterSpec = field(default_factory=ClusterSpec)
    scenarios: tuple[Scenario, ...] = SCENARIOS
    seeds: tuple[int, ...] = (0,)  # one run per seed; the first also calibrates A
    modes: tuple[Mode, ...] = MODES
    deploys: tuple[str, ...] = ("inprocess",)  # clusters.DEPLOYS
    multiples: tuple[int, ...] = (1, 2, 3, 4)
    timing: Timing = field(default_factory=lambda: Timing(warmup_s=3.0, measure_s=40.0))
    base_users: int | None = None  # None: calibrate A
    calibration_users: tuple[int, ...] = (4, 6, 8, 10, 12, 14, 16, 20, 24)
    calibration_timing: Timing = field(default_factory=lambda: Timing(warmup_s=3.0, measure_s=30.0))
    success_target: float = 0.99
    parallel: bool = False
    # vllm-router modes: retries on, their back-off short next to the deadlines (1-4 s) and
    # their number enough to cover the longest one, so the router may try until it is over.
    router: RouterOptions = field(
        default_factory=lambda: RouterOptions(retries=20, retry_initial_ms=25, retry_max_ms=500)
    )

    def __post_init__(self) -> None:
        if not self.seeds or not self.modes or not self.deploys or not self.multiples:
            raise ValueError("a plan needs at least one seed, mode, deployment and load")

    @property
    def seed(self) -> int:
        return self.seeds[0]

    def series(self) -> list[Series]:
        """Mode by mode, each mode's deployments next to each other."""
        several = len(self.deploys) > 1
        return [
            Series(f"{m.name}@{d}" if several else m.name, m, d)
            for m in self.modes
            for d in self.deploys
        ]


@dataclass
class Result:
    plan: Plan
    base_users: int
    calibration: list[Point]
    points: dict[str, dict[int, list[Point]]]  # series -> multiple -> one point per seed
    wall_s: float = 0.0

    def spread(self, name: str) -> dict[str, dict[str, Spread]]:
        """``{series: {"1": Spread, ...}}`` of a `Point.row()` column over the seeds."""
        return {
            series: {str(k): Spread.of(float(p.row()[name]) for p in pts)
                     for k, pts in sorted(by_k.items())}
            for series, by_k in self.points.items()
        }  # fmt: skip

    def metric(self, name: str) -> dict[str, dict[str, float]]:
        """``{series: {"1": value, ...}}`` for a `Point.row()` column: the median over seeds
        (the one run's value with one seed)."""
        return {
            series: {k: spread.median for k, spread in by_k.items()}
            for series, by_k in self.spread(name).items()
        }

    def worst(self, name: str) -> dict[str, dict[str, float]]:
        """The largest value over seeds (for figures where one bad run is the finding)."""
        return {
            series: {k: spread.max for k, spread in by_k.items()}
            for series, by_k in self.spread(name).items()
        }


def _describe_point(name: str, point: Point) -> str:
    s = point.summary
    holds = point.holds
    lag = point.loop_lag.get("lag_p99_ms")
    gateways = ""
    if len(s.success_by_gateway) > 1:
        gateways = " per-gateway=" + "/".join(f"{v:.0%}" for v in s.success_by_gateway.values())
    return (
        f"  {name:>12} seed={point.seed} users={point.users:<3} success={s.success_rate:6.1%} "
        f"goodput={s.goodput_rps:5.2f}/s ttft_p50={s.ttft_p50_s:5.3f}s "
        f"hit={point.prefix_hit_rate:5.1%} "
        f"cpu={point.cluster_cpu:4.2f}/{point.host_cpu:4.2f} "
        + ("" if lag is None else f"lag_p99={lag:.0f}ms ")
        + f"hold_max={holds.max_s:.2f}s >5s={holds.over_5s:.0f} stranded={holds.stranded:.0f}"
        f"{gateways} ({point.wall_s:.0f}s)"
    )


async def _drive(
    session: aiohttp.ClientSession,
    series: Series,
    plan: Plan,
    loads: Sequence[int],
    timing: Timing,
    log: Log,
    *,
    seed: int,
    stop_below: float | None = None,
) -> list[Point]:
    """One cluster for `series`, driven at each user count of `loads` in turn."""
    mode = series.mode
    workload = Workload(plan.scenarios, seed=seed)
    points: list[Point] = []
    async with contextlib.AsyncExitStack() as stack:
        cluster = await stack.enter_async_context(open_cluster(plan.spec, mode, series.deploy))
        await cluster.wait_ready(session)
        fronts = None
        if mode.front == "vllm_router":
            _, router = await stack.enter_async_context(
                running_router(
                    session,
                    cluster.urls.prefills,
                    cluster.urls.decodes,
                    replace(plan.router, policy=mode.router_policy),
                )
            )
            fronts = [router]
        for i, users in enumerate(loads):
            # Distinct random streams per level, the same for every mode at that level.
            point = await run_point(
                cluster, session, workload, users, timing, user_offset=i * 100_000,
                fronts=fronts, seed=seed, name=series.name,
            )  # fmt: skip
            points.append(point)
            log(_describe_point(series.name, point))
            if stop_below is not None and point.summary.success_rate < stop_below:
                break
    return points


async def calibrate(
    session: aiohttp.ClientSession, plan: Plan, log: Log
) -> tuple[int, list[Point]]:
    """A: the largest calibration user count at which the baseline meets the target."""
    log(f"calibrating A: baseline at {list(plan.calibration_users)} users")
    points = await _drive(
        session,
        Series("baseline", mode_named("baseline"), plan.deploys[0]),
        plan,
        plan.calibration_users,
        plan.calibration_timing,
        log,
        seed=plan.seed,
        stop_below=plan.success_target,
    )
    passed = [p.users for p in points if p.summary.success_rate >= plan.success_target]
    # Ascending and stopped at the first miss, so the passes are a prefix of the grid.
    if not passed:
        log(f"the baseline missed {plan.success_target:.0%} even at the smallest load")
        return plan.calibration_users[0], points
    return passed[-1], points


async def run_experiment(plan: Plan, log: Log = to_stderr) -> Result:
    began = time.monotonic()
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    series = plan.series()
    points: dict[str, dict[int, list[Point]]] = {
        s.name: {k: [] for k in plan.multiples} for s in series
    }
    async with aiohttp.ClientSession(connector=connector) as session:
        calibration: list[Point] = []
        if plan.base_users is None:
            base, calibration = await calibrate(session, plan, log)
        else:
            base = plan.base_users
        loads = [k * base for k in plan.multiples]
        log(
            f"A = {base} users; loads {loads}; series {[s.name for s in series]}; "
            f"seeds {list(plan.seeds)}"
        )
        for seed in plan.seeds:
            if plan.parallel:
                try:  # one failure cancels the other series (and stops their clusters)
                    async with asyncio.TaskGroup() as group:
                        tasks = [
                            group.create_task(_drive(session, s, plan, loads, plan.timing, log,
                                                     seed=seed))
                            for s in series
                        ]  # fmt: skip
                except BaseExceptionGroup as failed:
                    raise failed.exceptions[0] from None
                per_series = [t.result() for t in tasks]
            else:
                per_series = [
                    await _drive(session, s, plan, loads, plan.timing, log, seed=seed)
                    for s in series
                ]
            for s, pts in zip(series, per_series, strict=True):
                for k, point in zip(plan.multiples, pts, strict=True):
                    points[s.name][k].append(point)
    return Result(plan, base, calibration, points, wall_s=time.monotonic() - began)
