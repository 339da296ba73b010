"""The soak's outputs: the one JSON line (the result as is), a markdown block for
docs/results/soak/README.md and a PNG of RSS over time."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

__all__ = ["markdown", "write_plot"]


def _mib(kib: float) -> str:
    return f"{kib / 1024:.1f}"


def _signed(x: float, digits: int = 1) -> str:
    return "n/a" if math.isnan(x) else f"{x:+.{digits}f}"


def markdown(result: dict[str, Any], command: str, plot: str | None) -> str:
    plan = result["plan"]
    success = result["success_rate"]
    rows = [
        "| policy | requests (after warm-up) | success | RSS start / after warm-up / end / max "
        "(MiB) | growth after warm-up | trend (fit) | per 1k requests |",
        "|---|---|---|---|---|---|---|",
        f"| {result['policy']} | {result['requests']} ({result['requests_after_warmup']}) | "
        + ("n/a" if math.isnan(success) else f"{100 * success:.1f}%")
        + f" | {_mib(result['rss_start_kib'])} / {_mib(result['rss_warm_kib'])} / "
        f"{_mib(result['rss_end_kib'])} / {_mib(result['rss_max_kib'])} | "
        f"{_signed(result['growth_kib'] / 1024, 2)} MiB ({_signed(result['growth_pct'])}%) | "
        f"{_signed(result['growth_kib_per_min'])} KiB/min | "
        f"{_signed(result['growth_kib_per_1k_requests'])} KiB |",
    ]
    return (
        f"Command: `{command}` ({result['wall_s']:.0f} s wall clock)\n\n"
        f"One `pdgate gateway` (prefill_policy={plan['policy']}, every other setting default), "
        f"{plan['prefills']} prefill(s) x {plan['prefill_capacity']} slot(s) and "
        f"{plan['decodes']} decode(s) (sim {plan['sim_profile']}), each its own process, "
        f"registry in a private Redis. {plan['users']} closed-loop users with the scheduling "
        f"workload (a unique tag in every prompt) for {plan['duration_s']:g} s; the gateway's "
        f"VmRSS every {plan['sample_s']:g} s; warm-up {plan['warmup_s']:g} s.\n\n"
        + "\n".join(rows)
        + "\n"
        + (f"\n![RSS of the gateway over the soak]({plot})\n" if plot else "")
    )


def write_plot(result: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display; chosen here so importing this module changes nothing
    # Its INFO lines (e.g. about "1A" looking like a time of day) would drown the progress.
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib.pyplot as plt

    samples = result["samples"]
    fig, ax = plt.subplots(figsize=(7, 3.5), layout="constrained")
    ax.plot([s[0] for s in samples], [s[1] / 1024 for s in samples], marker=".", lw=1)
    ax.axvline(result["warmup_s"], color="grey", ls="--", lw=1, label="end of warm-up")
    ax.set_xlabel("seconds")
    ax.set_ylabel("gateway RSS [MiB]")
    ax.set_ylim(0, max(s[1] for s in samples) / 1024 * 1.15)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
