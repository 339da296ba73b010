"""Writing the ratio experiment's results: the JSON line, CSV, PNG and the markdown block of
docs/results/ratio/README.md (between ``<!-- ratio:KIND:begin -->`` and
``<!-- ratio:KIND:end -->``).

The comparison is per workload and start split: the start's goodput, the advice it led to,
and the goodput at the advised split in the same seed; over seeds, min / median / max.
"""

from __future__ import annotations

import csv
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdgate.loadtest.lib.stats import Spread
from pdgate.loadtest.ratio.experiment import Result, Run, Split, split_label
from pdgate.loadtest.ratio.workload import Workload, model_ratio, split_of

__all__ = [
    "PAPER_CLAIM",
    "comparisons",
    "markdown",
    "summary_json",
    "write_csv",
    "write_plot",
]

PAPER_CLAIM = (
    "P/D-Serve (sec. 4, Fig. 13a): at the optimum P/D ratio of eq. 1, throughput beats the other "
    "ratios by at least 60% (abstract: +60% E2E throughput)"
)

# What the gateway saw (instance counts) and its eq. 1 inputs and outputs.
_ADVICE_COLUMNS = ("prefills", "decodes", "ratio", "bottleneck", "t_prefill_s", "t_decode_s",
                   "xi_s", "tokens", "tpot_s", "prefill_capacity_rps", "decode_capacity_rps",
                   "demand_rps", "desired_prefills", "desired_decodes", "samples")  # fmt: skip


def comparisons(result: Result, workload: Workload) -> dict[str, dict[str, Any]]:
    """Per start split of `workload`: the start runs, their advised splits and the runs at
    those splits (same seed), and the gain (advised goodput / start goodput - 1)."""
    out: dict[str, dict[str, Any]] = {}
    for start in result.plan.starts_of(workload):
        starts: list[Run] = []
        followed: list[Run] = []
        gains: list[float] = []
        for seed in result.plan.seeds:
            run = result.of(workload.name, seed, start)
            if run is None:
                continue
            starts.append(run)
            after = result.of(workload.name, seed, run.advised) if run.advised else None
            if after is not None:
                followed.append(after)
                before = run.point.summary.goodput_rps
                gains.append(after.point.summary.goodput_rps / before - 1 if before else math.inf)
        out[split_label(start)] = {"starts": starts, "followed": followed, "gains": gains}
    return out


def _spread(values: list[float]) -> dict[str, float]:
    return Spread.of(values).as_dict()


def _goodput(runs: list[Run]) -> list[float]:
    return [r.point.summary.goodput_rps for r in runs]


def _success(runs: list[Run]) -> list[float]:
    return [r.point.summary.success_rate for r in runs]


def _ratios(runs: list[Run]) -> list[float]:
    return [float(r.advice["ratio"]) for r in runs if r.advice and r.advice.get("ratio")]


def _by_split(result: Result, workload: str) -> dict[Split, list[Run]]:
    out: dict[Split, list[Run]] = {}
    for run in result.runs:
        if run.workload == workload:
            out.setdefault(run.split, []).append(run)
    return dict(sorted(out.items()))


def summary_json(result: Result) -> dict[str, Any]:
    plan = result.plan
    workloads: dict[str, Any] = {}
    for w in plan.workloads:
        model = model_ratio(w, plan.shape)
        starts = {}
        for label, c in comparisons(result, w).items():
            starts[label] = {
                "goodput": _spread(_goodput(c["starts"])),
                "success": _spread(_success(c["starts"])),
                "advice_ratio": _spread(_ratios(c["starts"])),
                "advised": [split_label(r.advised) if r.advised else None for r in c["starts"]],
                "advised_goodput": _spread(_goodput(c["followed"])),
                "advised_success": _spread(_success(c["followed"])),
                "gain": _spread(c["gains"]),
            }
        workloads[w.name] = {
            "model_ratio": model["ratio"],
            "model_split": split_label(split_of(model["ratio"], plan.shape.instances)),
            "starts": starts,
            "splits": {
                split_label(s): {
                    "goodput": _spread(_goodput(runs)),
                    "advice_ratio": _spread(_ratios(runs)),
                }
                for s, runs in _by_split(result, w.name).items()
            },
        }
    return {
        "workloads": workloads,
        "instances": plan.shape.instances,
        "seeds": list(plan.seeds),
        "wall_s": round(result.wall_s, 1),
        "load_avg": list(result.load_avg),
        "paper": PAPER_CLAIM,
    }


def _row(run: Run) -> dict[str, Any]:
    s = run.point.summary
    advice = run.advice or {}
    return {
        "workload": run.workload,
        "seed": run.seed,
        "kind": run.kind,
        "split": run.label,
        "prefills": run.split[0],
        "decodes": run.split[1],
        "users": run.point.users,
        "requests": s.requests,
        **s.headline(),
        "gateway_503s": s.status_counts.get(503, 0),
        "host_cpu_cores": run.point.host_cpu,
        "cluster_cpu_cores": run.point.cluster_cpu,
        "load_avg_1m": run.load_avg,
        "kv_hold_max_s": run.point.holds.max_s,  # the longest a prefill slot waited for a decode
        "advised_split": split_label(run.advised) if run.advised else "",
        **{f"advice_{k}": advice.get(k) for k in _ADVICE_COLUMNS},
    }


def write_csv(result: Result, path: Path) -> None:
    rows = [_row(r) for r in result.runs]
    if not rows:
        path.write_text("")
        return
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            writer.writerow(
                {k: round(v, 5) if isinstance(v, float) and math.isfinite(v) else v
                 for k, v in row.items()}
            )  # fmt: skip


