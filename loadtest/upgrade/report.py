"""The rolling upgrade's results: the JSON line, a CSV of every request, the timeline PNG and
the markdown block of docs/results/upgrade/README.md (``<!-- upgrade:KIND:begin -->`` ...)."""

from __future__ import annotations

import csv
import logging
import math
from pathlib import Path
from typing import Any

from pdgate.loadtest.lib.stats import percentile
from pdgate.loadtest.upgrade.run import UpgradeResult

__all__ = ["by_phase", "markdown", "summary_json", "write_csv", "write_plot"]


def by_phase(result: UpgradeResult) -> dict[str, dict[str, Any]]:
    """Per phase: requests issued in it, their TTFT p50/p99 and reconnects; failures that
    happened (ended) in it."""
    out: dict[str, dict[str, Any]] = {
        p.name: {"duration_s": p.end_s - p.start_s, "issued": 0, "completed": 0, "failed": 0,
                 "reconnects": 0, "ttfts": []}
        for p in result.phases
    }  # fmt: skip
    for r in result.records:
        issued = out.setdefault(result.phase_at(r.issued_s), _empty())
        issued["issued"] += 1
        issued["completed"] += r.completed
        issued["reconnects"] += r.reconnects
        if r.ttft_s is not None:
            issued["ttfts"].append(r.ttft_s)
        if r.failed:
            out.setdefault(result.phase_at(r.ended_s), _empty())["failed"] += 1
    for stats in out.values():
        ttfts = stats.pop("ttfts")
        stats["ttft_p50_s"] = percentile(ttfts, 50)
        stats["ttft_p99_s"] = percentile(ttfts, 99)
    return out


def _empty() -> dict[str, Any]:
    return {"duration_s": 0.0, "issued": 0, "completed": 0, "failed": 0, "reconnects": 0,
            "ttfts": []}  # fmt: skip


def _num(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 4)


def summary_json(result: UpgradeResult) -> dict[str, Any]:
    phases = by_phase(result)
    steady = phases.get("steady", {})
    restarted = [p for p in phases if p not in ("steady", "after")]

    def bump(key: str) -> dict[str, float | None]:
        ref = steady.get(key, math.nan)
        return {p: _num(phases[p][key] / ref) if ref else None for p in restarted}

    failures = [r for r in result.records if r.failed]
    return {
        "requests": len(result.records),
        "failed": len(failures),
        "failed_by_phase": {p: s["failed"] for p, s in phases.items()},
        "reconnects": sum(r.reconnects for r in result.records),
        "failures": [
            {
                "issued_s": round(r.issued_s, 3),
                "ended_s": round(r.ended_s, 3),
                "gateway": r.gateway,
                "why": r.why(),
                "events": r.events,
            }
            for r in failures[:20]
        ],
        "phases": {
            p: {k: _num(v) if isinstance(v, float) else v for k, v in s.items()}
            for p, s in phases.items()
        },
        "ttft_bump_p50": bump("ttft_p50_s"),
        "ttft_bump_p99": bump("ttft_p99_s"),
        "restarts": [r.as_dict() for r in result.restarts],
        "cancelled": result.cancelled,
        "gateway_prestop_s": result.plan.gateway_prestop_s,
        "wall_s": round(result.wall_s, 1),
        "load_avg": list(result.load_avg),
    }


def write_csv(result: UpgradeResult, path: Path) -> None:
    fields = ["user", "issued_s", "ended_s", "phase", "gateway", "status", "ttft_s", "events",
              "completed", "reconnects"]  # fmt: skip
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(fields)
        for r in result.records:
            writer.writerow([r.user, round(r.issued_s, 4), round(r.ended_s, 4),
                             result.phase_at(r.issued_s), r.gateway, r.status,
                             "" if r.ttft_s is None else round(r.ttft_s, 4), r.events,
                             int(r.completed), r.reconnects])  # fmt: skip


_ROLE_COLORS = {"prefill": "tab:blue", "decode": "tab:purple", "gateway": "tab:orange"}


