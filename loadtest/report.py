"""Writing an experiment's results: CSV, a PNG in the style of Fig. 14a, a markdown table,
and the generated block of docs/scheduling.md.

The generated block sits between ``<!-- scheduling:KIND:begin -->`` and
``<!-- scheduling:KIND:end -->`` (KIND = quick or full), so the prose around it is kept.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.experiment import Result
from loadtest.runner import Point

__all__ = ["markdown_table", "summary_json", "update_doc", "write_csv", "write_plot"]

_LABELS = {
    "baseline": "baseline (local queue + least SSE, no retry)",
    "least_sse": "on-demand forwarding, least SSE (EDF queue)",
    "affinity_sse": "on-demand forwarding, affinity + SSE (EDF queue)",
    "least_sse_fifo": "on-demand forwarding, least SSE (FIFO queue)",
}


def summary_json(result: Result) -> dict[str, Any]:
    """The one-line answer: success, goodput and prefix hit rate by mode and load multiple."""
    return {
        "success": result.metric("success_rate"),
        "goodput": result.metric("goodput_rps"),
        "prefix_hit_rate": result.metric("prefix_hit_rate"),
    }


def _rows(result: Result) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for point in result.calibration:
        rows.append({"phase": "calibration", "multiple": "", **point.row()})
    for by_k in result.points.values():
        for k, point in sorted(by_k.items()):
            rows.append({"phase": "run", "multiple": k, **point.row()})
    return rows


def write_csv(result: Result, path: Path) -> None:
    rows = _rows(result)
    fields: list[str] = []
    for row in rows:
        fields.extend(k for k in row if k not in fields)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _fmt_csv(v) for k, v in row.items()})


def _fmt_csv(value: Any) -> Any:
    return round(value, 5) if isinstance(value, float) and not math.isnan(value) else value


def write_plot(result: Result, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display; chosen here so importing this module changes nothing
    import matplotlib.pyplot as plt

    panels = (
        ("success_rate", "success rate (TTFT <= deadline, completed)", 100.0, "%"),
        ("goodput_rps", "goodput (successful requests/s)", 1.0, ""),
        ("prefix_hit_rate", "prefix-cache hit rate (tokens)", 100.0, "%"),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), layout="constrained")
    for ax, (metric, ylabel, scale, unit) in zip(axes, panels, strict=True):
        for mode, by_k in result.points.items():
            ks = sorted(by_k)
            ax.plot(
                [f"{k}A" for k in ks],
                [scale * float(by_k[k].row()[metric]) for k in ks],
                marker="o",
                label=_LABELS.get(mode, mode),
            )
        ax.set_ylabel(ylabel + (f" [{unit}]" if unit else ""))
        ax.set_xlabel(f"load (A = {result.base_users} closed-loop users)")
        ax.grid(alpha=0.3)
        if metric == "success_rate":
            ax.set_ylim(0, 102)
        elif unit == "%":
            ax.set_ylim(0, min(102.0, ax.get_ylim()[1] * 1.2))
    axes[0].legend(fontsize=8, loc="lower left")
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:.1f}%"


def _s(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.2f}"


def markdown_table(result: Result) -> str:
    head = (
        "| mode | load | users | requests | success | goodput/s | TTFT p50 / p99 s | "
        "E2E p50 / p99 s | prefix hit | prefill 429s | retries/req | 503s | "
        "CPU cluster / box | loop lag p99 |\n" + "|---" * 14 + "|\n"
    )
    lines = [head]
    for mode, by_k in result.points.items():
        for k, p in sorted(by_k.items()):
            lines.append(_table_row(mode, f"{k}A", p))
    return "".join(lines)


def _table_row(mode: str, load: str, p: Point) -> str:
    s = p.summary
    return (
        f"| {mode} | {load} | {p.users} | {s.requests} | {_pct(s.success_rate)} | "
        f"{s.goodput_rps:.2f} | {_s(s.ttft_p50_s)} / {_s(s.ttft_p99_s)} | "
        f"{_s(s.e2e_p50_s)} / {_s(s.e2e_p99_s)} | {_pct(p.prefix_hit_rate)} | "
        f"{p.rejections_429:.0f} | {p.retries_per_request:.2f} | {s.status_counts.get(503, 0)} | "
        f"{p.cluster_cpu:.2f} / {p.host_cpu:.2f} | "
        f"{p.loop_lag.get('lag_p99_ms', math.nan):.0f} ms |\n"
    )


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


def update_doc(doc: Path, kind: str, block: str) -> bool:
    """Replace the generated block `kind` of `doc`; False when the markers are missing."""
    begin, end = f"<!-- scheduling:{kind}:begin -->", f"<!-- scheduling:{kind}:end -->"
    text = doc.read_text()
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        return False
    doc.write_text(text[: start + len(begin)] + "\n" + block.rstrip("\n") + "\n" + text[stop:])
    return True
