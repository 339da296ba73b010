"""docs/results/performance/README.md from a ``pdgate bench gateway`` result: one table per
engine (fronts as columns), the stock engines' TTFT split hop by hop, the command and the load."""

from __future__ import annotations

import math
import re
import statistics
from typing import Any

__all__ = ["json_line", "markdown"]

_ENGINE_TITLES = {
    "shim": "pdgate's sim shims (null profile)",
    "stock": "plain OpenAI servers (stock.py: vLLM's handshake only, no pdgate extension)",
}
_TTFT_ROWS = (
    ("TTFT p50, c=1 (ms)", "ttft_p50_ms"),
    ("TTFT p99, c=1 (ms)", "ttft_p99_ms"),
    ("added TTFT p50 vs direct (ms)", "added_ttft_p50_ms"),
    ("added TTFT p99 vs direct (ms)", "added_ttft_p99_ms"),
)
# Per concurrency c: (label, key prefix, lower is better)
_WINDOW_ROWS = (
    ("requests/s", "rps", False),
    ("SSE events/s", "events_per_s", False),
    ("front CPU s per 1,000 requests", "cpu_s_per_1k", True),
    ("load client CPU s per 1,000 requests", "client_cpu_s_per_1k", True),
    ("load client cores busy (1.0 = client-bound)", "client_cores", None),
    ("engines' CPU s per 1,000 requests", "engine_cpu_s_per_1k", None),
    ("machine cores busy (all processes)", "host_busy_cores", None),
    ("requests/s of N workers / 1 worker", "workers_rps_ratio", False),
)


