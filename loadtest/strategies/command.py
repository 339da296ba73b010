"""``pdgate bench strategies``: aggregated, disaggregated and partial serving on the same
simulated GPUs, each at loads from half to twice its own capacity.

Progress goes to stderr; stdout gets one JSON line, ``{"strategies": {"aggregated": {...},
"disaggregated": {...}, "partial": {...}}, "settings": {...}, ...}``: each strategy with
its instances, its capacity (the highest Poisson rate with 90% of the requests in both
SLOs, and that per GPU) and, keyed by load ("0.5",
"1", ...), ``slo_attainment``, ``goodput_per_gpu``, TTFT and TPOT p50 / p99 and the mean
phase-switching wait (medians over seeds, with the spread of the first two); ``strategies``
is the first setting's (the first workload on the first interconnect), ``settings`` has
every one. Files: ``OUT/KIND.csv`` (every point, the capacity searches' too), ``OUT/KIND.png``,
``OUT/KIND.md`` and, unless ``--no-doc``, the ``strategies:KIND`` block of the doc.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

from pdgate.loadtest.lib.args import positive_int, positive_numbers, some_of
from pdgate.loadtest.lib.docs import publish, save_run
from pdgate.loadtest.lib.suite import add_outputs, add_runs, run_experiment_command
from pdgate.loadtest.scheduling.runner import Timing
from pdgate.loadtest.scheduling.workload import WORKLOADS
from pdgate.loadtest.strategies.experiment import Result, run_experiment
from pdgate.loadtest.strategies.plan import STRATEGIES, StrategiesPlan
from pdgate.loadtest.strategies.report import markdown, summary_json, write_csv, write_plot

__all__ = ["HELP", "configure", "describe", "main", "plan_from_args"]

HELP = "aggregated, disaggregated and partial serving on the same GPUs, 0.5x-2x capacity"


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quick",
        action="store_true",
        help="the mix on 25 Gb/s, loads 0.5,1,2, one seed, short windows (a few minutes)",
    )
    add_outputs(p, "strategies")
    p.add_argument(
        "--strategies",
        type=some_of(STRATEGIES),
        help=f"comma-separated, default all: {', '.join(STRATEGIES)}",
    )
    p.add_argument(
        "--workloads",
        type=some_of(list(WORKLOADS)),
        help="comma-separated scheduling workloads (default mix,long-prompt; quick: mix)",
    )
    p.add_argument(
        "--interconnects",
        type=positive_numbers,
        help="KV links in Gb/s, comma-separated (default 25,400; quick: 25)",
    )
    p.add_argument(
        "--loads",
        type=positive_numbers,
        help="shares of each strategy's capacity (default 0.5,1,1.5,2)",
    )
    p.add_argument("--gpus", type=positive_int, help="simulated GPUs per strategy (default 8)")
    p.add_argument("--tpot-slo-ms", type=float, help="every request's TPOT SLO (default 100)")
    p.add_argument("--slots", type=positive_int, help="sequences per decode or aggregated instance")
    p.add_argument("--prefill-slots", type=positive_int, help="batch slots per prefill (default 1)")
    add_runs(p, per="load", warmup="warm-up per point", measure="window per load point")
    p.add_argument("--search-s", type=float, help="window per point of the capacity search")
    p.add_argument(
        "--start-rps",
        type=float,
        help="the capacity search's first rate, requests/s per GPU (default 0.5)",
    )
    p.add_argument(
        "--bisections",
        type=int,
        help="halvings of the capacity search's last interval (default 3; quick: 1)",
    )


def plan_from_args(args: argparse.Namespace) -> StrategiesPlan:
    plan = StrategiesPlan()
    if args.quick:
        plan = replace(
            plan,
            workloads=("mix",),
            interconnects_gbps=(25.0,),
            loads=(0.5, 1.0, 2.0),
            seeds=(0,),
            timing=Timing(warmup_s=2.0, measure_s=8.0),
            sweep_timing=Timing(warmup_s=2.0, measure_s=6.0),
            bisections=1,
        )
    seeds = args.seeds or len(plan.seeds)
    changes: dict[str, Any] = {"seeds": tuple(range(args.seed, args.seed + seeds))}
    for arg, name in (
        ("strategies", "strategies"),
        ("workloads", "workloads"),
        ("interconnects", "interconnects_gbps"),
        ("loads", "loads"),
        ("gpus", "gpus"),
        ("slots", "slots"),
        ("prefill_slots", "prefill_slots"),
        ("bisections", "bisections"),
        ("start_rps", "start_rps"),
    ):
        if getattr(args, arg) is not None:
            changes[name] = getattr(args, arg)
    if args.tpot_slo_ms is not None:
        changes["tpot_slo_s"] = args.tpot_slo_ms / 1000
    timing, sweep = plan.timing, plan.sweep_timing
    if args.warmup_s is not None:
        timing = replace(timing, warmup_s=args.warmup_s)
        sweep = replace(sweep, warmup_s=args.warmup_s)
    if args.measure_s is not None:
        timing = replace(timing, measure_s=args.measure_s)
    if args.search_s is not None:
        sweep = replace(sweep, measure_s=args.search_s)
    return replace(plan, timing=timing, sweep_timing=sweep, **changes)


def describe(plan: StrategiesPlan) -> str:
    return (
        f"{plan.gpus} simulated GPUs per strategy (sim {plan.sim_profile}), every shim and the "
        f"gateway its own process, registry in a private Redis; {plan.slots} sequences per "
        f"decode or aggregated instance, {plan.prefill_slots} slot(s) per prefill; TTFT "
        f"deadlines per scenario, TPOT SLO {1000 * plan.tpot_slo_s:g} ms for every request; "
        f"capacity = the highest Poisson rate with {plan.attainment_target:.0%} of the "
        f"requests in both SLOs; Poisson arrivals at "
        f"{', '.join(f'{f:g}' for f in sorted(plan.loads))} x each "
        f"strategy's capacity, {plan.timing.warmup_s:g} s warm-up and a "
        f"{plan.timing.measure_s:g} s window per point; {len(plan.seeds)} seed(s), a fresh "
        "cluster each"
    )


def write_outputs(result: Result, kind: str, out: Path, doc: Path | None, command: str) -> None:
    title = f"pdgate bench strategies ({kind}): {describe(result.plan)}"
    save_run(out, kind, result, title, csv=write_csv, plot=write_plot)
    block = (
        f"Command: `{command}` ({result.wall_s:.0f} s wall clock)\n\n"
        f"Cluster: {describe(result.plan)}.\n\n"
        + markdown(result)
        + f"\n![{kind} run]({kind}.png)\n"
    )
    publish(block, out, kind, doc, "strategies")


def _checked_plan(args: argparse.Namespace) -> StrategiesPlan:
    plan = plan_from_args(args)
    plan.check()
    return plan


def main(args: argparse.Namespace, command: str) -> int:
    return run_experiment_command(
        "strategies", args, command, _checked_plan, run_experiment, write_outputs, summary_json
    )
