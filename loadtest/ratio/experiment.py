"""The ratio experiment: unbalanced splits, the gateway's advice, the advised split.

For each workload (workload.py) and seed:

1. each **start** split (default 6P:2D and 2P:6D of 8 instances) runs on a fresh cluster
   deployed as separate processes (loadtest/lib/deployed.py): closed-loop users, a warm-up,
   a measurement window; at the window's end the gateway's ``GET /admin/ratio`` is read
   (its window is set to warm-up + window: everything after priming);
2. the advised ratio n_p / n_d is rounded to whole instances summing to the same count
   (`split_of`), and each distinct advised split runs the same way, on a fresh cluster
   (its own advice is read too: followed advice should advise itself);
3. ``--splits`` adds more splits to run (a sweep, to see where the best split really is).

Before each run, every gateway is **primed** with `PRIME_REQUESTS` one-token requests of the
workload, never more at once than the prefills have slots: the gateway's early drop (a
queued request that could not finish even an optimistic prefill before its deadline is
answered 503 instead of sent) needs 16 accepted prefills to estimate from, and a cluster
overloaded from its first second never gets them (docs/results/ratio/README.md, "Cold
start"). Priming stands for the traffic a serving gateway has seen before; the advice's
window starts after.

Every run of a seed sends the same request sequence (same prompts per user), so splits are
compared on equal terms. Goodput = requests per second of the window that completed and
got their first token within the workload's deadline (loadtest/lib/stats.py).
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from pdgate.loadtest.lib.log import Log, to_stderr
from pdgate.loadtest.ratio.workload import WORKLOADS, Shape, Workload, model_ratio, split_of
from pdgate.loadtest.scheduling.closed_loop import send_completion
from pdgate.loadtest.scheduling.clusters import ProcessCluster
from pdgate.loadtest.scheduling.modes import ClusterSpec, mode_named
from pdgate.loadtest.scheduling.runner import Point, Timing, run_point
from pdgate.loadtest.scheduling.workload import Prompt
from pdgate.loadtest.scheduling.workload import Workload as Prompts

__all__ = [
    "PRIME_REQUESTS",
    "Plan",
    "Result",
    "Run",
    "Split",
    "read_advice",
    "run_experiment",
    "split_label",
]

Split = tuple[int, int]  # (prefills, decodes)

# Accepted prefills a gateway needs before its early drop works (gateway/placement/prefill_time.py,
# PrefillTimes.min_samples = 16), with a margin.
PRIME_REQUESTS = 20

# On-demand forwarding as the scheduling benchmark runs it (queue-less prefills, EDF
# gateway queue, least open SSE streams): pdgate's default way of serving.
_MODE = mode_named("least_sse")


def split_label(split: Split) -> str:
    return f"{split[0]}:{split[1]}"


@dataclass(frozen=True, slots=True)
class Plan:
    shape: Shape = field(default_factory=Shape)
    workloads: tuple[Workload, ...] = WORKLOADS
    starts: tuple[Split, ...] = ((6, 2), (2, 6))
    # Per workload name, instead of `starts` (--quick: only the start the shape is worst for).
    starts_by_workload: tuple[tuple[str, tuple[Split, ...]], ...] = ()
    extra_splits: tuple[Split, ...] = ()  # also run these, whatever the advice
    seeds: tuple[int, ...] = (0, 1, 2)
    timing: Timing = field(default_factory=lambda: Timing(warmup_s=8.0, measure_s=15.0))
    users_scale: float = 1.0  # multiplies every workload's users (--quick: fewer)

    def __post_init__(self) -> None:
        if not self.workloads or not self.starts or not self.seeds:
            raise ValueError("a plan needs at least one workload, start split and seed")
        every = [s for _, starts in self.starts_by_workload for s in starts]
        for p, d in (*self.starts, *every, *self.extra_splits):
            if p < 1 or d < 1 or p + d != self.shape.instances:
                raise ValueError(
                    f"split {p}:{d}: each role at least 1, {self.shape.instances} in all"
                )

    def starts_of(self, workload: Workload) -> tuple[Split, ...]:
        return dict(self.starts_by_workload).get(workload.name, self.starts)

    def users(self, workload: Workload) -> int:
        return max(1, round(workload.users * self.users_scale))


@dataclass(frozen=True, slots=True)
class Run:
    workload: str
    seed: int
    split: Split
    kind: str  # start | advised | sweep
    point: Point
    # The gateway's advice for the group at the window's end (GET /admin/ratio; with
    # several gateways: ratios averaged, desired counts summed); None if it had none.
    advice: dict[str, Any] | None
    advised: Split | None  # the advice rounded to whole instances (None: insufficient data)
    load_avg: float  # the box's 1-minute load average at the window's end

    @property
    def label(self) -> str:
        return split_label(self.split)


@dataclass
class Result:
    plan: Plan
    runs: list[Run]
    wall_s: float = 0.0
    load_avg: tuple[float, float] = (math.nan, math.nan)  # 1-minute, at the start and end

    def of(self, workload: str, seed: int, split: Split) -> Run | None:
        """The first run of `split` (a start run before an advised one of the same split)."""
        for run in self.runs:
            if (run.workload, run.seed, run.split) == (workload, seed, split):
                return run
        return None


def _combine(groups: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """One advice from every gateway's for the same group: each gateway measures its share
    of the traffic; ratios and times are averaged, demand and desired counts summed."""
    if not groups:
        return None
    out = dict(groups[0])
    for key in ("demand_rps", "desired_prefills", "desired_decodes"):
        known = [float(v) for g in groups if (v := g.get(key)) is not None]
        out[key] = sum(known) if known else None
    for key in ("ratio", "t_prefill_s", "t_decode_s", "xi_s", "tokens", "tpot_s"):
        known = [float(v) for g in groups if (v := g.get(key)) is not None]
        out[key] = sum(known) / len(known) if known else None
    return out


async def read_advice(
    session: aiohttp.ClientSession, gateways: Sequence[str], group: str = "default"
) -> dict[str, Any] | None:
    """`group`'s advice from every gateway's ``GET /admin/ratio``, combined."""
    found: list[dict[str, Any]] = []
    for url in gateways:
        async with session.get(url + "/admin/ratio", timeout=aiohttp.ClientTimeout(total=10)) as r:
            r.raise_for_status()
            body = await r.json()
        found += [g for g in body["groups"] if g.get("group") == group]
    return _combine(found)


async def prime(
    session: aiohttp.ClientSession,
    gateways: Sequence[str],
    model: str,
    prompts: Prompts,
    concurrency: int,
    requests: int = PRIME_REQUESTS,
) -> int:
    """Send `requests` one-token requests of the workload through each gateway, at most
    `concurrency` at once; how many succeeded."""
    rng = prompts.user_rng(10**9)  # a stream no measured user draws from
    ok = 0
    for url in gateways:
        todo = [prompts.next_prompt(rng) for _ in range(requests)]
        for i in range(0, requests, concurrency):
            batch = [Prompt(replace(p.scenario, max_tokens=1), p.text, p.tokens)
                     for p in todo[i : i + concurrency]]  # fmt: skip
            results = await asyncio.gather(
                *(send_completion(session, url + "/v1/completions", model, p) for p in batch)
            )
            ok += sum(r.success for r in results)
    return ok


def _ramp_s(workload: Workload, plan: Plan) -> float:
    """Users start over one request's length (as eq. 1 from the sim profile has it), within
    the warm-up: with one scenario every request of a user takes about as long, and users
    started together would move in waves that a short window samples at one phase or
    another."""
    model = model_ratio(workload, plan.shape)
    return min(0.75 * plan.timing.warmup_s, model["t_prefill_s"] + model["t_decode_s"])


def _spec(plan: Plan, split: Split) -> ClusterSpec:
    shape = plan.shape
    return ClusterSpec(
        sim_profile=shape.sim_profile,
        gateways=shape.gateways,
        prefills=split[0],
        decodes=split[1],
        prefill_capacity=shape.prefill_capacity,
        decode_capacity=shape.decode_capacity,
        prefix_cache_blocks=0,  # unique prompts: no hits to model, no index to keep
        kv_wire_fraction=shape.kv_wire_fraction,
        # The advice's window = warm-up + measurement window, read at the window's end: the
        # whole run after priming. (The gateway needs 20 decoded requests in it, and a
        # decode-bound split finishes only a few a second.)
        gateway={"ratio_window_s": plan.timing.warmup_s + plan.timing.measure_s},
    )


async def _run(
    session: aiohttp.ClientSession,
    plan: Plan,
    workload: Workload,
    seed: int,
    split: Split,
    kind: str,
    log: Log,
) -> Run:
    prompts = Prompts((workload.scenario,), seed=seed)
    timing = plan.timing
    async with ProcessCluster(_spec(plan, split), _MODE) as cluster:
        await cluster.wait_ready(session)
        gateways = cluster.urls.gateways
        slots = split[0] * plan.shape.prefill_capacity
        await prime(session, gateways, cluster.spec.model, prompts, slots)

        async def advice_at_window_end() -> dict[str, Any] | None:
            await asyncio.sleep(timing.warmup_s + timing.measure_s)
            return await read_advice(session, gateways)

        point, advice = await asyncio.gather(
            run_point(cluster, session, prompts, plan.users(workload), timing,
                      seed=seed, name=workload.name, ramp_s=_ramp_s(workload, plan)),
            advice_at_window_end(),
        )  # fmt: skip
    ratio = advice.get("ratio") if advice else None
    advised = split_of(ratio, plan.shape.instances) if ratio else None
    run = Run(workload.name, seed, split, kind, point, advice, advised, os.getloadavg()[0])
    log(_describe(run))
    return run


def _describe(run: Run) -> str:
    s = run.point.summary
    a = run.advice or {}
    ratio = a.get("ratio")
    return (
        f"  {run.workload:>12} seed={run.seed} {run.kind:>7} {run.label} "
        f"users={run.point.users} success={s.success_rate:6.1%} "
        f"goodput={s.goodput_rps:5.2f}/s ttft_p50={s.ttft_p50_s:5.2f}s "
        f"advice={'n/a' if ratio is None else f'{ratio:.3f}'}"
        f"->{'n/a' if run.advised is None else split_label(run.advised)} "
        f"({a.get('bottleneck', 'n/a')}) cpu={run.point.host_cpu:4.2f} "
        f"load={run.load_avg:.1f} ({run.point.wall_s:.0f}s)"
    )


async def run_experiment(plan: Plan, log: Log = to_stderr) -> Result:
    began = time.monotonic()
    load0 = os.getloadavg()[0]
    runs: list[Run] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for seed in plan.seeds:
            for workload in plan.workloads:
                starts = plan.starts_of(workload)
                done: set[Split] = set()
                for split in starts:
                    run = await _run(session, plan, workload, seed, split, "start", log)
                    runs.append(run)
                    done.add(split)
                advised = [r.advised for r in runs[-len(starts) :] if r.advised]
                todo = [(s, "advised") for s in dict.fromkeys(advised) if s not in done]
                todo += [(s, "sweep") for s in plan.extra_splits if s not in done | set(advised)]
                for split, kind in todo:
                    runs.append(await _run(session, plan, workload, seed, split, kind, log))
    return Result(plan, runs, time.monotonic() - began, (load0, os.getloadavg()[0]))
