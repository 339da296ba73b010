"""``pdgate bench scheduling`` and ``pdgate bench gateway``: the benchmarks' command line.

``gateway`` (loadtest/gateway_bench.py) prints one JSON line and, unless ``--quick`` or
``--no-doc``, writes docs/performance.md. ``profile`` (loadtest/gateway_profile.py) prints
py-spy's view of the gateway's hot path. The rest of this docstring is about ``scheduling``.

Progress goes to stderr; stdout gets exactly one JSON line,
``{"success": {MODE: {"1": r, ...}}, "goodput": {...}, "prefix_hit_rate": {...}}``,
keyed by load multiple of A. Files: ``OUT/KIND.csv``, ``OUT/KIND.png``, ``OUT/KIND.md``
(KIND = quick or full, or ``--kind``) and, unless ``--no-doc``, the generated block of the
doc between its ``scheduling:KIND`` markers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import orjson

from loadtest.experiment import Plan, Result, run_experiment
from loadtest.modes import EXTRA_MODES, MODES, ROUTER_MODES, mode_named
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
QUICK_BASE_USERS = 8


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdgate bench", description=__doc__)
    sub = p.add_subparsers(dest="bench", required=True)
    s = sub.add_parser("scheduling", help="baseline vs on-demand forwarding at loads A..4A")
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
    s.add_argument("--seed", type=int, default=0)
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
    par = s.add_mutually_exclusive_group()
    par.add_argument("--parallel", dest="parallel", action="store_true", default=None)
    par.add_argument("--sequential", dest="parallel", action="store_false")
    g = sub.add_parser("gateway", help="the gateway's own cost vs vllm-router and no router")
    g.add_argument("--quick", action="store_true", help="short windows, 1,000 idle streams (<90 s)")
    g.add_argument("--doc", type=Path, help="default: docs/performance.md (not with --quick)")
    g.add_argument("--no-doc", action="store_true")
    g.add_argument("--no-router", action="store_true", help="skip vllm-router")
    g.add_argument("--idle-streams", type=int, help="open idle streams (default 10000; 0: skip)")
    g.add_argument("--ttft-requests", type=int, help="c=1 probes per front (default 300)")
    g.add_argument("--concurrencies", help="comma-separated (default 32,256)")
    g.add_argument("--rounds", type=int, help="windows per front and concurrency (default 3)")
    g.add_argument("--window-s", type=float, help="seconds per window (default 10)")
    pr = sub.add_parser("profile", help="py-spy profile of the gateway on the hot path")
    pr.add_argument("--concurrency", type=int, default=1)
    pr.add_argument("--seconds", type=float, default=15.0)
    pr.add_argument("--top", type=int, default=25, help="functions listed")
    pr.add_argument("--out", type=Path, default=Path("gateway-profile.txt"), help="raw stacks")
    return p


def profile_main(args: argparse.Namespace) -> int:
    from loadtest.gateway_profile import ProfilePlan, profile_gateway

    plan = ProfilePlan(
        concurrency=args.concurrency, seconds=args.seconds, top=args.top, out=args.out
    )
    print(asyncio.run(profile_gateway(plan)), end="", flush=True)
    return 0


def gateway_main(args: argparse.Namespace, command: str) -> int:
    from loadtest.gateway_bench import QUICK, GatewayPlan, run_gateway_bench
    from loadtest.gateway_report import json_line, markdown

    plan = QUICK if args.quick else GatewayPlan()
    if args.idle_streams is not None:
        plan = replace(plan, idle_streams=args.idle_streams)
    for field in ("ttft_requests", "rounds", "window_s"):
        if getattr(args, field) is not None:
            plan = replace(plan, **{field: getattr(args, field)})
    if args.concurrencies:
        plan = replace(plan, concurrencies=tuple(int(c) for c in args.concurrencies.split(",")))
    if args.no_router:
        plan = replace(plan, with_router=False)
    load_before = os.getloadavg()
    result = asyncio.run(run_gateway_bench(plan, lambda m: print(m, file=sys.stderr, flush=True)))
    doc = args.doc or (None if args.quick else Path("docs/performance.md"))
    if doc is not None and not args.no_doc:
        load = f"load average before {load_before[0]:.2f}, after {result['load_avg_1m_after']:.2f}"
        update_gateway_doc(doc, markdown(result, command, load))
    print(orjson.dumps(json_line(result)).decode(), flush=True)
    return 0


def update_gateway_doc(doc: Path, block: str) -> None:
    """Replace the text between the doc's gateway markers, or write the block alone."""
    begin, end = "<!-- bench-gateway:begin -->", "<!-- bench-gateway:end -->"
    text = doc.read_text() if doc.exists() else ""
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + begin + "\n" + block + end + rest.split(end, 1)[1]
    else:
        text = text + begin + "\n" + block + end + "\n"
    doc.write_text(text)


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
    shape = {k: getattr(args, k) for k in ("prefills", "decodes") if getattr(args, k) is not None}
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
    title = f"pdgate bench scheduling ({kind}): {describe(result.plan)}"
    try:
        write_plot(result, out / f"{kind}.png", title)
    except ImportError:
        print("no plot: matplotlib is missing (pip install -e '.[loadtest]')", file=sys.stderr)
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
        print(f"{doc}: no scheduling:{kind} markers; see {out}/{kind}.md", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    command = "pdgate bench " + shlex.join(list(argv) if argv is not None else sys.argv[1:])
    if args.bench == "gateway":
        return gateway_main(args, command)
    if args.bench == "profile":
        return profile_main(args)
    plan = plan_from_args(args)
    kind = args.kind or ("quick" if args.quick else "full")
    result = asyncio.run(run_experiment(plan))
    write_outputs(result, kind, args.out, None if args.no_doc else args.doc, command)
    print(orjson.dumps(summary_json(result)).decode(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
