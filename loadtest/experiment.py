"""The scheduling experiment (P/D-Serve Fig. 14a): success rate and goodput at loads A..4A.

1. **A** is the largest number of closed-loop users at which the *baseline* still meets the
   success target (99%): found by running the baseline at ascending user counts of
   `Plan.calibration_users` until a point misses it, or fixed by `Plan.base_users`.
2. Each mode then gets its own, fresh cluster of the same shape and is driven at
   ``k x A`` users for every k in `Plan.multiples`, in ascending order on that cluster
   (warm-up, window, drain at each level).

With ``parallel`` the modes run at the same time, one cluster process each; it trades some
CPU headroom (watch the loop lag and CPU columns) for wall-clock time.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import aiohttp

from loadtest.modes import MODES, ClusterSpec, Mode, mode_named
from loadtest.process import ClusterProcess
from loadtest.router import RouterOptions, running_router
from loadtest.runner import Point, Timing, run_point
from loadtest.workload import SCENARIOS, Scenario, Workload

__all__ = ["Plan", "Result", "run_experiment"]

Log = Callable[[str], None]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class Plan:
    spec: ClusterSpec = field(default_factory=ClusterSpec)
    scenarios: tuple[Scenario, ...] = SCENARIOS
    seed: int = 0
    modes: tuple[Mode, ...] = MODES
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


@dataclass
class Result:
    plan: Plan
    base_users: int
    calibration: list[Point]
    points: dict[str, dict[int, Point]]  # mode -> multiple -> point
    wall_s: float = 0.0

    def metric(self, name: str) -> dict[str, dict[str, float]]:
        """``{mode: {"1": value, ...}}`` for a `Point.row()` column."""
        return {
            mode: {str(k): float(p.row()[name]) for k, p in sorted(by_k.items())}
            for mode, by_k in self.points.items()
        }


async def _drive(
    session: aiohttp.ClientSession,
    mode: Mode,
    plan: Plan,
    loads: Sequence[int],
    timing: Timing,
    log: Log,
    *,
    stop_below: float | None = None,
) -> list[Point]:
    """One cluster for `mode`, driven at each user count of `loads` in turn."""
    workload = Workload(plan.scenarios, seed=plan.seed)
    points: list[Point] = []
    async with contextlib.AsyncExitStack() as stack:
        cluster = await stack.enter_async_context(ClusterProcess(plan.spec, mode))
        await cluster.wait_ready(session)
        fronts = None
        if mode.front == "vllm_router":
            assert cluster.urls is not None
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
                cluster, session, workload, users, timing, user_offset=i * 100_000, fronts=fronts
            )
            points.append(point)
            s = point.summary
            log(
                f"  {mode.name:>12} users={users:<3} success={s.success_rate:6.1%} "
                f"goodput={s.goodput_rps:5.2f}/s ttft_p50={s.ttft_p50_s:5.3f}s "
                f"hit={point.prefix_hit_rate:5.1%} "
                f"cpu={point.cluster_cpu:4.2f}/{point.host_cpu:4.2f} "
                f"lag_p99={point.loop_lag.get('lag_p99_ms', 0):.0f}ms ({point.wall_s:.0f}s)"
            )
            if stop_below is not None and s.success_rate < stop_below:
                break
    return points


async def calibrate(
    session: aiohttp.ClientSession, plan: Plan, log: Log
) -> tuple[int, list[Point]]:
    """A: the largest calibration user count at which the baseline meets the target."""
    log(f"calibrating A: baseline at {list(plan.calibration_users)} users")
    points = await _drive(
        session,
        mode_named("baseline"),
        plan,
        plan.calibration_users,
        plan.calibration_timing,
        log,
        stop_below=plan.success_target,
    )
    passed = [p.users for p in points if p.summary.success_rate >= plan.success_target]
    # Ascending and stopped at the first miss, so the passes are a prefix of the grid.
    if not passed:
        log(f"the baseline missed {plan.success_target:.0%} even at the smallest load")
        return plan.calibration_users[0], points
    return passed[-1], points


async def run_experiment(plan: Plan, log: Log = _stderr) -> Result:
    began = time.monotonic()
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        calibration: list[Point] = []
        if plan.base_users is None:
            base, calibration = await calibrate(session, plan, log)
        else:
            base = plan.base_users
        loads = [k * base for k in plan.multiples]
        log(f"A = {base} users; loads {loads}; modes {[m.name for m in plan.modes]}")
        runs = [_drive(session, mode, plan, loads, plan.timing, log) for mode in plan.modes]
        if plan.parallel:
            per_mode = await asyncio.gather(*runs)
        else:
            per_mode = [await run for run in runs]
    points = {
        mode.name: dict(zip(plan.multiples, pts, strict=True))
        for mode, pts in zip(plan.modes, per_mode, strict=True)
    }
    return Result(plan, base, calibration, points, wall_s=time.monotonic() - began)
