"""The scheduling experiment (P/D-Serve Fig. 14a): success rate and goodput at loads A..4A.

1. **A** is the largest number of closed-loop users at which the *baseline* still meets the
   success target (99%): found by running the baseline at ascending user counts of
   `Plan.calibration_users` until a point misses it, or fixed by `Plan.base_users`.
2. **Capacity** (capacity.py): the reference mode's maximum goodput, from a sweep of
   closed-loop user counts until goodput stops rising; or given, or not measured. Every
   level's load is then also a fraction of it, and an open loop's rates come from it.
3. Each series (a mode, with batch forwarding on or off, in one deployment with N gateways:
   `Plan.series`) then gets its own, fresh cluster of the same shape and is driven at each
   level in ascending order on that cluster (warm-up, window, drain per level). A level is
   ``k x A`` users for every k in `Plan.multiples`, or, with `Plan.load_fractions`, the users
   whose demand is that fraction of the capacity; an open loop sends at the rate the
   level's users would offer (a fraction f of capacity: exactly f x capacity).
4. With several seeds, step 3 is repeated once per seed (a fresh cluster and other prompts
   each time): one run can be lucky, so the report gives min / median / max over seeds.
   Steps 1 and 2 run once, on the first seed.

With ``parallel`` the series of one seed run at the same time, one cluster each; it trades
some CPU headroom (watch the loop lag and CPU columns) for wall-clock time.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import aiohttp

from pdgate.loadtest.lib.log import Log, to_stderr
from pdgate.loadtest.lib.router import SMG, RouterOptions, running_router
from pdgate.loadtest.lib.stats import Spread
from pdgate.loadtest.scheduling.capacity import (
    Capacity,
    CapacityPlan,
    from_sweep,
    plateaued,
    sweep_users,
)
from pdgate.loadtest.scheduling.clusters import INPROCESS_FLEET, open_cluster
from pdgate.loadtest.scheduling.modes import MODES, ClusterSpec, Mode, check_settings, mode_named
from pdgate.loadtest.scheduling.open_loop import Arrivals
from pdgate.loadtest.scheduling.runner import Point, Timing, run_point
from pdgate.loadtest.scheduling.workload import Workload, WorkloadSpec, workload_named

__all__ = ["Level", "Plan", "Result", "Series", "levels_of", "run_experiment"]


@dataclass(frozen=True, slots=True)
class Level:
    """One load level of the main run."""

    key: str  # in the JSON and CSV: "2" (2A), or "2c" (twice the capacity)
    label: str  # in tables and plots: "2A", or "2x cap"
    users: int  # closed-loop users (open loop: the users whose demand it stands for)
    fraction: float | None = None  # the share of capacity it was asked as, if it was

    def rate(self, capacity: Capacity) -> float:
        """The open loop's mean arrival rate at this level, requests/s."""
        if self.fraction is not None:
            return capacity.rps * self.fraction
        return capacity.rate(self.users)

    def load_fraction(self, capacity: Capacity | None, open_loop: bool) -> float:
        if capacity is None:
            return math.nan
        offered = self.rate(capacity) if open_loop else capacity.rate(self.users)
        return offered / capacity.rps


@dataclass(frozen=True, slots=True)
class Series:
    """One line of the results: a mode (batch forwarding set or not) in one deployment with
    a number of gateways."""

    # The mode's name, then, where the plan compares several: "+bf" / "-bf" (batch
    # forwarding on / off), "@deploy", "/sK" (K slots a prefill), "/gN" (N gateways).
    name: str
    mode: Mode
    deploy: str
    gateways: int = 1
    prefill_slots: int | None = None  # None: the cluster spec's


