"""``pdgate bench summary fleet-targets``: the multi-slot fleet's targets, checked on a
`pdgate bench scheduling` CSV.

    pdgate bench summary fleet-targets docs/results/fleet/fleet-slots.csv

Series are ``MODE/sK/gN`` (K slots a prefill, N gateways), or ``MODE/gN`` with the slots
given (``--slots K``: a run of one ``--prefill-slots`` value names no slots). Per load and
slot count, against one gateway of the same slots: success (median over seeds) within 2
points, goodput within 5%; per run, the gateways' own success within 3 points of each
other (the worst seed); and one gateway with K slots against one gateway with 1 slot.
Prints one table, then the misses.

A run whose gateways are more than 3 points apart is also tested for chance: the p-value of
a chi-square test of homogeneity of the gateways' successes and failures (the probability
that gateways serving alike would be at least this far apart with these request counts).

Users are pinned to gateways and draw their own prompts, so a gateway can fail more because
its users drew more of a scenario that fails more. Where the CSV has each gateway's
``mix_gateway`` (the success its own scenario mix predicts at the run's success per
scenario), a second table gives, per run with several gateways, the spread of each
gateway's success less that prediction, its chi-square p-value against the prediction, and
where the failures ended (``refused_gateway``, ``late_gateway``).
"""

from __future__ import annotations

import csv
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

__all__ = ["for_the_mix", "homogeneity_p", "table"]


