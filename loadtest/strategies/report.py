"""The strategies bench's outputs: the JSON line, the CSV of every point, the markdown
tables and the plot.

Figures per load are the median over seeds (with the spread, min / median / max, of SLO
attainment and goodput per GPU). A setting is a workload on an interconnect; aggregated and
partial move no KV, so their one run stands in every interconnect's setting.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pdgate.loadtest.lib.docs import write_rows
from pdgate.loadtest.lib.stats import Spread
from pdgate.loadtest.strategies.experiment import Outcome, Result

__all__ = ["markdown", "setting_key", "summary_json", "sustained", "write_csv", "write_plot"]

# Per-point figures of the JSON and the tables: name -> how a point gives it (per GPU where
# it says so).
_FIGURES = (
    "slo_attainment",
    "goodput_per_gpu",
    "ttft_attainment",
    "tpot_attainment",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "tpot_p99_s",
    "phase_switch_wait_s",
)


def setting_key(workload: str, kv_gbps: float) -> str:
    return f"{workload}@{kv_gbps:g}Gb/s"


def _figures(outcome: Outcome, gpus: int) -> dict[str, dict[str, list[float]]]:
    """figure -> load key -> one value per seed."""
    out: dict[str, dict[str, list[float]]] = {name: {} for name in _FIGURES}
    for key, points in outcome.points.items():
        for p in points:
            s = p.summary
            values = {
                "slo_attainment": s.success_rate,
                "goodput_per_gpu": s.goodput_rps / gpus,
                "ttft_attainment": s.ttft_attainment,
                "tpot_attainment": s.tpot_attainment,
                "ttft_p50_s": s.ttft_p50_s,
                "ttft_p99_s": s.ttft_p99_s,
                "tpot_p50_s": s.tpot_p50_s,
                "tpot_p99_s": s.tpot_p99_s,
                "phase_switch_wait_s": p.phase_switch_wait_s,
            }
            for name, value in values.items():
                out[name].setdefault(key, []).append(value)
    return out


def _nan_none(x: float) -> float | None:
    return None if math.isnan(x) else x


def _entry(outcome: Outcome, gpus: int) -> dict[str, Any]:
    figures = _figures(outcome, gpus)
    spreads = {
        name: {k: Spread.of(v) for k, v in by_load.items()} for name, by_load in figures.items()
    }
    cap = outcome.capacity
    return {
        "instances": outcome.shape.instances,
        "capacity_rps": cap.rps,
        "capacity_per_gpu": cap.rps / gpus,
        "capacity_found": cap.found,
        "capacity_probes": [[rate, attained] for rate, attained in cap.probes],
        "rate_rps": {k: _nan_none(pts[0].rate_rps) for k, pts in outcome.points.items()},
        **{
            name: {k: _nan_none(s.median) for k, s in by_load.items()}
            for name, by_load in spreads.items()
        },
        "spread": {
            name: {k: s.as_dict() for k, s in spreads[name].items()}
            for name in ("slo_attainment", "goodput_per_gpu")
        },
    }


def sustained(entry: dict[str, Any], target: float) -> tuple[str | None, float]:
    """The load, and its goodput per GPU, with the most goodput among those whose median SLO
    attainment meets `target`: what the strategy sustains within its SLOs on the run's grid
    (None, 0.0 where no load does). Loads are shares of each strategy's own capacity, so
    this is what compares strategies in absolute terms."""
    best: tuple[str | None, float] = (None, 0.0)
    for key, attained in entry["slo_attainment"].items():
        goodput = entry["goodput_per_gpu"].get(key)
        ok = attained is not None and goodput is not None and attained >= target
        if ok and goodput > best[1]:
            best = (key, goodput)
    return best


def _settings(result: Result) -> dict[str, dict[str, Outcome]]:
    """setting key -> strategy -> its outcome, in the plan's order."""
    plan = result.plan
    out: dict[str, dict[str, Outcome]] = {}
    for workload in plan.workloads:
        for gbps in plan.interconnects_gbps:
            row = out.setdefault(setting_key(workload, gbps), {})
            for o in result.outcomes:
                s = o.shape
                if s.workload == workload and s.kv_gbps in (None, gbps):
                    row[s.strategy] = o
    return out