@dataclass(frozen=True, slots=True)
class Plan:
    spec: ClusterSpec = field(default_factory=ClusterSpec)
    workload: str = "mix"  # workload.WORKLOADS
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
    gateways: tuple[int, ...] = (1,)  # gateways per cluster: one set of series per count
    # Batch slots per prefill: one set of series per count (empty: the spec's only).
    prefill_slots: tuple[int, ...] = ()
    # GatewaySettings.batch_forwarding of the queued modes: () leaves the gateway's default;
    # (True, False) runs each such mode twice (the ablation).
    batch_forwarding: tuple[bool, ...] = ()
    arrivals: Arrivals = field(default_factory=Arrivals)
    capacity: CapacityPlan = field(default_factory=CapacityPlan)
    # Levels as shares of the capacity instead of `multiples` of A (e.g. (0.5, 1, 2)).
    load_fractions: tuple[float, ...] = ()
    trace: bool = False  # also write each request's outcome (report.write_trace)

    def __post_init__(self) -> None:
        if not self.seeds or not self.modes or not self.deploys or not self.multiples:
            raise ValueError("a plan needs at least one seed, mode, deployment and load")
        if not self.gateways or min(self.gateways) < 1:
            raise ValueError("gateway counts must be at least 1")
        if self.prefill_slots and min(self.prefill_slots) < 1:
            raise ValueError("prefill slot counts must be at least 1")
        if "inprocess" in self.deploys and max(self.gateways) > 1:
            raise ValueError(f"--gateways above 1 needs --deploy processes: {INPROCESS_FLEET}")
        if self.arrivals.open and self.capacity.how == "off":
            raise ValueError(
                f"{self.arrivals.kind} arrivals take their rates from the capacity: measure it "
                "(--capacity measure) or give it (--capacity RPS --user-rps R)"
            )
        if self.load_fractions and self.capacity.how == "off":
            raise ValueError("load fractions are shares of the capacity: do not turn it off")
        if any(not f > 0 for f in self.load_fractions):
            raise ValueError("load fractions must be positive")
        workload_named(self.workload)

    @property
    def seed(self) -> int:
        return self.seeds[0]

    @property
    def workload_spec(self) -> WorkloadSpec:
        return workload_named(self.workload)

    def workload_for(self, seed: int) -> Workload:
        w = self.workload_spec
        return Workload(w.scenarios, seed=seed, tenants=w.tenants, apis=w.apis)

    def series(self) -> list[Series]:
        """Mode by mode; within a mode, batch forwarding on then off, deployments, then
        gateway counts. Batch forwarding is only varied where the gateway queues (not for
        the baseline's direct dispatch nor behind another router): those run once."""
        deploys, gateways = len(self.deploys) > 1, len(self.gateways) > 1
        slots: tuple[int | None, ...] = self.prefill_slots or (None,)
        ablation = len(self.batch_forwarding) > 1
        out: list[Series] = []
        for m in self.modes:
            variants = [(m, "")]
            if self.batch_forwarding and m.queued:
                variants = [
                    (
                        replace(m, gateway={**m.gateway, "batch_forwarding": bf}),
                        ("+bf" if bf else "-bf") if ablation else "",
                    )
                    for bf in self.batch_forwarding
                ]
            for mode, suffix in variants:
                for d in self.deploys:
                    for k in slots:
                        for n in self.gateways:
                            name = m.name + suffix + (f"@{d}" if deploys else "")
                            name += f"/s{k}" if len(slots) > 1 else ""
                            name += f"/g{n}" if gateways else ""
                            out.append(Series(name, mode, d, n, k))
        return out

    def check(self) -> None:
        """Every series' (and the calibrations') settings build: ValueError before anything
        starts otherwise."""
        modes = [s.mode for s in self.series()]
        if self.base_users is None:
            modes.append(mode_named("baseline"))
        if self.capacity.how == "measure":
            modes.append(mode_named(self.capacity.mode))
        for mode in modes:
            check_settings(self.spec, mode)


@dataclass
class Result:
    plan: Plan
    base_users: int
    calibration: list[Point]
    points: dict[str, dict[str, list[Point]]]  # series -> level key -> one point per seed
    wall_s: float = 0.0
    capacity: Capacity | None = None
    capacity_sweep: list[Point] = field(default_factory=list)
    levels: list[Level] = field(default_factory=list)  # default: levels_of the plan

    def __post_init__(self) -> None:
        if not self.levels:
            self.levels = levels_of(self.plan, self.base_users, self.capacity)

    def label(self, key: str) -> str:
        return next((lv.label for lv in self.levels if lv.key == key), key)

    def load_fraction(self) -> dict[str, float]:
        """``{"1": fraction of capacity, ...}``, the same for every series (NaN: unknown)."""
        return {lv.key: lv.load_fraction(self.capacity, self.plan.arrivals.open)
                for lv in self.levels}  # fmt: skip

    def spread(self, name: str) -> dict[str, dict[str, Spread]]:
        """``{series: {"1": Spread, ...}}`` of a `Point.row()` column over the seeds, levels
        in ascending order."""
        return {
            series: {k: Spread.of(float(p.row()[name]) for p in pts) for k, pts in by_k.items()}
            for series, by_k in self.points.items()
        }

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


def levels_of(plan: Plan, base_users: int, capacity: Capacity | None) -> list[Level]:
    """The main run's levels: `Plan.multiples` of A, or `Plan.load_fractions` of capacity."""
    if not plan.load_fractions:
        return [Level(str(k), f"{k}A", k * base_users) for k in plan.multiples]
    if capacity is None:
        raise ValueError("levels as fractions of capacity need a capacity")
    return [
        Level(f"{f:g}c", f"{f:g}x cap", max(1, round(f * capacity.rps / capacity.user_rps)), f)
        for f in sorted(plan.load_fractions)
    ]


