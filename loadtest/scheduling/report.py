"""Writing an experiment's results: CSV, a PNG in the style of Fig. 14a, markdown tables,
the one JSON line, and the generated block of docs/results/scheduling/README.md.

The generated block sits between ``<!-- scheduling:KIND:begin -->`` and
``<!-- scheduling:KIND:end -->`` (KIND = quick or full), so the prose around it is kept.
With several seeds, the CSV and the main table have one row per seed, a second table gives
min / median / max over seeds, and the JSON's figures are medians with the spread beside.
With a capacity (capacity.py), each level is also a fraction of it and each goodput too.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from pdgate.loadtest.lib.docs import write_rows
from pdgate.loadtest.lib.stats import Spread
from pdgate.loadtest.scheduling.experiment import Result
from pdgate.loadtest.scheduling.runner import Point

__all__ = [
    "calibration_table",
    "capacity_table",
    "markdown_table",
    "spread_table",
    "summary_json",
    "write_csv",
    "write_plot",
    "write_trace",
]

_LABELS = {
    "baseline": "baseline (local queue + least SSE, no retry)",
    "least_sse": "on-demand forwarding, least SSE (EDF queue)",
    "affinity_sse": "on-demand forwarding, affinity + SSE (EDF queue)",
    "least_sse_fifo": "on-demand forwarding, least SSE (FIFO queue)",
}


_SPREAD = {"success": "success_rate", "goodput": "goodput_rps"}


def _per_gateway(result: Result) -> dict[str, dict[str, list[float]]]:
    """``{series: {"1": [success of gateway 0, 1, ...]}}``, medians over seeds."""
    out: dict[str, dict[str, list[float]]] = {}
    for series, by_k in result.points.items():
        out[series] = {}
        for k, pts in by_k.items():
            gateways = sorted({g for p in pts for g in p.summary.success_by_gateway})
            out[series][k] = [
                Spread.of(p.summary.success_by_gateway.get(g, math.nan) for p in pts).median
                for g in gateways
            ]
    return out


def _per_tenant(result: Result) -> dict[str, dict[str, dict[str, float]]]:
    """``{series: {"1": {tenant: success}}}``, medians over seeds."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for series, by_k in result.points.items():
        out[series] = {}
        for k, pts in by_k.items():
            tenants = sorted({t for p in pts for t in p.summary.success_by_tenant})
            out[series][k] = {
                t: Spread.of(p.summary.success_by_tenant.get(t, math.nan) for p in pts).median
                for t in tenants
            }
    return out


def _goodput_fraction(result: Result) -> dict[str, dict[str, float]]:
    """Median goodput / capacity by series and level (NaN without a capacity)."""
    cap = math.nan if result.capacity is None else result.capacity.rps
    return {
        series: {k: v / cap for k, v in by_k.items()}
        for series, by_k in result.metric("goodput_rps").items()
    }


def _batch_forwarding(values: Sequence[bool]) -> str:
    if not values:
        return "default"
    return "both" if len(values) > 1 else ("on" if values[0] else "off")


