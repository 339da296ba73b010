"""``pdgate bench scheduling``: baseline vs on-demand forwarding at loads A..4A.

Progress goes to stderr; stdout gets exactly one JSON line,
``{"success": {SERIES: {"1": r, ...}}, "goodput": {...}, "prefix_hit_rate": {...},
"kv_hold_max_s": {...}, "kv_hold_over_5s": {...}, "kv_stranded": {...}, "deploy": ...,
"gateways": N or [N, ...], "seeds": [...], "base_users": A, "workload": ..., "arrivals": ...,
"prefill_slots": N, "batch_forwarding": ..., "capacity": {...} or null, "load_fraction":
{"1": f, ...}, "level_users": {"1": users, ...}, "goodput_fraction": {...}, "offered_rps":
{...}, "rejections_per_request": {...}, "retries_per_request": {...}}`` keyed by load
multiple of A (medians over seeds; with
several gateways also ``success_by_gateway``, with tenants ``success_by_tenant``, with an
open loop ``rate_rps`` and ``client_dropped``, with several seeds ``spread``); with
``--load-fractions`` the keys are shares of capacity ("0.5c", "2c"). Files:
``OUT/KIND.csv``, ``OUT/KIND.png``, ``OUT/KIND.md`` (KIND = quick or full, or ``--kind``),
with ``--trace`` ``OUT/KIND-trace.jsonl``, and, unless ``--no-doc``, the generated block
of the doc between its ``scheduling:KIND`` markers.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from pdgate.loadtest.lib.args import positive_int, some_of
from pdgate.loadtest.lib.docs import publish, save_run
from pdgate.loadtest.lib.suite import run_experiment_command
from pdgate.loadtest.scheduling.capacity import Capacity, CapacityPlan
from pdgate.loadtest.scheduling.clients import CLIENTS
from pdgate.loadtest.scheduling.clusters import DEPLOYS
from pdgate.loadtest.scheduling.experiment import Plan, Result, run_experiment
from pdgate.loadtest.scheduling.modes import (
    EXTRA_MODES,
    FEATURE_MODES,
    MODES,
    ROUTER_MODES,
    mode_named,
)
from pdgate.loadtest.scheduling.open_loop import ARRIVALS, Arrivals
from pdgate.loadtest.scheduling.report import (
    calibration_table,
    capacity_table,
    markdown_table,
    spread_table,
    summary_json,
    write_csv,
    write_plot,
    write_trace,
)
from pdgate.loadtest.scheduling.runner import Timing
from pdgate.loadtest.scheduling.workload import WORKLOADS

__all__ = ["HELP", "configure", "describe", "main", "plan_from_args", "write_outputs"]

HELP = "baseline vs on-demand forwarding at loads A..4A"

# A of the quick run, from the full run's calibration (docs/results/scheduling/README.md):
# the quick run has no time to calibrate.
QUICK_BASE_USERS = 8
# Nor to measure the capacity: a rough one of the default cluster (1 slot per prefill) and
# workload, from the committed full run (docs/results/scheduling/README.md): least_sse's
# goodput peaked at 17.3 req/s (4A); 12 users (1A), served without waiting, sent 0.6 req/s each.
QUICK_CAPACITY = Capacity(rps=17.3, user_rps=0.6)
# Runs per point of the full run: five seeds per point, so the spread can be reported.
FULL_SEEDS = 5
_BATCH_FORWARDING = {"on": (True,), "off": (False,), "both": (True, False)}


def _positives(text: str) -> tuple[int, ...]:
    try:
        values = tuple(positive_int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values:
        raise argparse.ArgumentTypeError("expected positive integers, comma-separated")
    return values


def _fractions(text: str | None) -> tuple[float, ...]:
    if not text:
        return ()
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"--load-fractions: expected numbers, comma-separated: {text}") from None


def _capacity(text: str) -> str | float:
    if text in ("measure", "off"):
        return text
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError("expected measure, off, or a positive req/s")
    return value


def configure(s: argparse.ArgumentParser) -> None:
    s.add_argument("--quick", action="store_true", help="short windows, modes in parallel (<60 s)")
    s.add_argument(
        "--out", type=Path, default=Path("docs/results/scheduling"), help="output folder"
    )
    s.add_argument("--doc", type=Path, default=Path("docs/results/scheduling/README.md"))
    s.add_argument("--no-doc", action="store_true", help="do not update the doc's table")
    s.add_argument(
        "--trace",
        action="store_true",
        help="also write OUT/KIND-trace.jsonl: one line per request of every window (its "
        "series, seed, load, gateway, prefill, scenario, status, TTFT, deadline, tries, "
        "Retry-After, when it was issued)",
    )
    s.add_argument(
        "--kind",
        help="name of the outputs (OUT/KIND.csv, ...) and of the doc's block; "
        "default: quick or full",
    )
    s.add_argument("--base-users", type=int, help="A; default: calibrate (full), 8 (quick)")
    s.add_argument("--measure-s", type=float, help="measurement window per load level")
    s.add_argument(
        "--warmup-s", type=float, help="warm-up per load level and calibration point (3 s)"
    )
    s.add_argument("--seed", type=int, default=0, help="the first seed")
    s.add_argument(
        "--seeds",
        type=positive_int,
        help="runs per point, seeds SEED..SEED+N-1 (fresh cluster and prompts each); "
        f"reports min / median / max; default {FULL_SEEDS} (full), 1 (quick)",
    )
    s.add_argument(
        "--modes",
        default=",".join(m.name for m in MODES),
        help="comma-separated; also: "
        + ", ".join(m.name for m in (*EXTRA_MODES, *FEATURE_MODES, *ROUTER_MODES))
        + " (router_*: vllm-router in front, needs pip install vllm-router; smg_*: SMG)",
    )
    s.add_argument("--multiples", default="1,2,3,4", help="load levels, as multiples of A")
    s.add_argument(
        "--load-fractions",
        help="load levels as shares of the capacity instead (e.g. 0.5,1,2: levels 0.5c, 1c, "
        "2c of capacity / user-rps users; open loop: exactly that share of capacity)",
    )
    s.add_argument(
        "--workload",
        default="mix",
        choices=list(WORKLOADS),
        help="the prompts (default mix: chat, code, agent, doc)",
    )
    s.add_argument("--prefills", type=int, help="prefill instances (default 8)")
    s.add_argument(
        "--prefill-slots",
        type=_positives,
        help="batch slots per prefill, comma-separated counts (e.g. 1,4,8: rows MODE/sK for "
        "each); default 1",
    )
    s.add_argument("--decodes", type=int, help="decode instances (default 1)")
    s.add_argument(
        "--batch-forwarding",
        choices=list(_BATCH_FORWARDING),
        help="the gateway's batch forwarding for the queued modes (default: the gateway's "
        "default, on); both: each such mode twice, rows MODE+bf and MODE-bf",
    )
    s.add_argument(
        "--gateways",
        type=_positives,
        help="gateways sharing the cluster, comma-separated counts (e.g. 1,2,4: rows "
        "MODE/gN for each); users are split evenly across them; above 1 needs "
        "--deploy processes (default 1)",
    )
    load = s.add_argument_group("load")
    load.add_argument(
        "--arrivals",
        choices=ARRIVALS,
        default="closed",
        help="closed loop of users (default), or an open loop at the rate those "
        "users would offer (capacity x load fraction)",
    )
    load.add_argument(
        "--client",
        choices=CLIENTS,
        default="instant",
        help="what a refused client does: its next request at once (instant, "
        "default), the same one after the Retry-After it was told, twice at most (honour), "
        "or what the official openai client does (openai: closed loop only)",
    )
    load.add_argument(
        "--honour-retry-after",
        action="store_const",
        dest="client",
        const="honour",
        help="the earlier name of --client honour (the commands of earlier results)",
    )
    load.add_argument(
        "--burst-factor",
        type=float,
        default=4.0,
        help="bursty: peak / mean rate (ON 1/B of the time)",
    )
    load.add_argument(
        "--burst-on-s", type=float, default=1.0, help="bursty: mean length of an ON period, s"
    )
    load.add_argument(
        "--max-in-flight",
        type=positive_int,
        help="open loop: the client's in-flight bound (default 4 x the level's "
        "users, at least 16); arrivals beyond it fail as dropped",
    )
    cap = s.add_argument_group("capacity")
    cap.add_argument(
        "--capacity",
        type=_capacity,
        help="measure (default, full run): sweep the reference mode's goodput; "
        "off; or a known capacity in successful req/s (with --user-rps); "
        "quick: a fixed rough one",
    )
    cap.add_argument(
        "--user-rps", type=float, help="with --capacity RPS: one unimpeded user's demand, req/s"
    )
    cap.add_argument(
        "--capacity-mode",
        default="least_sse",
        help="the mode whose maximum goodput is the capacity",
    )
    cap.add_argument(
        "--capacity-users",
        type=_positives,
        help="the sweep's user counts (default 0.5,1,1.5,...,4,5,6 x A)",
    )
    cap.add_argument(
        "--calibrate-s",
        type=float,
        help="window of each calibration and capacity point (default 30 s)",
    )
    s.add_argument(
        "--deploy",
        type=some_of(DEPLOYS),
        default=("inprocess",),
        help="inprocess (default: gateways and shims on one event loop in one child "
        "process), processes (every shim and gateway its own pdgate process, a private "
        "Redis), or both, comma-separated, side by side",
    )
    par = s.add_mutually_exclusive_group()
    par.add_argument("--parallel", dest="parallel", action="store_true", default=None)
    par.add_argument("--sequential", dest="parallel", action="store_false")


def _capacity_plan(args: argparse.Namespace) -> CapacityPlan:
    mode_named(args.capacity_mode)  # an unknown name fails here, before anything runs
    how = args.capacity if args.capacity is not None else ("fixed" if args.quick else "measure")
    common = {"mode": args.capacity_mode, "users": args.capacity_users or ()}
    if how in ("measure", "off"):
        if args.user_rps is not None:
            raise ValueError("--user-rps goes with a given --capacity RPS")
        return CapacityPlan(how=str(how), **common)
    if how == "fixed":  # quick, nothing given
        return CapacityPlan(how="fixed", fixed=QUICK_CAPACITY, **common)
    if args.user_rps is None or args.user_rps <= 0:
        raise ValueError("a given --capacity needs --user-rps (one unimpeded user's req/s)")
    return CapacityPlan(how="fixed", fixed=Capacity(float(how), args.user_rps), **common)


def plan_from_args(args: argparse.Namespace) -> Plan:
    """The plan of a command line; ValueError for a combination that cannot run."""
    seeds = args.seeds or (1 if args.quick else FULL_SEEDS)
    plan = Plan(
        modes=tuple(mode_named(m.strip()) for m in args.modes.split(",") if m.strip()),
        multiples=tuple(int(k) for k in args.multiples.split(",")),
        seeds=tuple(range(args.seed, args.seed + seeds)),
        deploys=tuple(args.deploy),
        workload=args.workload,
        gateways=args.gateways or (1,),
        batch_forwarding=_BATCH_FORWARDING.get(args.batch_forwarding or "", ()),
        arrivals=Arrivals(
            kind=args.arrivals,
            burst_factor=args.burst_factor,
            burst_on_s=args.burst_on_s,
            max_in_flight=args.max_in_flight,
            client=args.client,
        ),
        capacity=_capacity_plan(args),
        load_fractions=_fractions(args.load_fractions),
        trace=args.trace,
    )
    if args.quick:
        plan = replace(
            plan,
            timing=Timing(warmup_s=1.0, measure_s=6.0),
            base_users=QUICK_BASE_USERS,
            parallel=True,
        )
    shape = {k: getattr(args, k) for k in ("prefills", "decodes") if getattr(args, k) is not None}
    if args.prefill_slots is not None:
        shape["prefill_capacity"] = args.prefill_slots[0]
        if len(args.prefill_slots) > 1:
            plan = replace(plan, prefill_slots=tuple(args.prefill_slots))
    if shape:
        plan = replace(plan, spec=replace(plan.spec, **shape))
    timing, calibration = plan.timing, plan.calibration_timing
    if args.measure_s is not None:
        timing = replace(timing, measure_s=args.measure_s)
    if args.calibrate_s is not None:
        calibration = replace(calibration, measure_s=args.calibrate_s)
    if args.warmup_s is not None:
        timing = replace(timing, warmup_s=args.warmup_s)
        calibration = replace(calibration, warmup_s=args.warmup_s)
    return replace(
        plan,
        timing=timing,
        calibration_timing=calibration,
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
    gateways = (
        f"{plan.gateways[0]} gateway(s)"
        if len(plan.gateways) == 1
        else f"{', '.join(map(str, plan.gateways))} gateways (rows /gN)"
    )
    slots = (
        f"{', '.join(map(str, plan.prefill_slots))} (rows /sK)"
        if len(plan.prefill_slots) > 1
        else str(spec.prefill_capacity)
    )
    bf = {(): "", (True,): "; batch forwarding on", (False,): "; batch forwarding off"}.get(
        plan.batch_forwarding, "; batch forwarding on (+bf) and off (-bf)"
    )
    return (
        f"{gateways}, {spec.prefills} prefill(s) x {slots} "
        f"slot(s), {spec.decodes} decode(s) x {spec.decode_capacity}, sim {spec.sim_profile}, "
        f"prefix cache {spec.prefix_cache_blocks} blocks/prefill{bf}; {deployed}"
    )


def write_outputs(result: Result, kind: str, out: Path, doc: Path | None, command: str) -> None:
    title = f"pdgate bench scheduling ({kind}): {describe(result.plan)}"
    save_run(out, kind, result, title, csv=write_csv, plot=write_plot)
    plan = result.plan
    if plan.trace:
        write_trace(result, out / f"{kind}-trace.jsonl")
    calibration = calibration_table(result.calibration, plan.success_target)
    capacity = capacity_table(result)
    spread = spread_table(result)
    workload = plan.workload_spec
    seeds = (
        f"; {len(plan.seeds)} runs per point (seeds {plan.seeds[0]}-{plan.seeds[-1]}, a fresh "
        "cluster each)"
        if len(plan.seeds) > 1
        else ""
    )
    block = (
        f"Command: `{command}` ({result.wall_s:.0f} s wall clock)\n\n"
        f"Cluster: {describe(plan)}. Workload `{workload.name}`: {workload.about}. "
        f"Load: {plan.arrivals.describe()}. A = {result.base_users} users"
        + (" (calibrated below)" if result.calibration else " (fixed)")
        + f"; {plan.timing.measure_s:g} s window per level after "
        f"{plan.timing.warmup_s:g} s warm-up; modes run "
        + ("in parallel" if plan.parallel else "one after another")
        + seeds
        + ".\n\n"
        + markdown_table(result)
        + (f"\nSpread over seeds:\n\n{spread}" if spread else "")
        + (f"\nCalibration of A (baseline):\n\n{calibration}" if calibration else "")
        + (f"\nCapacity:\n\n{capacity}" if capacity else "")
        + f"\n![{kind} run]({kind}.png)\n"
    )
    publish(block, out, kind, doc, "scheduling")


def _checked_plan(args: argparse.Namespace) -> Plan:
    plan = plan_from_args(args)
    plan.check()  # every mode's settings, before any server starts
    return plan


def main(args: argparse.Namespace, command: str) -> int:
    return run_experiment_command(
        "scheduling", args, command, _checked_plan, run_experiment, write_outputs, summary_json
    )
