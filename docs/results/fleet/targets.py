"""The multi-slot fleet's targets, checked on a `pdgate bench scheduling` CSV.

    python docs/results/fleet/targets.py docs/results/fleet/fleet-slots.csv

Series are ``MODE/sK/gN`` (K slots a prefill, N gateways). Per load and slot count, against
one gateway of the same slots: success (median over seeds) within 2 points, goodput within
5%; per run, the gateways' own success within 3 points of each other (the worst seed); and
one gateway with K slots against one gateway with 1 slot. Prints one table, then the misses.
"""

from __future__ import annotations

import csv
import statistics
import sys
from collections import defaultdict


def main(path: str) -> int:
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["phase"] == "run"]
    by: dict[tuple[int, int, str], list[dict[str, str]]] = defaultdict(list)
    for r in rows:
        _, slots, gateways = r["mode"].split("/")
        by[(int(slots[1:]), int(gateways[1:]), r["multiple"])].append(r)

    def median(key: tuple[int, int, str], column: str) -> float:
        return statistics.median(float(r[column]) for r in by[key])

    def spread(key: tuple[int, int, str]) -> float:
        worst = 0.0
        for r in by[key]:
            own = [float(v) for k, v in r.items() if k.startswith("success_gateway") and v]
            if len(own) > 1:
                worst = max(worst, max(own) - min(own))
        return worst

    misses = []
    print("| slots | gateways | load | success min / med / max | vs 1 gw | goodput med | "
          "vs 1 gw | per-gateway spread (worst seed) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for slots, gateways, load in sorted(by, key=lambda k: (k[0], float(k[2]), k[1])):
        key = (slots, gateways, load)
        success = sorted(float(r["success_rate"]) for r in by[key])
        one = (slots, 1, load)
        d_success = 100 * (median(key, "success_rate") - median(one, "success_rate"))
        d_goodput = median(key, "goodput_rps") / median(one, "goodput_rps") - 1
        worst = 100 * spread(key)
        print(
            f"| {slots} | {gateways} | {load}A | {100 * success[0]:.1f} / "
            f"{100 * statistics.median(success):.1f} / {100 * success[-1]:.1f}% | "
            f"{d_success:+.1f} pt | {median(key, 'goodput_rps'):.2f} | {100 * d_goodput:+.1f}% "
            f"| {worst:.1f} pt |"
        )
        if gateways > 1 and (d_success < -2 or d_goodput < -0.05):
            misses.append(f"{slots} slots, {gateways} gateways, {load}A: {d_success:+.1f} pt, "
                          f"{100 * d_goodput:+.1f}% goodput against one gateway")  # fmt: skip
        if worst > 3:
            misses.append(f"{slots} slots, {gateways} gateways, {load}A: gateways {worst:.1f} "
                          "pt apart")  # fmt: skip
        if gateways == 1 and slots > 1 and (slots, 1, load) in by and (1, 1, load) in by:
            d_one = 100 * (median(key, "success_rate") - median((1, 1, load), "success_rate"))
            if d_one < 0:
                misses.append(f"one gateway, {slots} slots, {load}A: {d_one:+.1f} pt against "
                              "1 slot")  # fmt: skip
    print()
    print("\n".join(f"- missed: {m}" for m in misses) or "- every target met")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