def write_plot(result: UpgradeResult, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(12, 6.5), sharex=True, layout="constrained",
        gridspec_kw={"height_ratios": [3, 2]},
    )  # fmt: skip
    for r in result.restarts:
        color = _ROLE_COLORS.get(r.role, "gray")
        for ax in (top, bottom):
            if r.out_of_rotation_s is not None:  # the preStop grace: out of rotation, serving
                ax.axvspan(r.out_of_rotation_s, r.signalled_s, color=color, alpha=0.07, lw=0)
            ax.axvspan(r.signalled_s, r.exited_s, color=color, alpha=0.25, lw=0)
            ax.axvspan(r.exited_s, r.ready_s, color=color, alpha=0.12, lw=0)
        top.annotate(r.old, (r.signalled_s, 1.0), xycoords=("data", "axes fraction"),
                     fontsize=7, rotation=90, va="top", ha="right", color=color)  # fmt: skip
    ok = [r for r in result.records if r.completed and not r.reconnects and r.ttft_s is not None]
    again = [r for r in result.records if r.completed and r.reconnects and r.ttft_s is not None]
    failed = [r for r in result.records if r.failed]
    top.scatter([r.issued_s for r in ok], [r.ttft_s for r in ok], s=6, color="tab:gray",
                label=f"completed ({len(ok)})")  # fmt: skip
    if again:
        top.scatter(
            [r.issued_s for r in again],
            [r.ttft_s for r in again],
            s=14,
            color="tab:orange",
            marker="^",
            label=f"completed after reconnecting to another gateway ({len(again)})",
        )
    if failed:
        top.scatter(
            [r.ended_s for r in failed],
            [r.ttft_s if r.ttft_s is not None else 0.0 for r in failed],
            s=40,
            color="tab:red",
            marker="x",
            label=f"failed, at its end ({len(failed)})",
        )
    top.set_yscale("log")
    top.set_ylabel("TTFT s (by issue time)")
    top.legend(fontsize=8, loc="upper left")
    top.grid(alpha=0.3)
    # Streams open, completions and failures per second.
    end = max([r.ended_s for r in result.records] + [p.end_s for p in result.phases] + [1.0])
    step = 0.5
    ticks = [i * step for i in range(math.ceil(end / step) + 1)]
    opened = [sum(1 for r in result.records if r.issued_s <= t < r.ended_s) for t in ticks]
    done = [0] * len(ticks)
    bad = [0] * len(ticks)
    for rec in result.records:
        i = min(len(ticks) - 1, int(rec.ended_s / step))
        if rec.completed:
            done[i] += 1
        else:
            bad[i] += 1
    bottom.plot(ticks, opened, color="black", lw=1, label="requests open")
    bottom.bar(ticks, [d / step for d in done], width=step, color="tab:green", alpha=0.5,
               align="edge", label="completed per s")  # fmt: skip
    if any(bad):
        bottom.bar(ticks, [b / step for b in bad], width=step, color="tab:red", align="edge",
                   label="failed per s")  # fmt: skip
    for role, color in _ROLE_COLORS.items():
        bottom.axvspan(0, 0, color=color, alpha=0.25, label=f"{role}: SIGTERM -> exit (drain)")
    bottom.set_xlabel("seconds since the load started")
    bottom.set_ylabel("requests")
    bottom.legend(fontsize=7, loc="upper left", ncol=2)
    bottom.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _s(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x:.{digits}f}"


def markdown(result: UpgradeResult, command: str, plot: str | None) -> str:
    plan = result.plan
    phases = by_phase(result)
    total_failed = sum(r.failed for r in result.records)
    prestop = (
        f"out of the load balancer's rotation, {plan.gateway_prestop_s:g} s of preStop grace, "
        "then SIGTERM"
        if plan.gateway_prestop_s > 0
        else "SIGTERM while still in rotation (no preStop)"
    )
    lines = [
        f"Command: `{command}` ({result.wall_s:.0f} s wall clock; load average "
        f"{result.load_avg[0]:.1f} at the start, {result.load_avg[1]:.1f} at the end)\n\n",
        f"Fleet: {plan.gateways} gateways, {plan.prefills} prefills x {plan.prefill_capacity} "
        f"slots, {plan.decodes} decodes x {plan.decode_capacity}, each its own process, "
        f"registry in a private Redis; sim {plan.sim_profile}; shims drain for up to "
        f"{plan.drain_timeout_s:g} s. Load: {plan.users} closed-loop users, prompts of "
        f"{plan.prompt_tokens[0]}-{plan.prompt_tokens[1]} tokens, {plan.max_tokens} tokens "
        f"streamed each, users split across the gateways. Gateways: {prestop}. "
        f"**{total_failed} failed of {len(result.records)} requests**, "
        f"{sum(r.reconnects for r in result.records)} reconnects before a first byte.\n\n",
        "| phase | s | requests issued | failed (ended in it) | reconnects | TTFT p50 / p99 s |\n",
        "|---|---|---|---|---|---|\n",
    ]
    for name, s in phases.items():
        lines.append(
            f"| {name} | {s['duration_s']:.0f} | {s['issued']} | {s['failed']} | "
            f"{s['reconnects']} | {_s(s['ttft_p50_s'])} / {_s(s['ttft_p99_s'])} |\n"
        )
    lines += [
        "\n| restarted | SIGTERM -> exit s | exit code | exit -> new one ready s "
        "| requests held at SIGTERM |\n",
        "|---|---|---|---|---|\n",
    ]
    for r in result.restarts:
        held = "" if r.open_at_signal is None else str(r.open_at_signal)
        lines.append(
            f"| {r.old} -> {r.new} | {r.drain_s:.1f} | {r.exit_code} | {r.start_s:.1f} | {held} |\n"
        )
    failures = [r for r in result.records if r.failed]
    if failures:
        lines.append("\nFailures: " + "; ".join(
            f"{r.why()} (gateway {r.gateway}, ended at {r.ended_s:.1f} s, "
            f"{r.events} events)" for r in failures[:8]
        ) + ("; ..." if len(failures) > 8 else "") + "\n")  # fmt: skip
    if plot:
        lines.append(f"\n![rolling upgrade timeline]({plot})\n")
    return "".join(lines)