def summary_json(result: Result) -> dict[str, Any]:
    """The one-line answer: success, goodput and prefix hit rate by series and load multiple
    (medians over seeds); the prefills' longest KV hold and holds over 5 s (worst seed);
    how the cluster was deployed and loaded; the capacity and each level as a fraction of it;
    and, where they apply, success per gateway and per tenant and the spread over seeds."""
    plan = result.plan
    gateways = max(plan.gateways)
    out: dict[str, Any] = {
        "success": result.metric("success_rate"),
        "goodput": result.metric("goodput_rps"),
        "prefix_hit_rate": result.metric("prefix_hit_rate"),
        "kv_hold_max_s": result.worst("kv_hold_max_s"),
        "kv_hold_over_5s": result.worst("kv_hold_over_5s"),
        "kv_stranded": result.worst("kv_stranded"),
        "deploy": list(plan.deploys) if len(plan.deploys) > 1 else plan.deploys[0],
        "gateways": list(plan.gateways) if len(plan.gateways) > 1 else plan.gateways[0],
        "seeds": list(plan.seeds),
        "base_users": result.base_users,
        "workload": plan.workload,
        "arrivals": plan.arrivals.kind,
        "client": plan.arrivals.client,
        "prefill_slots": list(plan.prefill_slots) or plan.spec.prefill_capacity,
        "batch_forwarding": _batch_forwarding(plan.batch_forwarding),
        "capacity": None if result.capacity is None else result.capacity.as_json(),
        "load_fraction": result.load_fraction(),
        "level_users": {lv.key: lv.users for lv in result.levels},
        "goodput_fraction": _goodput_fraction(result),
        "offered_rps": result.metric("offered_rps"),
        "rejections_per_request": result.metric("prefill_429s_per_request"),
        "retries_per_request": result.metric("retries_per_request"),
        "fleet_calls_per_request": result.metric("fleet_calls_per_request"),
        "fleet_acquire_ms": result.metric("fleet_acquire_ms"),
    }
    if plan.arrivals.open:
        cap = result.capacity
        out["rate_rps"] = {lv.key: lv.rate(cap) if cap else math.nan for lv in result.levels}
        out["client_dropped"] = result.worst("client_dropped")
    if plan.arrivals.client != "instant":
        # Requests tried again after a refusal, and the share served on their first retry.
        out["retried"] = result.metric("retried")
        out["first_retry_success"] = result.metric("first_retry_success")
    if gateways > 1:
        out["success_by_gateway"] = _per_gateway(result)
    if plan.workload_spec.tenants:
        out["success_by_tenant"] = _per_tenant(result)
    if len(plan.seeds) > 1:
        out["spread"] = {
            key: {
                series: {k: spread.as_dict() for k, spread in by_k.items()}
                for series, by_k in result.spread(column).items()
            }
            for key, column in _SPREAD.items()
        }
    return out


def _rows(result: Result) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for point in result.calibration:
        rows.append({"phase": "calibration", "multiple": "", **point.row()})
    for point in result.capacity_sweep:
        rows.append({"phase": "capacity", "multiple": "", **point.row()})
    cap = math.nan if result.capacity is None else result.capacity.rps
    for by_k in result.points.values():
        for k, pts in by_k.items():
            for point in pts:
                row = point.row()
                row["goodput_fraction"] = row["goodput_rps"] / cap
                rows.append({"phase": "run", "multiple": k, **row})
    return rows


def write_csv(result: Result, path: Path) -> None:
    write_rows(path, _rows(result))


def write_trace(result: Result, path: Path) -> None:
    """One JSON line per request of every window, in the order they were issued: its point
    (``series``, ``seed``, ``users``, ``level``) and its outcome (the fields of
    `RequestResult`, with ``success``): the failures of a run, each with where and when."""
    with path.open("wb") as f:
        for series, by_k in result.points.items():
            for key, points in by_k.items():
                for point in points:
                    where = {"series": series, "seed": point.seed, "users": point.users,
                             "level": result.label(key)}  # fmt: skip
                    for r in sorted(point.results, key=lambda r: r.issued_s):
                        line = {**where, **asdict(r), "success": r.success}
                        f.write(orjson.dumps(line) + b"\n")