def json_line(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's summary line, in its key order, then the rest."""
    keys = ["added_ttft_p50_ms", "rps_c32", "events_per_s_c256", "kib_per_idle_stream",
            "cpu_s_per_1k"]  # fmt: skip
    return {**{k: result[k] for k in keys if k in result}, **result}


def _cell(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:,.1f}" if abs(value) >= 10 else f"{value:.2f}"


def _fronts(part: dict[str, Any]) -> list[str]:
    """Every front the part measured: direct, pdgate's, the routers."""
    seen = set(part.get("ttft_p50_ms", {}))
    for key, row in part.items():
        if re.fullmatch(r"rps_c\d+", key) and isinstance(row, dict):
            seen |= set(row)
    order = {"direct": 0, "pdgate": 1, "pdgate_plain": 2}

    def rank(name: str) -> tuple[int, str]:
        if name in order:
            return order[name], name
        return (3 if name.startswith("pdgate") else 4), name

    return sorted(seen, key=rank)


def _title(front: str) -> str:
    if front == "direct":
        return "direct (floor)"
    if front.startswith("vllm_router"):
        policy = front.removeprefix("vllm_router").lstrip("_") or "round_robin"
        return f"vllm-router ({policy})"
    if front == "smg":
        return "SMG"
    if front == "python_floor":
        return "Python floor"
    return front


def _ratio(a: float | None, b: float | None) -> float | None:
    # A ratio of differences near zero (or of opposite signs) means nothing: left out.
    return a / b if a is not None and b is not None and a > 0 and b > 0 else None


def _pairs(fronts: list[str]) -> list[tuple[str, str]]:
    """(pdgate's front, a router): the ratios the report gives."""
    routers = [f for f in fronts if f.startswith("vllm_router") or f == "smg"]
    pairs = [("pdgate", r) for r in routers if "pdgate" in fronts]
    for router in ("vllm_router", "smg"):
        if "pdgate_plain" in fronts and router in fronts:
            pairs.append(("pdgate_plain", router))  # the like-for-like pairs on the shims
    if "pdgate" in fronts and "pdgate_aiohttp" in fronts:
        pairs.append(("pdgate", "pdgate_aiohttp"))  # what the upstream client costs
    if "python_floor" in fronts:
        # What pdgate's design costs over its stack, and what the stack costs against SMG.
        pairs += [(p, r) for p, r in (("pdgate", "python_floor"), ("python_floor", "smg"))
                  if p in fronts and r in fronts]  # fmt: skip
    return pairs


def _table(
    part: dict[str, Any],
    idle: dict[str, float] | None,
    streams: Any,
    fds: dict[str, float] | None = None,
) -> list[str]:
    fronts = _fronts(part)
    pairs = _pairs(fronts)
    head = [_title(f) for f in fronts] + [f"{p} / {_title(r)}" for p, r in pairs]
    lines = ["| metric | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]

    def row(label: str, values: dict[str, float], lower: bool | None) -> None:
        hint = {True: " (lower is better)", False: " (higher is better)", None: ""}[lower]
        cells = [_cell(values.get(f)) for f in fronts]
        # A ratio only where the row measures the fronts against each other.
        compared = lower is not None and not label.startswith("requests/s of N")
        cells += [_cell(_ratio(values.get(p), values.get(r))) if compared else "" for p, r in pairs]
        lines.append(f"| {label}{hint} | " + " | ".join(cells) + " |")

    for label, key in _TTFT_ROWS:
        row(label, part.get(key, {}), True)
    for label, prefix, lower in _WINDOW_ROWS:
        for c in _concurrencies(part):
            values = part.get(f"{prefix}_c{c}")
            if values and any(not math.isnan(v) for v in values.values()):
                row(f"{label}, c={c}", values, lower)
    if idle:
        row(f"memory per open idle stream (KiB), {streams} streams", idle, True)
    if idle and fds:
        row("descriptors per open idle stream", fds, None)
    return lines


def _concurrencies(part: dict[str, Any]) -> list[int]:
    return sorted(
        int(m.group(1)) for k in part if (m := re.fullmatch(r"rps_c(\d+)", k)) is not None
    )


def _min_med_max(values: list[float]) -> str:
    values = sorted(v for v in values if not math.isnan(v))
    if not values:
        return "n/a"
    return " / ".join(_cell(v) for v in (values[0], statistics.median(values), values[-1]))


def _spread(part: dict[str, Any]) -> list[str]:
    """Each round measures every front in turn over the same stretch of time: the figures
    and pdgate's ratios per round, min / median / max over the rounds."""
    per_round: list[tuple[str, list[dict[str, float]]]] = [
        ("added TTFT p50, c=1 (ms)", [r["added_ttft_p50_ms"] for r in part.get("rounds_ttft", [])])
    ]
    for key, label in (("cpu_s_per_1k", "front CPU s per 1,000 requests"), ("rps", "requests/s")):
        for c in _concurrencies(part):
            rounds = part.get(f"rounds_c{c}") or []
            values = [{n: f[key] for n, f in r.items() if key in f} for r in rounds]
            per_round.append((f"{label}, c={c}", values))
    if len(per_round[0][1]) < 2:
        return []
    fronts = [f for f in _fronts(part) if f != "direct"]
    pairs = _pairs(fronts)
    head = [_title(f) for f in fronts] + [f"{p} / {_title(r)}" for p, r in pairs]
    lines = [
        f"Spread over the {len(per_round[0][1])} rounds (min / median / max; a ratio is taken"
        " within each round):",
        "",
        "| metric | " + " | ".join(head) + " |",
        "|---" * (len(head) + 1) + "|",
    ]
    for label, rounds in per_round:
        cells = [_min_med_max([r[f] for r in rounds if f in r]) for f in fronts]
        for p, q in pairs:
            ratios = [_ratio(r.get(p), r.get(q)) for r in rounds]
            cells.append(_min_med_max([x for x in ratios if x is not None]))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return ["", *lines]


def _segments(part: dict[str, Any]) -> list[str]:
    parts: dict[str, dict[str, float]] = part.get("ttft_segments_ms") or {}
    if not parts:
        return []
    names = list(next(iter(parts.values())))
    lines = [
        "TTFT at c=1 hop by hop (p50 of each hop in ms, from the stock engines' timestamps;"
        " `ttft_segments_ms`):",
        "",
        "| front | " + " | ".join(names) + " | sum |",
        "|---" * (len(names) + 2) + "|",
    ]
    for front in _fronts({"ttft_p50_ms": parts}):
        values = parts[front]
        cells = [_cell(values[n]) for n in names] + [_cell(sum(values.values()))]
        lines.append(f"| {_title(front)} | " + " | ".join(cells) + " |")
    return ["", *lines]


def markdown(result: dict[str, Any], command: str, load: str) -> str:
    by_engine: dict[str, dict[str, Any]] = result.get("by_engine") or {
        str(result.get("engine", "shim")): result
    }
    first = next(iter(by_engine))
    kib = result.get("kib_per_idle_stream_by_front") or (
        {"pdgate": result["kib_per_idle_stream"]} if "kib_per_idle_stream" in result else {}
    )
    out = [f"Command: `{command}` ({result.get('wall_s', 0):.0f} s wall clock; {load})"]
    failures: dict[str, Any] = {}
    missing: dict[str, Any] = dict(result.get("idle_missing") or {})
    for engine, part in by_engine.items():
        out += ["", f"**Engines: {_ENGINE_TITLES.get(engine, engine)}**", ""]
        idle = kib if engine == result.get("idle_engine", first) else None
        fds = result.get("fds_per_idle_stream_by_front")
        out += _table(part, idle, result.get("idle_streams"), fds)
        out += _spread(part)
        out += _segments(part)
        failures[engine] = {k: v for k, v in part.items() if k.startswith("failures_")}
        missing.update({f"{engine}:{k}": v for k, v in (part.get("missing") or {}).items()})
        if part.get("engine_requests"):
            out += ["", f"Engine requests per front (all windows): `{part['engine_requests']}`."]
    out += ["", f"Failed requests per window set: `{failures}`."]
    if missing:
        out[-1] += f" Fronts not measured: {missing}."
    return "\n".join(out) + "\n"