def _describe_point(name: str, point: Point) -> str:
    s = point.summary
    holds = point.holds
    lag = point.loop_lag.get("lag_p99_ms")
    extra = ""
    if len(s.success_by_gateway) > 1:
        extra += " per-gateway=" + "/".join(f"{v:.0%}" for v in s.success_by_gateway.values())
        own = point.per_gateway()
        for counter, label in (("early_drops", "drops"), ("fleet_yields", "yields")):
            values = [v for k, v in own.items() if k.startswith(counter + "_gateway")]
            if values:
                extra += f" {label}=" + "/".join(f"{v:.0f}" for v in values)
    if not math.isnan(point.fleet_calls_per_request):
        extra += (
            f" redis={point.fleet_calls_per_request:.2f}/req"
            f" acquire={point.fleet_ms('acquire'):.2f}ms"
        )
    if s.success_by_tenant:
        extra += " tenants=" + "/".join(f"{k}:{v:.0%}" for k, v in s.success_by_tenant.items())
    if point.arrivals != "closed":
        extra += f" rate={point.rate_rps:.2f}/s dropped={s.dropped}"
    if s.retried:
        extra += f" retried={s.retried} ok_on_1st_retry={s.first_retry_success:.0%}"
    load = "" if math.isnan(point.load_fraction) else f"({point.load_fraction:.0%} cap) "
    return (
        f"  {name:>12} seed={point.seed} users={point.users:<3} {load}"
        f"success={s.success_rate:6.1%} "
        f"goodput={s.goodput_rps:5.2f}/s ttft_p50={s.ttft_p50_s:5.3f}s "
        f"hit={point.prefix_hit_rate:5.1%} "
        f"cpu={point.cluster_cpu:4.2f}/{point.host_cpu:4.2f} "
        + ("" if lag is None else f"lag_p99={lag:.0f}ms ")
        + f"hold_max={holds.max_s:.2f}s >5s={holds.over_5s:.0f} stranded={holds.stranded:.0f}"
        f"{extra} ({point.wall_s:.0f}s)"
    )


def _router_options(base: RouterOptions, mode: Mode, spec: ClusterSpec) -> RouterOptions:
    """The router in front of `spec` for `mode`: vllm-router with the mode's policy, or SMG
    with its prefill admission queue (the prefills' slots in flight on each, a request
    waiting at most the gateway's TTFT timeout) and the mode's policy for the prefills."""
    if mode.front != "smg":
        return replace(base, policy=mode.router_policy)
    return replace(
        base,
        binary=SMG,
        policy="cache_aware",
        prefill_policy=mode.router_policy,
        prefill_inflight=spec.prefill_capacity,
        prefill_queue_timeout_s=math.ceil(spec.gateway_ttft_timeout_s),
    )


async def _drive(
    session: aiohttp.ClientSession,
    series: Series,
    plan: Plan,
    loads: Sequence[Level | int],
    timing: Timing,
    log: Log,
    *,
    seed: int,
    stop: Callable[[list[Point]], bool] | None = None,
    arrivals: Arrivals | None = None,
    capacity: Capacity | None = None,
) -> list[Point]:
    """One cluster for `series`, driven at each level of `loads` (or user count) in turn
    (with an open-loop `arrivals`, at the level's rate of `capacity`), until `stop` says so."""
    mode = series.mode
    workload = plan.workload_for(seed)
    spec = replace(plan.spec, gateways=series.gateways)
    if series.prefill_slots is not None:
        spec = replace(spec, prefill_capacity=series.prefill_slots)
    points: list[Point] = []
    async with contextlib.AsyncExitStack() as stack:
        cluster = await stack.enter_async_context(open_cluster(spec, mode, series.deploy))
        await cluster.wait_ready(session)
        fronts = None
        if mode.front != "pdgate":
            _, router = await stack.enter_async_context(
                running_router(
                    session,
                    cluster.urls.prefills,
                    cluster.urls.decodes,
                    _router_options(plan.router, mode, spec),
                )
            )
            fronts = [router]
        for i, load in enumerate(loads):
            level = load if isinstance(load, Level) else Level(str(load), str(load), load)
            open_loop = arrivals is not None and arrivals.open
            # Distinct random streams per level, the same for every mode at that level.
            point = await run_point(
                cluster, session, workload, level.users, timing, user_offset=i * 100_000,
                fronts=fronts, seed=seed, name=series.name, arrivals=arrivals,
                rate_rps=None if capacity is None else level.rate(capacity),
                load_fraction=level.load_fraction(capacity, open_loop),
            )  # fmt: skip
            points.append(point)
            log(_describe_point(series.name, point))
            if stop is not None and stop(points):
                break
    return points