def write_plot(result: Result, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display; chosen here so importing this module changes nothing
    # Its INFO lines (e.g. about "1A" looking like a time of day) would drown the progress.
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib.pyplot as plt

    panels = (
        ("success_rate", "success rate (TTFT <= deadline, completed)", 100.0, "%"),
        ("goodput_rps", "goodput (successful requests/s)", 1.0, ""),
        ("prefix_hit_rate", "prefix-cache hit rate (tokens)", 100.0, "%"),
    )
    fractions = result.load_fraction()
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), layout="constrained")
    for ax, (metric, ylabel, scale, unit) in zip(axes, panels, strict=True):
        for mode, by_k in result.spread(metric).items():
            ks = list(by_k)
            xs = [_level(result.label(k), fractions.get(k, math.nan)) for k in ks]
            (line,) = ax.plot(
                xs,
                [scale * by_k[k].median for k in ks],
                marker="o",
                label=_LABELS.get(mode, mode),
            )
            if len(result.plan.seeds) > 1:  # the range over seeds around the median
                lows = [scale * by_k[k].min for k in ks]
                highs = [scale * by_k[k].max for k in ks]
                ax.fill_between(xs, lows, highs, color=line.get_color(), alpha=0.15)
        if metric == "goodput_rps" and result.capacity is not None:
            ax.axhline(result.capacity.rps, color="grey", linestyle="--", linewidth=1,
                       label="capacity")  # fmt: skip
        ax.set_ylabel(ylabel + (f" [{unit}]" if unit else ""))
        ax.set_xlabel(
            f"load (A = {result.base_users} closed-loop users"
            + ("; share of capacity" if result.capacity is not None else "")
            + (f"; {result.plan.arrivals.kind} arrivals" if result.plan.arrivals.open else "")
            + ")"
        )
        ax.grid(alpha=0.3)
        if metric == "success_rate":
            ax.set_ylim(0, 102)
        elif unit == "%":
            ax.set_ylim(0, min(102.0, ax.get_ylim()[1] * 1.2))
    axes[0].legend(fontsize=8, loc="lower left")
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _level(label: str, fraction: float) -> str:
    return label if math.isnan(fraction) or "cap" in label else f"{label}\n{fraction:.0%}"


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:.1f}%"


def _s(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.2f}"


def _n(x: float, digits: int = 0) -> str:
    return "n/a" if math.isnan(x) else f"{x:.{digits}f}"


def _ms(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.0f} ms"


@dataclass(frozen=True, slots=True)
class _Columns:
    """Which optional columns the main table has."""

    seeds: bool
    gateways: bool
    tenants: bool
    capacity: float  # NaN: no capacity columns
    open_loop: bool
    retries: bool  # clients that retry a refusal


def markdown_table(result: Result) -> str:
    """One row per point (per seed, with several), every measured column."""
    plan = result.plan
    c = _Columns(
        seeds=len(plan.seeds) > 1,
        gateways=max(plan.gateways) > 1,
        tenants=bool(plan.workload_spec.tenants),
        capacity=math.nan if result.capacity is None else result.capacity.rps,
        open_loop=plan.arrivals.open,
        retries=plan.arrivals.client != "instant",
    )
    has_cap = not math.isnan(c.capacity)
    columns = ["mode", "load", *(["load / capacity"] if has_cap else []),
               *(["seed"] if c.seeds else []), "users",
               *(["rate/s", "offered/s", "dropped"] if c.open_loop else []), "requests",
               "success", *(["retried / ok on 1st retry"] if c.retries else []),
               *(["success per gateway"] if c.gateways else []),
               *(["success per tenant"] if c.tenants else []), "goodput/s",
               *(["goodput / capacity"] if has_cap else []),
               "TTFT p50 / p99 s", "E2E p50 / p99 s", "prefix hit", "prefill 429s",
               "429s/req", "retries/req", "503s", "CPU cluster / box", "loop lag p99",
               "KV hold max s / >5 s / stranded"]  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |\n", "|---" * len(columns) + "|\n"]
    for mode, by_k in result.points.items():
        for k, pts in by_k.items():
            for p in pts:
                lines.append(_table_row(mode, result.label(k), p, c))
    return "".join(lines)


