"""docs/performance.md from a ``pdgate bench gateway`` result: one table, the command, the load."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["json_line", "markdown"]

_ROWS = (
    ("TTFT p50, c=1 (ms)", "ttft_p50_ms", True),
    ("TTFT p99, c=1 (ms)", "ttft_p99_ms", True),
    ("added TTFT p50 vs direct (ms)", "added_ttft_p50_ms", True),
    ("added TTFT p99 vs direct (ms)", "added_ttft_p99_ms", True),
    ("requests/s, c=32", "rps_c32", False),
    ("requests/s, c=256", "rps_c256", False),
    ("SSE events/s, c=32", "events_per_s_c32", False),
    ("SSE events/s, c=256", "events_per_s_c256", False),
    ("front CPU s per 1,000 requests (c=32)", "cpu_s_per_1k", True),
)
_FRONTS = ("pdgate", "vllm_router", "direct")


def json_line(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's summary line, in its key order, then the rest."""
    keys = ["added_ttft_p50_ms", "rps_c32", "events_per_s_c256", "kib_per_idle_stream",
            "cpu_s_per_1k"]  # fmt: skip
    return {**{k: result[k] for k in keys if k in result}, **result}


def _cell(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:,.1f}" if abs(value) >= 10 else f"{value:.2f}"


def markdown(result: dict[str, Any], command: str, load: str) -> str:
    lines = [
        "| metric | pdgate | vllm-router | direct (floor) | pdgate / vllm-router |",
        "|---|---|---|---|---|",
    ]
    for label, key, lower_better in _ROWS:
        row = result.get(key, {})
        pd, vr = row.get("pdgate"), row.get("vllm_router")
        # A ratio of differences near zero (or of opposite signs) means nothing: left out.
        ratio = pd / vr if pd is not None and vr is not None and pd > 0 and vr > 0 else None
        cells = " | ".join(_cell(row.get(f)) for f in _FRONTS)
        hint = " (lower is better)" if lower_better else ""
        lines.append(f"| {label}{hint} | {cells} | {_cell(ratio)} |")
    kib = result.get("kib_per_idle_stream_by_front") or {
        "pdgate": result.get("kib_per_idle_stream")
    }
    pd, vr = kib.get("pdgate"), kib.get("vllm_router")
    ratio = pd / vr if pd is not None and vr is not None and pd > 0 and vr > 0 else None
    lines.append(
        f"| memory per open idle stream (KiB), {result.get('idle_streams')} streams "
        f"(lower is better) | {_cell(pd)} | {_cell(vr)} | n/a | {_cell(ratio)} |"
    )
    failures = {k: v for k, v in result.items() if k.startswith("failures_")}
    missing = {**(result.get("missing") or {}), **(result.get("idle_missing") or {})}
    return (
        f"Command: `{command}` ({result.get('wall_s', 0):.0f} s wall clock; {load})\n\n"
        + "\n".join(lines)
        + f"\n\nFailed requests per window set: `{failures}`."
        + (f" Fronts not measured: {missing}." if missing else "")
        + "\n"
    )
