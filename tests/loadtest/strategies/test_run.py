"""A short real ``pdgate bench strategies`` run: every strategy deployed as separate
processes, its capacity swept, driven at a share of it, and reported."""

from __future__ import annotations

import csv
from pathlib import Path

import orjson

from tests.loadtest._procs import RunBench


def test_a_short_run_serves_and_reports_every_strategy(tmp_path: Path, run_bench: RunBench) -> None:
    doc = tmp_path / "strategies.md"
    doc.write_text("# Strategies\n\nprose kept\n<!-- strategies:t:begin -->\nOLD\n"
                   "<!-- strategies:t:end -->\n")  # fmt: skip
    lines = run_bench(
        ["strategies", "--quick", "--gpus=2", "--loads=1", "--warmup-s=0.5", "--measure-s=2",
         "--search-s=1.5", "--bisections=0",
         "--start-rps=4", f"--out={tmp_path}", f"--doc={doc}", "--kind=t"]
    )  # fmt: skip
    assert len(lines) == 1  # progress goes to stderr
    data = orjson.loads(lines[0])
    assert data["gpus"] == 2 and data["loads"] == ["1"] and list(data["settings"]) == ["mix@25Gb/s"]
    strategies = data["strategies"]
    assert set(strategies) == {"aggregated", "disaggregated", "partial"}
    assert strategies["disaggregated"]["instances"] == "1P+1D"
    for name, s in strategies.items():
        assert s["capacity_rps"] > 0, name
        # Light load on 2 GPUs: served, each request timed, its switch from prefill to
        # decode measured where the decode steps ran.
        assert s["slo_attainment"]["1"] > 0 and s["goodput_per_gpu"]["1"] > 0, name
        assert s["tpot_p50_s"]["1"] > 0 and s["phase_switch_wait_s"]["1"] > 0, name
    rows = list(csv.DictReader((tmp_path / "t.csv").open()))
    loads = {(r["strategy"], r["load"]) for r in rows}
    assert {("aggregated", "capacity"), ("partial", "1"), ("disaggregated", "1")} <= loads
    text = doc.read_text()
    assert text.startswith("# Strategies\n\nprose kept\n") and "OLD" not in text
    assert "| disaggregated | 1P+1D |" in text
