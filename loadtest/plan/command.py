"""``pdgate plan FILE``: the cheapest heterogeneous P/D fleet for a workload and its SLOs
(loadtest/plan/planner.py), printed as a table, then as one JSON line last:
``{"plan": {"prefill": {...}, "decode": {...}, "cost_per_hour", "cost_per_million_tokens",
"mixed"}, "single_type": {GPU: plan or null}, "input": {...}}``, with ``--verify`` also
``"verify": {"slo_attainment", ...}``. ``--example`` plans the example shipped in the
package (loadtest/plan/example.toml).

``--verify`` starts the planned fleet in the simulator as deployed (every shim and a
gateway its own process, a private Redis; each instance's timing from the roofline of its
GPU type and parallelism) and sends Poisson arrivals at the target rate: SLO attainment is
the share of requests within both the TTFT and the TPOT SLO.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

import orjson

from pdgate.loadtest.plan.planner import Plan, PlanInput, best_plans

__all__ = ["HELP", "configure", "main"]

HELP = "the cheapest prefill and decode fleet (GPU types, parallelism, counts) for given SLOs"


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", nargs="?", type=Path, help="the plan's input (TOML)")
    p.add_argument("--example", action="store_true", help="plan the shipped example")
    p.add_argument(
        "--verify", action="store_true", help="run the plan in the simulator at the target rate"
    )
    p.add_argument("--verify-s", type=float, default=30.0, help="the verification's window")
    p.add_argument("--seed", type=int, default=0, help="the verification's random seed")


def _input(args: argparse.Namespace) -> PlanInput:
    if args.example == (args.file is not None):
        raise ValueError("give the plan's input file, or --example")
    if args.example:
        raw = resources.files("pdgate.loadtest.plan").joinpath("example.toml").read_text()
    else:
        raw = args.file.read_text()
    try:
        return PlanInput.from_toml(tomllib.loads(raw))
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"the plan's input is not TOML: {exc}") from None


def table(best: Plan | None, single: dict[str, Plan | None]) -> str:
    rows = ["| plan | role | GPU | TP x PP | instances | GPUs | per instance, req/s "
            "| TTFT p99 / TPOT, s | cost/h | per M tokens |",
            "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    entries = [("chosen", best), *((f"{gpu} only", plan) for gpu, plan in single.items())]
    for name, plan in entries:
        if plan is None:
            rows.append(f"| {name} | - | no plan meets the SLOs with these GPUs | | | | | | | |")
            continue
        for role in (plan.prefill, plan.decode):
            cost = f"{plan.cost_per_hour:.2f}" if role is plan.prefill else ""
            per_m = f"{plan.cost_per_million_tokens:.4f}" if role is plan.prefill else ""
            rows.append(
                f"| {name if role is plan.prefill else ''} | {role.role} | {role.gpu} | "
                f"{role.parallel.tp} x {role.parallel.pp} | {role.instances} | {role.gpus} | "
                f"{role.throughput_rps:.2f} | {role.latency_s:.3f} | {cost} | {per_m} |"
            )
    return "\n".join(rows)


def main(args: argparse.Namespace) -> int:
    spec = _input(args)
    best, single = best_plans(spec)
    print(table(best, single), flush=True)
    out: dict[str, Any] = {
        "plan": None if best is None else best.as_json(),
        "single_type": {gpu: None if p is None else p.as_json() for gpu, p in single.items()},
        "input": {
            "model": spec.model,
            "rate_rps": spec.rate_rps,
            "prompt_tokens": spec.prompt_tokens,
            "output_tokens": spec.output_tokens,
            "ttft_slo_s": spec.ttft_slo_s,
            "tpot_slo_s": spec.tpot_slo_s,
        },
    }
    if args.verify:
        if best is None:
            print("pdgate plan: nothing to verify: no plan meets the SLOs", file=sys.stderr)
            return 1
        from pdgate.loadtest.plan.verify import verify  # starts servers: only when asked

        out["verify"] = verify(best, window_s=args.verify_s, seed=args.seed)
    print(orjson.dumps(out).decode(), flush=True)
    return 0 if best is not None else 1