def write_plot(result: Result, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib.pyplot as plt

    plan = result.plan
    n = plan.shape.instances
    workloads = plan.workloads
    fig, axes = plt.subplots(
        1, len(workloads), figsize=(6 * len(workloads), 4.2), layout="constrained", squeeze=False
    )
    colors = {"start": "tab:gray", "advised": "tab:green", "sweep": "tab:blue"}
    for ax, w in zip(axes[0], workloads, strict=True):
        model = model_ratio(w, plan.shape)
        xs = list(range(1, n))
        # Eq. 1's capacity from the sim profile: the bottleneck side's requests/s.
        ax.plot(
            xs,
            [min(p * model["per_prefill_rps"], (n - p) * model["per_decode_rps"]) for p in xs],
            ls="--", color="black", lw=1, label="capacity from the sim profile (eq. 1)",
        )  # fmt: skip
        by_split = _by_split(result, w.name)
        ax.plot(
            [s[0] for s in by_split],
            [Spread.of(_goodput(runs)).median for runs in by_split.values()],
            color="tab:green", lw=1.5, alpha=0.6,
        )  # fmt: skip
        seen: set[str] = set()
        for runs in by_split.values():
            for run in runs:
                kind = run.kind
                ax.scatter(
                    run.split[0], run.point.summary.goodput_rps, color=colors.get(kind, "C3"),
                    s=36, zorder=3, label=None if kind in seen else f"measured: {kind} split",
                )  # fmt: skip
                seen.add(kind)
        ratios = _ratios([r for runs in by_split.values() for r in runs if r.kind == "start"])
        if ratios:
            advised_p = n * Spread.of(ratios).median / (1 + Spread.of(ratios).median)
            ax.axvline(advised_p, color="tab:green", ls=":", lw=1.2,
                       label=f"advice (median): n_p = {advised_p:.2f} of {n}")  # fmt: skip
        ax.set_xticks(xs, [f"{p}:{n - p}" for p in xs])
        ax.set_xlabel("prefills : decodes")
        ax.set_ylabel("goodput (requests/s meeting the TTFT deadline)")
        s = w.scenario
        ax.set_title(
            f"{w.name}: prompt {s.body_min}-{s.body_max} tok, output {s.max_tokens} tok, "
            f"{plan.users(w)} users",
            fontsize=9,
        )
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7, loc="best")
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _f(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:.0f}%"


def _range(values: list[float], fmt: Callable[[float], str] = _f) -> str:
    sp = Spread.of(values)
    if sp.n == 0:
        return "n/a"
    if sp.n == 1:
        return fmt(sp.median)
    return f"{fmt(sp.min)} / {fmt(sp.median)} / {fmt(sp.max)}"


def _gain(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:+.0f}%"


def markdown(result: Result, command: str, plot: str | None, describe: str) -> str:
    plan = result.plan
    seeds = len(plan.seeds)
    spread = " (min / median / max over seeds)" if seeds > 1 else ""
    lines = [
        f"Command: `{command}` ({result.wall_s:.0f} s wall clock; load average "
        f"{result.load_avg[0]:.1f} at the start, {result.load_avg[1]:.1f} at the end, "
        f"on a box with {_cores()} cores shared with other work)\n\n",
        f"Cluster: {describe}.\n\n",
        f"| workload | start | goodput/s at start{spread} | success | advised n_p/n_d "
        "(eq. 1 from the sim profile) | advised split | goodput/s advised | success "
        "| gain |\n",
        "|---|---|---|---|---|---|---|---|---|\n",
    ]
    for w in plan.workloads:
        model = model_ratio(w, plan.shape)
        for label, c in comparisons(result, w).items():
            advised = sorted({split_label(r.advised) for r in c["starts"] if r.advised})
            lines.append(
                f"| {w.name} | {label} | {_range(_goodput(c['starts']))} | "
                f"{_range(_success(c['starts']), _pct)} | "
                f"{_range(_ratios(c['starts']), lambda x: _f(x, 3))} "
                f"({model['ratio']:.3f}) | {', '.join(advised) or 'none'} | "
                f"{_range(_goodput(c['followed']))} | {_range(_success(c['followed']), _pct)} | "
                f"{_range(c['gains'], _gain)} |\n"
            )
    lines += [
        "\nEvery run (T_p: prefill call; T_d = xi + G x TPOT: decode accepted to last token; "
        "the advice read at the end of the window):\n\n",
        "| workload | seed | run | split | requests | success | goodput/s | TTFT p50 / p99 s "
        "| 503s | T_p s | xi s | G | TPOT ms | T_d s | bottleneck | advice n_p/n_d | "
        "-> split | CPU box | load |\n",
        "|---" * 19 + "|\n",
    ]
    for run in result.runs:
        s = run.point.summary
        a = run.advice or {}
        tpot = a.get("tpot_s")
        lines.append(
            f"| {run.workload} | {run.seed} | {run.kind} | {run.label} | {s.requests} | "
            f"{_pct(s.success_rate)} | {s.goodput_rps:.2f} | {_f(s.ttft_p50_s)} / "
            f"{_f(s.ttft_p99_s)} | {s.status_counts.get(503, 0)} | {_f(a.get('t_prefill_s'))} | "
            f"{_f(a.get('xi_s'), 3)} | {_f(a.get('tokens'), 0)} | "
            f"{_f(None if tpot is None else 1000 * tpot, 1)} | {_f(a.get('t_decode_s'))} | "
            f"{a.get('bottleneck', 'n/a')} | {_f(a.get('ratio'), 3)} | "
            f"{split_label(run.advised) if run.advised else 'n/a'} | "
            f"{run.point.host_cpu:.2f} | {run.load_avg:.1f} |\n"
        )
    if plot:
        lines.append(f"\n![ratio benchmark]({plot})\n")
    return "".join(lines)


def _cores() -> int:
    import os

    return os.cpu_count() or 1
