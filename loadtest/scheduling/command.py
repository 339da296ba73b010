"""``pdgate bench scheduling``: baseline vs on-demand forwarding at loads A..4A.

Progress goes to stderr; stdout gets exactly one JSON line,
``{"success": {MODE: {"1": r, ...}}, "goodput": {...}, "prefix_hit_rate": {...},
"kv_hold_max_s": {...}, "kv_hold_over_5s": {...}, "kv_stranded": {...}, "deploy": ...,
"gateways": N, "seeds": [...]}`` keyed by load multiple of A (medians over seeds; with
several gateways also ``success_by_gateway``, with several seeds also ``spread``). Files:
``OUT/KIND.csv``, ``OUT/KIND.png``, ``OUT/KIND.md`` (KIND = quick or full, or ``--kind``)
and, unless ``--no-doc``, the generated block of the doc between its ``scheduling:KIND``
markers.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import orjson

from pdgate.loadtest.lib.children import run_main
from pdgate.loadtest.scheduling.clusters import DEPLOYS
from pdgate.loadtest.scheduling.experiment import Plan, Result, run_experiment
from pdgate.loadtest.scheduling.modes import EXTRA_MODES, MODES, ROUTER_MODES, mode_named
from pdgate.loadtest.scheduling.report import (
    calibration_table,
    markdown_table,
    spread_table,
    summary_json,
    update_doc,
    write_csv,
    write_plot,
)
from pdgate.loadtest.scheduling.runner import Timing

__all__ = ["HELP", "configure", "describe", "main", "plan_from_args", "write_outputs"]

HELP = "baseline vs on-demand forwarding at loads A..4A"

# A of the quick run, from the full run's calibration (docs/scheduling.md): the quick run
# has no time to calibrate.
QUICK_BASE_USERS = 8


def _deploys(text: str) -> tuple[str, ...]:
    names = tuple(d.strip() for d in text.split(",") if d.strip())
    unknown = [d for d in names if d not in DEPLOYS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected some of {', '.join(DEPLOYS)}")
    return names


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def configure(s: argparse.ArgumentParser) -> None:
    s.add_argument("--quick", action="store_true", help="short windows, modes in parallel (<60 s)")
    s.add_argument("--out", type=Path, default=Path("docs/scheduling"), help="output folder")
    s.add_argument("--doc", type=Path, default=Path("docs/scheduling.md"))
    s.add_argument("--no-doc", action="store_true", help="do not update the doc's table")
    s.add_argument(
        "--kind",
        help="name of the outputs (OUT/KIND.csv, ...) and of the doc's block; "
        "default: quick or full",
    )
    s.add_argument("--base-users", type=int, help="A; default: calibrate (full), 8 (quick)")
    s.add_argument("--measure-s", type=float, help="measurement window per load level")
    s.add_argument("--warmup-s", type=float, help="warm-up per load level")
    s.add_argument("--seed", type=int, default=0, help="the first seed")
    s.add_argument(
        "--seeds",
        type=_positive,
        default=1,
        help="runs per point, seeds SEED..SEED+N-1 (fresh cluster and prompts each); "
        "reports min / median / max",
    )
    s.add_argument(
        "--modes",
        default=",".join(m.name for m in MODES),
        help="comma-separated; also: "
        + ", ".join(m.name for m in (*EXTRA_MODES, *ROUTER_MODES))
        + " (router_*: vllm-router in front, needs pip install vllm-router)",
    )
    s.add_argument("--multiples", default="1,2,3,4", help="load levels, as multiples of A")
    s.add_argument("--prefills", type=int, help="prefill instances (default 8)")
    s.add_argument("--decodes", type=int, help="decode instances (default 1)")
    s.add_argument(
        "--gateways",
        type=_positive,
        help="gateways sharing the cluster (default 1); users are split evenly across them",
    )
    s.add_argument(
        "--deploy",
        type=_deploys,
        default=("inprocess",),
        help="inprocess (default: gateways and shims on one event loop in one child "
        "process), processes (every shim and gateway its own pdgate process, a private "
        "Redis), or both, comma-separated, side by side",
    )
    par = s.add_mutually_exclusive_group()
    par.add_argument("--parallel", dest="parallel", action="store_true", default=None)
    par.add_argument("--sequential", dest="parallel", action="store_false")


def plan_from_args(args: argparse.Namespace) -> Plan:
    plan = Plan(
        modes=tuple(mode_named(m.strip()) for m in args.modes.split(",") if m.strip()),
        multiples=tuple(int(k) for k in args.multiples.split(",")),
        seeds=tuple(range(args.seed, args.seed + args.seeds)),
        deploys=tuple(args.deploy),
    )
    if args.quick:
        plan = replace(
            plan,
            timing=Timing(warmup_s=1.0, measure_s=6.0),
            base_users=QUICK_BASE_USERS,
            parallel=True,
        )
    shape = {
        k: getattr(args, k)
        for k in ("prefills", "decodes", "gateways")
        if getattr(args, k) is not None
    }
    if shape:
        plan = replace(plan, spec=replace(plan.spec, **shape))
    timing = plan.timing
    if args.measure_s is not None:
        timing = replace(timing, measure_s=args.measure_s)
    if args.warmup_s is not None:
        timing = replace(timing, warmup_s=args.warmup_s)
    return replace(
        plan,
        timing=timing,
        base_users=args.base_users if args.base_users is not None else plan.base_users,
        parallel=args.parallel if args.parallel is not None else plan.parallel,
    )


_DEPLOYED = {
    "inprocess": "gateways and shims on one event loop in one process (in-memory registry)",
    "processes": "every shim and gateway its own process (registry in a private Redis)",
}


def describe(plan: Plan) -> str:
    spec = plan.spec
    deployed = (
        _DEPLOYED[plan.deploys[0]]
        if len(plan.deploys) == 1
        else "each mode deployed both ways: "
        + "; ".join(f"@{d}: {_DEPLOYED[d]}" for d in plan.deploys)
    )
    return (
        f"{spec.gateways} gateway(s), {spec.prefills} prefill(s) x {spec.prefill_capacity} "
        f"slot(s), {spec.decodes} decode(s) x {spec.decode_capacity}, sim {spec.sim_profile}, "
        f"prefix cache {spec.prefix_cache_blocks} blocks/prefill; {deployed}"
    )


def write_outputs(result: Result, kind: str, out: Path, doc: Path | None, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_csv(result, out / f"{kind}.csv")
    title = f"pdgate bench scheduling ({kind}): {describe(result.plan)}"
    try:
        write_plot(result, out / f"{kind}.png", title)
    except ImportError:
        print("no plot: matplotlib is missing (pip install -e '.[loadtest]')", file=sys.stderr)
    plan = result.plan
    calibration = calibration_table(result.calibration, plan.success_target)
    spread = spread_table(result)
    seeds = (
        f"; {len(plan.seeds)} runs per point (seeds {plan.seeds[0]}-{plan.seeds[-1]}, a fresh "
        "cluster each)"
        if len(plan.seeds) > 1
        else ""
    )
    block = (
        f"Command: `{command}` ({result.wall_s:.0f} s wall clock)\n\n"
        f"Cluster: {describe(plan)}. A = {result.base_users} users"
        + (" (calibrated below)" if result.calibration else " (fixed)")
        + f"; {plan.timing.measure_s:g} s window per level after "
        f"{plan.timing.warmup_s:g} s warm-up; modes run "
        + ("in parallel" if plan.parallel else "one after another")
        + seeds
        + ".\n\n"
        + markdown_table(result)
        + (f"\nSpread over seeds:\n\n{spread}" if spread else "")
        + (f"\nCalibration of A (baseline):\n\n{calibration}" if calibration else "")
        + f"\n![{kind} run]({out.name}/{kind}.png)\n"
    )
    (out / f"{kind}.md").write_text(block)
    if doc is not None and doc.exists() and not update_doc(doc, kind, block):
        print(f"{doc}: no scheduling:{kind} markers; see {out}/{kind}.md", file=sys.stderr)


def main(args: argparse.Namespace, command: str) -> int:
    plan = plan_from_args(args)
    kind = args.kind or ("quick" if args.quick else "full")
    result = run_main(run_experiment(plan))
    write_outputs(result, kind, args.out, None if args.no_doc else args.doc, command)
    print(orjson.dumps(summary_json(result)).decode(), flush=True)
    return 0