def _table_row(mode: str, load: str, p: Point, c: _Columns) -> str:
    s = p.summary
    h = p.holds
    has_cap = not math.isnan(c.capacity)
    tenants = " / ".join(f"{k} {_pct(v)}" for k, v in s.success_by_tenant.items())
    cells = [mode, load, *([_pct(p.load_fraction)] if has_cap else []),
             *([str(p.seed)] if c.seeds else []), str(p.users),
             *([_s(p.rate_rps), _s(s.offered_rps), str(s.dropped)] if c.open_loop else []),
             str(s.requests), _pct(s.success_rate),
             *([f"{s.retried} / {_pct(s.first_retry_success)}"] if c.retries else []),
             *([" / ".join(_pct(v) for v in s.success_by_gateway.values())] if c.gateways
               else []),
             *([tenants] if c.tenants else []),
             f"{s.goodput_rps:.2f}", *([_pct(s.goodput_rps / c.capacity)] if has_cap else []),
             f"{_s(s.ttft_p50_s)} / {_s(s.ttft_p99_s)}",
             f"{_s(s.e2e_p50_s)} / {_s(s.e2e_p99_s)}", _pct(p.prefix_hit_rate),
             f"{p.rejections_429:.0f}", _s(p.rejections_per_request), _s(p.retries_per_request),
             str(s.status_counts.get(503, 0)), f"{p.cluster_cpu:.2f} / {p.host_cpu:.2f}",
             _ms(p.loop_lag.get("lag_p99_ms", math.nan)),
             f"{_s(h.max_s)} / {_n(h.over_5s)} / {_n(h.stranded)}"]  # fmt: skip
    return "| " + " | ".join(cells) + " |\n"


def spread_table(result: Result) -> str:
    """Min / median / max over seeds of success and goodput; empty with one seed."""
    if len(result.plan.seeds) < 2:
        return ""
    success, goodput = result.spread("success_rate"), result.spread("goodput_rps")
    hold = result.spread("kv_hold_max_s")
    lines = [
        "| mode | load | seeds | success min / median / max | goodput/s min / median / max "
        "| KV hold max s (worst) |\n",
        "|---|---|---|---|---|---|\n",
    ]
    for mode, by_k in success.items():
        for k, sp in by_k.items():
            g = goodput[mode][k]
            lines.append(
                f"| {mode} | {result.label(k)} | {sp.n} | {_pct(sp.min)} / {_pct(sp.median)} / "
                f"{_pct(sp.max)} | {g.min:.2f} / {g.median:.2f} / {g.max:.2f} | "
                f"{_s(hold[mode][k].max)} |\n"
            )
    return "".join(lines)


def calibration_table(points: Sequence[Point], target: float) -> str:
    if not points:
        return ""
    lines = ["| baseline users | requests | success | goodput/s | TTFT p99 s | meets target |\n"]
    lines.append("|---|---|---|---|---|---|\n")
    for p in points:
        s = p.summary
        ok = "yes" if s.success_rate >= target else "no"
        lines.append(
            f"| {p.users} | {s.requests} | {_pct(s.success_rate)} | {s.goodput_rps:.2f} | "
            f"{_s(s.ttft_p99_s)} | {ok} |\n"
        )
    return "".join(lines)


def capacity_table(result: Result) -> str:
    """The capacity sweep, or where a fixed capacity came from; empty without one."""
    cap = result.capacity
    if cap is None:
        return ""
    if not result.capacity_sweep:
        return (
            f"{cap.rps:.2f} successful req/s, one unimpeded user offering {cap.user_rps:.3f} "
            "req/s: given, not measured by this run.\n"
        )
    lines = [
        f"| {cap.mode} users | requests | success | goodput/s | goodput/s per user | "
        "TTFT p99 s |\n",
        "|---|---|---|---|---|---|\n",
    ]
    for p in result.capacity_sweep:
        s = p.summary
        lines.append(
            f"| {p.users} | {s.requests} | {_pct(s.success_rate)} | {s.goodput_rps:.2f} | "
            f"{s.goodput_rps / p.users:.3f} | {_s(s.ttft_p99_s)} |\n"
        )
    lines.append(
        f"\nCapacity = {cap.rps:.2f} successful req/s (at {cap.users} users); one unimpeded "
        f"user offers {cap.user_rps:.3f} req/s"
        + ("" if cap.plateau else "; goodput still rose at the sweep's end: it may be higher")
        + ".\n"
    )
    return "".join(lines)