def summary_json(result: Result) -> dict[str, Any]:
    """``strategies``: the first setting's (the first workload on the first interconnect),
    each strategy with ``slo_attainment`` and ``goodput_per_gpu`` keyed by load;
    ``settings``: the same for every setting."""
    plan = result.plan
    settings = {
        key: {name: _entry(o, plan.gpus) for name, o in row.items()}
        for key, row in _settings(result).items()
    }
    for row in settings.values():
        for entry in row.values():
            load, goodput = sustained(entry, plan.attainment_target)
            entry["sustained"] = {"load": load, "goodput_per_gpu": goodput}
    return {
        "strategies": next(iter(settings.values())),
        "settings": settings,
        "gpus": plan.gpus,
        "loads": [f"{f:g}" for f in sorted(plan.loads)],
        "seeds": list(plan.seeds),
        "tpot_slo_s": plan.tpot_slo_s,
        "sim_profile": plan.sim_profile,
        "slots": plan.slots,
        "prefill_slots": plan.prefill_slots,
        "wall_s": round(result.wall_s, 1),
    }


def _rows(result: Result) -> list[dict[str, Any]]:
    rows = []
    for o in result.outcomes:
        s = o.shape
        for phase, points in (("capacity", o.search), *((k, v) for k, v in o.points.items())):
            for p in points:
                rows.append({
                    "workload": s.workload,
                    "strategy": s.strategy,
                    "instances": s.instances,
                    "kv_gbps": "" if s.kv_gbps is None else s.kv_gbps,
                    "load": phase,
                    "capacity_rps": o.capacity.rps,
                    **p.row(),
                })  # fmt: skip
    return rows


def write_csv(result: Result, path: Path) -> None:
    write_rows(path, _rows(result))


def _pct(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{100 * x:.1f}%"


def _ms(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{1000 * x:.0f}"


def markdown(result: Result) -> str:
    """Per setting: capacity, sustained goodput (`sustained`), SLO attainment (min / median /
    max) and goodput per GPU by load; then the latencies at each load (medians over seeds)."""
    plan = result.plan
    loads = [f"{f:g}" for f in sorted(plan.loads)]
    parts: list[str] = []
    for key, row in _settings(result).items():
        entries = {name: _entry(o, plan.gpus) for name, o in row.items()}
        head = (
            "| strategy | instances | capacity, req/s per GPU | sustained goodput per GPU | "
            + " | ".join(f"{k}x: SLO met, min / med / max | {k}x: goodput per GPU" for k in loads)
        )
        lines = [f"**{key}**", "", head + " |", "|---" * (4 + 2 * len(loads)) + "|"]
        for name, e in entries.items():
            load, goodput = sustained(e, plan.attainment_target)
            cells = [name, e["instances"], f"{e['capacity_per_gpu']:.2f}",
                     "-" if load is None else f"{goodput:.2f} (at {load}x)"]  # fmt: skip
            for k in loads:
                sp = e["spread"]["slo_attainment"].get(k)
                cells.append(
                    "-" if sp is None else " / ".join(_pct(sp[q]) for q in ("min", "median", "max"))
                )
                g = e["goodput_per_gpu"].get(k)
                cells.append("-" if g is None else f"{g:.2f}")
            lines.append("| " + " | ".join(cells) + " |")
        lines += [
            "",
            "| strategy | load | TTFT met | TPOT met | TTFT p50 / p99, ms | TPOT p50 / p99, ms "
            "| phase-switch wait, ms |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, e in entries.items():
            for k in loads:
                lines.append(
                    f"| {name} | {k}x | {_pct(e['ttft_attainment'].get(k))} | "
                    f"{_pct(e['tpot_attainment'].get(k))} | "
                    f"{_ms(e['ttft_p50_s'].get(k))} / {_ms(e['ttft_p99_s'].get(k))} | "
                    f"{_ms(e['tpot_p50_s'].get(k))} / {_ms(e['tpot_p99_s'].get(k))} | "
                    f"{_ms(e['phase_switch_wait_s'].get(k))} |"
                )
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)


def write_plot(result: Result, path: Path, title: str) -> None:
    """SLO attainment against load, one panel per setting, a line per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = _settings(result)
    loads = sorted(result.plan.loads)
    fig, axes = plt.subplots(
        1, len(settings), figsize=(4.5 * len(settings), 3.6), squeeze=False, sharey=True
    )
    for ax, (key, row) in zip(axes[0], settings.items(), strict=True):
        for name, o in row.items():
            med = [
                Spread.of(p.summary.success_rate for p in o.points.get(f"{f:g}", [])).median
                for f in loads
            ]
            label = f"{name} ({o.shape.instances})"
            ax.plot(loads, [100 * m for m in med], marker="o", label=label)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("load, x the strategy's capacity")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("SLO attainment, % (median over seeds)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
