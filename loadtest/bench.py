"""``pdgate bench scheduling``: the command line of the scheduling experiment.

Progress goes to stderr; stdout gets exactly one JSON line,
``{"success": {MODE: {"1": r, ...}}, "goodput": {...}, "prefix_hit_rate": {...}}``,
keyed by load multiple of A. Files: ``OUT/KIND.csv``, ``OUT/KIND.png``, ``OUT/KIND.md``
(KIND = quick or full) and, unless ``--no-doc``, the generated block of the doc.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import orjson

from loadtest.experiment import Plan, Result, run_experiment
from loadtest.modes import MODES, mode_named
from loadtest.report import (
    calibration_table,
    markdown_table,
    summary_json,
    update_doc,
    write_csv,
    write_plot,
)
from loadtest.runner import Timing

__all__ = ["main"]

# A of the quick run, from the full run's calibration (docs/scheduling.md): the quick run
# has no time to calibrate.
QUICK_BASE_USERS = 4


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdgate bench", description=__doc__)
    sub = p.add_subparsers(dest="bench", required=True)
    s = sub.add_parser("scheduling", help="baseline vs on-demand forwarding at loads A..4A")
    s.add_argument("--quick", action="store_true", help="short windows, modes in parallel (<60 s)")
    s.add_argument("--out", type=Path, default=Path("docs/scheduling"), help="output folder")
    s.add_argument("--doc", type=Path, default=Path("docs/scheduling.md"))
    s.add_argument("--no-doc", action="store_true", help="do not update the doc's table")
    s.add_argument("--base-users", type=int, help="A; default: calibrate (full), 4 (quick)")
    s.add_argument("--measure-s", type=float, help="measurement window per load level")
    s.add_argument("--warmup-s", type=float, help="warm-up per load level")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--modes", default=",".join(m.name for m in MODES))
    s.add_argument("--multiples", default="1,2,3,4", help="load levels, as multiples of A")
    par = s.add_mutually_exclusive_group()
    par.add_argument("--parallel", dest="parallel", action="store_true", default=None)
    par.add_argument("--sequential", dest="parallel", action="store_false")
    return p


def plan_from_args(args: argparse.Namespace) -> Plan:
    plan = Plan(
        modes=tuple(mode_named(m.strip()) for m in args.modes.split(",") if m.strip()),
        multiples=tuple(int(k) for k in args.multiples.split(",")),
        seed=args.seed,
    )
    if args.quick:
        plan = replace(
            plan,
            timing=Timing(warmup_s=1.0, measure_s=6.0),
            base_users=QUICK_BASE_USERS,
            parallel=True,
        )
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


def describe(plan: Plan) -> str:
    spec = plan.spec
    return (
        f"{spec.gateways} gateway(s), {spec.prefills} prefill(s) x {spec.prefill_capacity} "
        f"slot(s), {spec.decodes} decode(s) x {spec.decode_capacity}, sim {spec.sim_profile}, "
        f"prefix cache {spec.prefix_cache_blocks} blocks/prefill"
    )


def write_outputs(result: Result, kind: str, out: Path, doc: Path | None, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_csv(result, out / f"{kind}.csv")
    write_plot(result, out / f"{kind}.png", f"pdgate bench scheduling ({kind}): {describe(result.plan)}")
    table = markdown_table(result)
    calibration = calibration_table(result.calibration, result.plan.success_target)
    block = (
        f"Command: `{command}` ({result.wall_s:.0f} s wall clock)\n\n"
        f"Cluster: {describe(result.plan)}. A = {result.base_users} users"
        + (" (calibrated below)" if result.calibration else " (fixed)")
        + f"; {result.plan.timing.measure_s:g} s window per level after "
        f"{result.plan.timing.warmup_s:g} s warm-up; modes run "
        + ("in parallel" if result.plan.parallel else "one after another")
        + ".\n\n"
        + table
        + (f"\nCalibration of A (baseline):\n\n{calibration}" if calibration else "")
        + f"\n![{kind} run]({out.name}/{kind}.png)\n"
    )
    (out / f"{kind}.md").write_text(block)
    if doc is not None and doc.exists() and not update_doc(doc, kind, block):
        print(f"{doc}: no scheduling:{kind} markers; table left in {out}/{kind}.md", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    plan = plan_from_args(args)
    kind = "quick" if args.quick else "full"
    command = "pdgate bench " + shlex.join(list(argv) if argv is not None else sys.argv[1:])
    result = asyncio.run(run_experiment(plan))
    write_outputs(result, kind, args.out, None if args.no_doc else args.doc, command)
    print(orjson.dumps(summary_json(result), option=orjson.OPT_SERIALIZE_NUMPY).decode(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
