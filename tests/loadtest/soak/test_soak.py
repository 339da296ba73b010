"""``pdgate bench soak``: a few seconds of the real thing (a gateway and shims as separate
processes, a private Redis, the gateway's RSS sampled), its JSON line and doc block."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import orjson

from pdgate.loadtest.soak.report import markdown
from pdgate.loadtest.soak.run import SoakPlan
from tests.loadtest._procs import RunBench


def test_a_short_soak(tmp_path: Path, run_bench: RunBench) -> None:
    doc = tmp_path / "soak.md"
    doc.write_text("# Soak\n\nprose kept\n")
    lines = run_bench(
        ["soak", "--duration-s=5", "--warmup-s=2", "--sample-s=0.5", "--users=2",
         "--policy=affinity_sse", f"--doc={doc}", f"--out={tmp_path / 'soak'}", "--kind=t"]
    )  # fmt: skip
    data = orjson.loads(lines[-1])
    assert data["policy"] == "affinity_sse" and data["requests"] > 0
    # Served (the deadlines' verdict depends on how busy the shared box is: not asserted).
    assert data["status_counts"].get("200", 0) > 0 and data["requests_after_warmup"] > 0
    assert 0.0 <= data["success_rate"] <= 1.0
    samples = data["samples"]
    assert len(samples) >= 10  # every 0.5 s over 5 s, and one at the end
    assert samples[0][0] == 0.0 and samples[0][2] == 0  # the idle gateway first
    assert samples[-1][0] >= 5.0 and samples[-1][2] == data["requests"]  # the end, on the dot
    # A Python web server: tens of MiB, and the summary figures agree with the samples.
    assert 10_000 < data["rss_start_kib"] < 1_000_000
    assert data["rss_end_kib"] == samples[-1][1]
    assert data["growth_kib"] == data["rss_end_kib"] - data["rss_warm_kib"]
    for key in ("growth_pct", "growth_kib_per_min", "growth_kib_per_1k_requests"):
        assert isinstance(data[key], float)
    text = doc.read_text()
    assert text.startswith("# Soak\n\nprose kept\n") and "<!-- soak:t:begin -->" in text
    assert "| affinity_sse |" in text
    if importlib.util.find_spec("matplotlib") is not None:  # the loadtest extra
        assert (tmp_path / "soak" / "t.png").stat().st_size > 0


def test_markdown_says_na_for_what_it_cannot_know() -> None:
    nan = float("nan")
    result = {
        "policy": "least_sse", "requests": 0, "requests_after_warmup": 0, "success_rate": nan,
        "rss_start_kib": 60_000, "rss_warm_kib": 61_440, "rss_end_kib": 61_440,
        "rss_max_kib": 61_440, "growth_kib": 0, "growth_pct": 0.0, "growth_kib_per_min": 0.0,
        "growth_kib_per_1k_requests": nan, "wall_s": 1.0, "plan": vars_of(SoakPlan()),
    }  # fmt: skip
    block = markdown(result, "pdgate bench soak", None)
    assert "| least_sse | 0 (0) | n/a | 58.6 / 60.0 / 60.0 / 60.0 |" in block
    assert "+0.00 MiB (+0.0%)" in block and "| n/a KiB |" in block


def vars_of(plan: SoakPlan) -> dict[str, object]:
    return {f: getattr(plan, f) for f in plan.__dataclass_fields__}
