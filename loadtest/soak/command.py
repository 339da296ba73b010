"""``pdgate bench soak``: does the gateway's memory stay flat under steady load?

Starts one gateway and its shims as separate processes (a private Redis between them),
drives steady streaming load with unique prompts for ``--duration-s`` and samples the
gateway's RSS. Progress goes to stderr; stdout gets one JSON line: the samples
(``[seconds, KiB, requests issued]``), RSS at the start, after the warm-up, at the end and
its maximum, the growth after warm-up (KiB, %, KiB/min from a fitted line, KiB per 1,000
requests) and the run's success rate. Unless ``--quick`` or ``--no-doc`` it also writes the
``soak:KIND`` block of docs/results/soak/README.md (KIND = the policy, or ``--kind``) and a
PNG beside it.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import orjson

from pdgate.loadtest.lib.children import run_main
from pdgate.loadtest.lib.docs import save_run, update_block
from pdgate.loadtest.lib.log import to_stderr

__all__ = ["HELP", "configure", "main"]

HELP = "the gateway's RSS over a steady run (default 3 minutes)"


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="30 s, 10 s warm-up, 8 users (smoke test)")
    p.add_argument("--duration-s", type=float, help="the whole run, warm-up included (180)")
    p.add_argument("--warmup-s", type=float, help="RSS after this is the baseline (30)")
    p.add_argument("--sample-s", type=float, help="seconds between RSS samples (5)")
    p.add_argument("--users", type=int, help="closed-loop users (16)")
    p.add_argument("--policy", help="prefill policy of the gateway (least_sse, the default)")
    p.add_argument("--prefills", type=int, help="prefill shims (2)")
    p.add_argument("--decodes", type=int, help="decode shims (1)")
    p.add_argument("--seed", type=int, help="workload seed (0)")
    p.add_argument(
        "--doc", type=Path, help="default: docs/results/soak/README.md (not with --quick)"
    )
    p.add_argument("--out", type=Path, default=Path("docs/results/soak"), help="folder of the PNG")
    p.add_argument("--kind", help="name of the doc block and PNG; default: the policy")
    p.add_argument("--no-doc", action="store_true")


def main(args: argparse.Namespace, command: str) -> int:
    from pdgate.loadtest.soak.report import markdown, write_plot
    from pdgate.loadtest.soak.run import QUICK, SoakPlan, run_soak

    plan = QUICK if args.quick else SoakPlan()
    names = ("duration_s", "warmup_s", "sample_s", "users", "policy", "prefills", "decodes", "seed")
    given = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    plan = replace(plan, **given)
    result = run_main(run_soak(plan, to_stderr))
    doc = args.doc or (None if args.quick else Path("docs/results/soak/README.md"))
    if doc is not None and not args.no_doc:
        kind = args.kind or plan.policy
        title = f"pdgate bench soak ({kind})"
        plot = save_run(args.out, kind, result, title, plot=write_plot)
        update_block(doc, f"soak:{kind}", markdown(result, command, plot), append=True)
    print(orjson.dumps(result).decode(), flush=True)
    return 0