def _chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for a chi-square variable of `dof` degrees of freedom (closed forms)."""
    half = x / 2
    if dof % 2 == 0:
        return math.exp(-half) * sum(half**i / math.factorial(i) for i in range(dof // 2))
    p = math.erfc(math.sqrt(half))
    term, total = math.sqrt(2 * x / math.pi) * math.exp(-half), 0.0
    for i in range(1, (dof + 1) // 2):
        total += term
        term *= x / (2 * i + 1)
    return p + total


@dataclass(frozen=True, slots=True)
class _Gateway:
    """One gateway's columns in a run's row."""

    requests: float  # NaN: a CSV from before the counts were recorded
    success: float
    mix: float | None  # the success its users' scenario mix predicts (None: not recorded)


def _gateways(row: dict[str, str]) -> list[_Gateway]:
    """The run's gateways, by their ``success_gateway``, ``requests_gateway`` and
    ``mix_gateway`` columns, less any that served no request (one gateway's run has none)."""
    out = []
    for key, value in row.items():
        if not key.startswith("success_gateway") or not value:
            continue
        gateway = key.removeprefix("success_gateway")
        requests, mix = row.get("requests_gateway" + gateway), row.get("mix_gateway" + gateway)
        n = float(requests) if requests else math.nan
        if n == 0:
            continue
        out.append(_Gateway(n, float(value), float(mix) if mix else None))
    return out


def _own_spread(row: dict[str, str]) -> float:
    own = [g.success for g in _gateways(row)]
    return max(own) - min(own) if len(own) > 1 else 0.0


def homogeneity_p(row: dict[str, str]) -> float | None:
    """The chi-square p-value that the run's gateways served alike (None: one gateway)."""
    counts = [
        (g.requests * g.success, g.requests * (1 - g.success))
        for g in _gateways(row)
        if not math.isnan(g.requests)
    ]
    if len(counts) < 2:
        return None
    oks, fails = sum(c[0] for c in counts), sum(c[1] for c in counts)
    total = oks + fails
    if not oks or not fails:
        return 1.0
    stat = 0.0
    for ok, fail in counts:
        n = ok + fail
        for seen, column in ((ok, oks), (fail, fails)):
            expected = n * column / total
            stat += (seen - expected) ** 2 / expected
    return _chi2_sf(stat, len(counts) - 1)


def for_the_mix(row: dict[str, str]) -> tuple[float, float] | None:
    """The gateways' spread in points once each gateway's success is taken less what its
    scenario mix predicts, and the chi-square p-value that each gateway's successes are its
    mix's prediction (the binomial variance at the predicted rate, one degree of freedom
    fewer than gateways: the run's own rates make the predictions sum to the successes).
    None: the CSV has no predictions, or one gateway."""
    own: list[float] = []
    stat = 0.0
    for g in _gateways(row):
        if g.mix is None or math.isnan(g.requests):
            continue
        own.append(g.success - g.mix)
        variance = g.requests * g.mix * (1 - g.mix)
        if variance > 0:
            stat += (g.requests * (g.success - g.mix)) ** 2 / variance
    if len(own) < 2:
        return None
    return 100 * (max(own) - min(own)), _chi2_sf(stat, len(own) - 1) if stat else 1.0


def _ends(row: dict[str, str], column: str) -> int:
    return sum(int(float(v)) for k, v in row.items() if k.startswith(column) and v)


def _series(mode: str, slots: int | None) -> tuple[int, int]:
    """Slots and gateways of a series named ``MODE/sK/gN``, or ``MODE/gN`` of `slots`."""
    parts = mode.split("/")
    if len(parts) == 2 and parts[1][:1] == "g" and parts[1][1:].isdigit():
        if slots is None:
            raise ValueError(f"series {mode!r} names no slots: give them (--slots K)")
        return slots, int(parts[1][1:])
    if len(parts) != 3 or not parts[1][1:].isdigit() or not parts[2][1:].isdigit():
        raise ValueError(
            f"series {mode!r} is not MODE/sK/gN: run the bench with --prefill-slots and "
            "--gateways 1,N"
        )
    return int(parts[1][1:]), int(parts[2][1:])


def _mix_table(rows: list[dict[str, str]], slots_given: int | None) -> list[str]:
    lines = []
    for r in sorted(rows, key=lambda r: (r["mode"], float(r["multiple"]), int(r["seed"]))):
        mixed = for_the_mix(r)
        if mixed is None:
            continue
        slots, gateways = _series(r["mode"], slots_given)
        p = homogeneity_p(r)
        lines.append(
            f"| {slots} | {gateways} | {r['multiple']}A | {r['seed']} | "
            f"{100 * _own_spread(r):.1f} pt | {'n/a' if p is None else f'{p:.2f}'} | "
            f"{mixed[0]:.1f} pt | {mixed[1]:.2f} | "
            f"{_ends(r, 'refused_gateway')} / {_ends(r, 'late_gateway')} |"
        )
    if not lines:
        return []
    head = ("| slots | gateways | load | seed | per-gateway spread | p | for its mix | p | "
            "failures refused / late |")  # fmt: skip
    return ["", head, "|---|---|---|---|---|---|---|---|---|", *lines]


def table(path: Path, slots_given: int | None = None) -> str:
    """The markdown table, a blank line, then the misses (or that every target was met).
    `slots_given`: those of series named ``MODE/gN``."""
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["phase"] == "run"]
    by: dict[tuple[int, int, str], list[dict[str, str]]] = defaultdict(list)
    for r in rows:
        by[(*_series(r["mode"], slots_given), r["multiple"])].append(r)
    for slots, _, load in list(by):
        if (slots, 1, load) not in by:
            raise ValueError(
                f"no one-gateway series with {slots} slots at {load}A to compare with: "
                "run the bench with --gateways 1,N"
            )

    def median(key: tuple[int, int, str], column: str) -> float:
        return statistics.median(float(r[column]) for r in by[key])

    def spread(key: tuple[int, int, str]) -> float:
        return max(_own_spread(r) for r in by[key])

    misses = []
    head = ("| slots | gateways | load | success min / med / max | vs 1 gw | goodput med | "
            "vs 1 gw | per-gateway spread (worst seed) |")  # fmt: skip
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for slots, gateways, load in sorted(by, key=lambda k: (k[0], float(k[2]), k[1])):
        key = (slots, gateways, load)
        success = sorted(float(r["success_rate"]) for r in by[key])
        one = (slots, 1, load)
        d_success = 100 * (median(key, "success_rate") - median(one, "success_rate"))
        d_goodput = median(key, "goodput_rps") / median(one, "goodput_rps") - 1
        worst = 100 * spread(key)
        lines.append(
            f"| {slots} | {gateways} | {load}A | {100 * success[0]:.1f} / "
            f"{100 * statistics.median(success):.1f} / {100 * success[-1]:.1f}% | "
            f"{d_success:+.1f} pt | {median(key, 'goodput_rps'):.2f} | {100 * d_goodput:+.1f}% "
            f"| {worst:.1f} pt |"
        )
        if gateways > 1 and (d_success < -2 or d_goodput < -0.05):
            misses.append(f"{slots} slots, {gateways} gateways, {load}A: {d_success:+.1f} pt, "
                          f"{100 * d_goodput:+.1f}% goodput against one gateway")  # fmt: skip
        if worst > 3:
            apart = [
                f"seed {r['seed']}: " + ("p = n/a" if p is None else f"p = {p:.3f}")
                for r in by[key]
                if 100 * _own_spread(r) > 3
                for p in [homogeneity_p(r)]
            ]
            misses.append(f"{slots} slots, {gateways} gateways, {load}A: gateways {worst:.1f} "
                          f"pt apart ({'; '.join(apart)})")  # fmt: skip
        if gateways == 1 and slots > 1 and (slots, 1, load) in by and (1, 1, load) in by:
            d_one = 100 * (median(key, "success_rate") - median((1, 1, load), "success_rate"))
            if d_one < 0:
                misses.append(f"one gateway, {slots} slots, {load}A: {d_one:+.1f} pt against "
                              "1 slot")  # fmt: skip
    verdict = "\n".join(f"- missed: {m}" for m in misses) or "- every target met"
    return "\n".join(lines + _mix_table(rows, slots_given)) + "\n\n" + verdict + "\n"
