"""``pdgate bench summary policies|fleet-targets CSV...``: tables from `pdgate bench scheduling`
CSVs, without running anything.

``policies`` (policies.py) sets the policies side by side per load: prefix hit rate, goodput
and TTFT p99 over the seeds. ``fleet-targets`` (fleet_targets.py) checks several gateways
and multi-slot prefills against one gateway's success and goodput, and lists the misses.
Prints markdown.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["HELP", "configure", "main"]

HELP = "tables from `pdgate bench scheduling` CSVs (policies side by side, the fleet's targets)"


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("table", choices=("policies", "fleet-targets"))
    p.add_argument("csv", type=Path, nargs="+", help="fleet-targets: one CSV")
    p.add_argument(
        "--slots",
        type=int,
        help="fleet-targets: the prefills' slots of series named MODE/gN (a run of one "
        "--prefill-slots value)",
    )


def main(args: argparse.Namespace, command: str) -> int:
    from pdgate.loadtest.summary import fleet_targets, policies

    if args.table == "policies":
        print(policies.table(args.csv), end="", flush=True)
        return 0
    if len(args.csv) != 1:
        print("pdgate bench summary fleet-targets: one CSV", file=sys.stderr)
        return 2
    try:
        table = fleet_targets.table(args.csv[0], args.slots)
    except ValueError as exc:  # a CSV of another bench, or with nothing to compare with
        print(f"pdgate bench summary fleet-targets: {exc}", file=sys.stderr)
        return 2
    print(table, end="", flush=True)
    return 0
