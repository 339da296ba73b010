"""``pdgate bench summary policies``: the policies side by side from `pdgate bench scheduling`
CSVs: per series (MODE/gN) and load, prefix hit rate, goodput and TTFT p99 as min / median /
max over seeds.

    pdgate bench summary policies docs/results/kv-events/kv-shared.csv [more.csv]
"""

from __future__ import annotations

import csv
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

__all__ = ["table"]


def _spread(values: list[float], fmt: str) -> str:
    return " / ".join(fmt.format(v) for v in (min(values), statistics.median(values), max(values)))


def table(paths: Sequence[Path]) -> str:
    """The markdown table of the runs' rows (phase ``run``) of every CSV in `paths`."""
    by: dict[tuple[str, str], list[dict[str, str]]] = defaultdict(list)
    for path in paths:
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                if r["phase"] == "run":
                    by[(r["multiple"], r["mode"])].append(r)
    lines = [
        "| load | series | seeds | prefix hit % | goodput/s | TTFT p99 s |",
        "|---|---|---|---|---|---|",
    ]
    for (load, mode), rows in sorted(by.items()):
        hit = [100 * float(r["prefix_hit_rate"]) for r in rows]
        goodput = [float(r["goodput_rps"]) for r in rows]
        p99 = [float(r["ttft_p99_s"]) for r in rows]
        lines.append(
            f"| {load} | {mode} | {len(rows)} | {_spread(hit, '{:.1f}')} | "
            f"{_spread(goodput, '{:.2f}')} | {_spread(p99, '{:.2f}')} |"
        )
    return "\n".join(lines) + "\n"
