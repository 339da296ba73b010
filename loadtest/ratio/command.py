"""``pdgate bench ratio``: goodput at unbalanced P/D splits vs at the split the gateway's
ratio advice (eq. 1 of P/D-Serve, ``GET /admin/ratio``) gives, for a prompt-heavy and a
decode-heavy workload, on a simulated cluster of separate processes.

Progress goes to stderr; stdout gets one JSON line: per workload, the model's ratio and, per
start split, goodput and success at the start, the advised ratio and split, goodput and
success at the advised split and the gain (min / median / max over seeds), and the goodput
of every split run. Files: ``OUT/KIND.csv`` (every run), ``OUT/KIND.png``, ``OUT/KIND.md``
and, unless ``--no-doc``, the ``ratio:KIND`` block of the doc (KIND = quick or full, or
``--kind``).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from pdgate.loadtest.lib.args import positive_int
from pdgate.loadtest.lib.docs import publish, save_run
from pdgate.loadtest.lib.suite import add_outputs, add_runs, run_experiment_command
from pdgate.loadtest.ratio.experiment import Plan, Result, Split, run_experiment
from pdgate.loadtest.ratio.report import markdown, summary_json, write_csv, write_plot
from pdgate.loadtest.ratio.workload import QUICK_WORKLOADS, WORKLOADS, Shape, workload_named
from pdgate.loadtest.scheduling.runner import Timing

__all__ = ["HELP", "configure", "describe", "main", "plan_from_args"]

HELP = "goodput at unbalanced P/D splits vs at the gateway's advised split"


def _splits(text: str) -> tuple[Split, ...]:
    out: list[Split] = []
    for item in text.split(","):
        p, sep, d = item.strip().partition(":")
        if not sep:
            raise argparse.ArgumentTypeError(f"{item!r}: expected PREFILLS:DECODES, e.g. 6:2")
        try:
            out.append((int(p), int(d)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: not two whole numbers") from None
    return tuple(out)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quick", action="store_true",
        help="shorter workloads and windows, one seed, each workload from its worst start (<90 s)",
    )  # fmt: skip
    add_outputs(p, "ratio")
    p.add_argument(
        "--workloads",
        help="comma-separated, default all: " + ", ".join(w.name for w in WORKLOADS),
    )
    p.add_argument("--starts", type=_splits, help="start splits, default 6:2,2:6")
    p.add_argument(
        "--splits",
        type=_splits,
        default=(),
        help="more splits to run whatever the advice (a sweep)",
    )
    p.add_argument("--instances", type=positive_int, help="prefills + decodes (default 8)")
    p.add_argument("--gateways", type=positive_int, help="gateways (default 1)")
    add_runs(
        p, per="split", warmup="warm-up per run (default 8)", measure="window per run (default 15)"
    )
    p.add_argument("--users-scale", type=float, help="multiply the workloads' users")


def plan_from_args(args: argparse.Namespace) -> Plan:
    quick = bool(args.quick)
    names = [n.strip() for n in (args.workloads or "").split(",") if n.strip()]
    pool = QUICK_WORKLOADS if quick else WORKLOADS
    workloads = tuple(workload_named(n, quick=quick) for n in names) if names else pool
    shape = Shape()
    if args.instances is not None:
        shape = replace(shape, instances=args.instances)
    if args.gateways is not None:
        shape = replace(shape, gateways=args.gateways)
    seeds = args.seeds or (1 if quick else 3)
    timing = Timing(warmup_s=3.0, measure_s=8.0) if quick else Timing(warmup_s=8.0, measure_s=15.0)
    if args.warmup_s is not None:
        timing = replace(timing, warmup_s=args.warmup_s)
    if args.measure_s is not None:
        timing = replace(timing, measure_s=args.measure_s)
    by_workload: tuple[tuple[str, tuple[Split, ...]], ...] = ()
    if quick and args.starts is None:
        # Each shape from the split it suits worst: too few prefills for long prompts, too
        # few decodes for long outputs.
        few = 2 * shape.instances // 8 or 1
        by_workload = (
            ("prompt_heavy", ((few, shape.instances - few),)),
            ("decode_heavy", ((shape.instances - few, few),)),
        )
    starts = args.starts or ((6, 2), (2, 6))
    if args.instances is not None and args.starts is None and not by_workload:
        few = max(1, shape.instances // 4)
        starts = ((shape.instances - few, few), (few, shape.instances - few))
    return Plan(
        shape=shape,
        workloads=workloads,
        starts=starts,
        starts_by_workload=by_workload,
        extra_splits=tuple(args.splits),
        seeds=tuple(range(args.seed, args.seed + seeds)),
        timing=timing,
        users_scale=args.users_scale if args.users_scale is not None else 1.0,
    )


def describe(plan: Plan) -> str:
    s = plan.shape
    return (
        f"{s.instances} instances split between prefills ({s.prefill_capacity} slot each) "
        f"and decodes ({s.decode_capacity} running sequences each), {s.gateways} gateway(s), "
        f"each its own process, registry in a private Redis; sim {s.sim_profile}, no prefix "
        f"cache (unique prompts); on-demand forwarding (least_sse, EDF queue); "
        f"{plan.timing.warmup_s:g} s warm-up then a {plan.timing.measure_s:g} s window per run, "
        f"the advice read at the window's end over warm-up + window; {len(plan.seeds)} seed(s)"
    )


def write_outputs(result: Result, kind: str, out: Path, doc: Path | None, command: str) -> None:
    title = f"pdgate bench ratio ({kind})"
    plot = save_run(out, kind, result, title, csv=write_csv, plot=write_plot)
    publish(markdown(result, command, plot, describe(result.plan)), out, kind, doc, "ratio")


def main(args: argparse.Namespace, command: str) -> int:
    return run_experiment_command(
        "ratio", args, command, plan_from_args, run_experiment, write_outputs, summary_json
    )
