"""``pdgate bench chaos``: one fault at a time under steady open-loop streaming load, then
one gateway at 10x the fleet's capacity.

The fleet runs as deployed: every shim and gateway its own process, the registry in Redis
behind Sentinel (a primary, a replica, three sentinels). Poisson arrivals of streaming
requests go through two gateways; then, each followed by recovery: kill -9 a prefill, kill -9
a decode mid-stream (each replaced), SIGSTOP a prefill and then a decode for 10 s, kill -9
a gateway (restarted), kill -9 the Redis primary (Sentinel fails over; the old one rejoins
as a replica), and the Redis emptied. Per fault: client errors and their codes, the longest
stall of a running stream and the p99 over the streams open in the fault's window, time to
recover, and what the gateways, shims and Redis still hold afterwards (must be nothing); for
a decode's kill or stop, the streams that stalled across it and how many failed or missed
their deadline; for the gateway's kill, how long the prefills held KV for it after the kill
against the fleet's lease time, and their 429s while they did past it. Then the overload:
how fast and how the gateway sheds (429/503, Retry-After), its /health latency and RSS.
``--runs`` runs (default 3; 1 with ``--quick``); progress on stderr, one JSON line on
stdout; files ``OUT/KIND.md``, ``OUT/KIND.csv`` and, unless ``--no-doc``, the
``chaos:KIND`` block of the doc.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
from dataclasses import replace
from pathlib import Path

import orjson

from pdgate.loadtest.lib.args import with_args
from pdgate.loadtest.lib.children import run_main
from pdgate.loadtest.lib.docs import publish
from pdgate.loadtest.lib.suite import add_fields, add_outputs, kind_of

__all__ = ["HELP", "configure", "machine", "main"]

HELP = "kill, stop and fail over every kind of server under streaming load; then overload"

_NUMBERS = ("decode_capacity", "prefill_capacity", "max_tokens", "min_tokens", "seed")
_FLOATS = ("rate_rps", "steady_s", "stop_s", "observe_s", "settle_s", "overload_s",
           "overload_factor", "overload_rps")  # fmt: skip


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="short streams and windows, 1 run")
    p.add_argument("--runs", type=int, help="runs (seeds seed..seed+runs-1); default 3, quick 1")
    add_outputs(p, "chaos")
    p.add_argument("--faults", help="which, in order (default all: " + ",".join(_faults()) + ")")
    p.add_argument("--machine", help="the machine, for the doc (default: cores and memory)")
    add_fields(p, _NUMBERS, _FLOATS)


def _faults() -> tuple[str, ...]:
    from pdgate.loadtest.chaos.run import FAULTS

    return FAULTS


def machine() -> str:
    """``2 cores, 24 GiB, CPU, sim engine`` for this host."""
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        memory = f"{round(pages / 2**30)} GiB"
    except (ValueError, OSError):
        memory = "? GiB"
    return f"{os.cpu_count()} cores, {memory}, CPU, sim engine"


def main(args: argparse.Namespace, command: str) -> int:
    from pdgate.loadtest.chaos.report import markdown, summary_json, write_csv
    from pdgate.loadtest.chaos.run import QUICK, ChaosPlan, ChaosResult, run_chaos

    plan = QUICK if args.quick else ChaosPlan()
    faults = tuple(f.strip() for f in args.faults.split(",") if f.strip()) if args.faults else ()
    plan = with_args(plan, args, faults=faults or plan.faults)
    runs = args.runs if args.runs is not None else (1 if args.quick else 3)
    if runs < 1:
        raise SystemExit("--runs must be at least 1")
    kind = kind_of(args)
    results: list[ChaosResult] = []
    for i in range(runs):
        results.append(run_main(run_chaos(replace(plan, seed=plan.seed + i))))
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    write_csv(results, out / f"{kind}.csv")
    today = dt.datetime.now(dt.UTC).date().isoformat()
    block = markdown(results, command, date=today, machine=args.machine or machine())
    publish(block, out, kind, None if args.no_doc else args.doc, "chaos")
    print(block, flush=True, file=sys.stderr)
    print(orjson.dumps(summary_json(results)).decode(), flush=True)
    return 0