def _reference(plan: Plan, name: str) -> Series:
    """A calibration's series: `name`'s mode in the first deployment, fewest gateways."""
    return Series(name, mode_named(name), plan.deploys[0], min(plan.gateways))


async def calibrate(
    session: aiohttp.ClientSession, plan: Plan, log: Log
) -> tuple[int, list[Point]]:
    """A: the largest calibration user count at which the baseline meets the target."""
    log(f"calibrating A: baseline at {list(plan.calibration_users)} users")
    target = plan.success_target
    points = await _drive(
        session,
        _reference(plan, "baseline"),
        plan,
        plan.calibration_users,
        plan.calibration_timing,
        log,
        seed=plan.seed,
        stop=lambda pts: pts[-1].summary.success_rate < target,
    )
    passed = [p.users for p in points if p.summary.success_rate >= plan.success_target]
    # Ascending and stopped at the first miss, so the passes are a prefix of the grid.
    if not passed:
        log(f"the baseline missed {plan.success_target:.0%} even at the smallest load")
        return plan.calibration_users[0], points
    return passed[-1], points


async def measure_capacity(
    session: aiohttp.ClientSession, plan: Plan, base: int, log: Log
) -> tuple[Capacity, list[Point]]:
    """The reference mode's maximum goodput, from a closed-loop sweep (capacity.py)."""
    cp = plan.capacity
    users = sweep_users(cp, base)
    log(f"measuring capacity: {cp.mode} at {users} users, until goodput stops rising")
    points = await _drive(
        session,
        _reference(plan, cp.mode),
        plan,
        users,
        plan.calibration_timing,
        log,
        seed=plan.seed,
        stop=lambda pts: plateaued([p.summary.goodput_rps for p in pts], cp.gain, cp.patience),
    )
    capacity = from_sweep(
        [p.users for p in points],
        [p.summary.goodput_rps for p in points],
        mode=cp.mode,
        gain=cp.gain,
        patience=cp.patience,
    )
    log(
        f"capacity = {capacity.rps:.2f} successful req/s (at {capacity.users} users); "
        f"one unimpeded user offers {capacity.user_rps:.3f} req/s"
        + ("" if capacity.plateau else "; goodput still rose at the sweep's end: may be higher")
    )
    return capacity, points


async def run_experiment(plan: Plan, log: Log = to_stderr) -> Result:
    plan.check()
    began = time.monotonic()
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    series = plan.series()
    async with aiohttp.ClientSession(connector=connector) as session:
        calibration: list[Point] = []
        if plan.base_users is None:
            base, calibration = await calibrate(session, plan, log)
        else:
            base = plan.base_users
        capacity, sweep = plan.capacity.fixed, list[Point]()
        if plan.capacity.how == "measure":
            capacity, sweep = await measure_capacity(session, plan, base, log)
        levels = levels_of(plan, base, capacity)
        points: dict[str, dict[str, list[Point]]] = {
            s.name: {lv.key: [] for lv in levels} for s in series
        }
        rates = (
            f" ({plan.arrivals.kind}: {[round(lv.rate(capacity), 2) for lv in levels]} req/s)"
            if plan.arrivals.open and capacity is not None
            else ""
        )
        log(
            f"A = {base} users; levels {[lv.label for lv in levels]} = "
            f"{[lv.users for lv in levels]} users{rates}; series {[s.name for s in series]}; "
            f"seeds {list(plan.seeds)}"
        )
        # A closed loop's too: its users' client (what a refused one does) is in it.
        arrivals = plan.arrivals
        for seed in plan.seeds:
            if plan.parallel:
                try:  # one failure cancels the other series (and stops their clusters)
                    async with asyncio.TaskGroup() as group:
                        tasks = [
                            group.create_task(_drive(session, s, plan, levels, plan.timing, log,
                                                     seed=seed, arrivals=arrivals,
                                                     capacity=capacity))
                            for s in series
                        ]  # fmt: skip
                except BaseExceptionGroup as failed:
                    raise failed.exceptions[0] from None
                per_series = [t.result() for t in tasks]
            else:
                per_series = [
                    await _drive(session, s, plan, levels, plan.timing, log, seed=seed,
                                 arrivals=arrivals, capacity=capacity)
                    for s in series
                ]  # fmt: skip
            for s, pts in zip(series, per_series, strict=True):
                for lv, point in zip(levels, pts, strict=True):
                    points[s.name][lv.key].append(point)
    return Result(plan, base, calibration, points, wall_s=time.monotonic() - began,
                  capacity=capacity, capacity_sweep=sweep, levels=levels)  # fmt: skip
