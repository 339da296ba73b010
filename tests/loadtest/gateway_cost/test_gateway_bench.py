"""``pdgate bench gateway``'s statistics and report (the run itself takes ~40 s: not here)."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import orjson
import pytest

from pdgate.loadtest import bench
from pdgate.loadtest.gateway_cost.bench import GatewayPlan, run_gateway_bench, summarize_ttft
from pdgate.loadtest.gateway_cost.command import update_gateway_doc
from pdgate.loadtest.gateway_cost.profile import summarize_stacks
from pdgate.loadtest.gateway_cost.report import json_line, markdown


def test_added_ttft_is_over_the_direct_floor() -> None:
    out = summarize_ttft(
        {"direct": [0.001 * i for i in range(1, 101)], "pdgate": [0.002 * i for i in range(1, 101)]}
    )
    assert out["ttft_p50_ms"]["direct"] == pytest.approx(50.5)
    assert out["added_ttft_p50_ms"] == {"pdgate": pytest.approx(50.5)}
    assert out["added_ttft_p99_ms"]["pdgate"] == pytest.approx(out["ttft_p99_ms"]["direct"])
    assert "direct" not in out["added_ttft_p99_ms"]


def test_no_samples_give_nan_not_an_exception() -> None:
    out = summarize_ttft({"direct": [], "pdgate": [0.001]})
    assert math.isnan(out["added_ttft_p50_ms"]["pdgate"])


RESULT = {
    "ttft_p50_ms": {"direct": 4.0, "pdgate": 6.0, "vllm_router": 4.5},
    "added_ttft_p50_ms": {"pdgate": 2.0, "vllm_router": 0.5},
    "rps_c32": {"direct": 300.0, "pdgate": 290.0, "vllm_router": 280.0},
    "events_per_s_c256": {"direct": 1.0, "pdgate": 2.0, "vllm_router": 3.0},
    "kib_per_idle_stream": 34.0,
    "idle_streams": 1000,
    "cpu_s_per_1k": {"pdgate": 1.7, "vllm_router": 1.0},
    "failures_c32": {"direct": 0},
    "wall_s": 40.0,
}


def test_json_line_leads_with_the_issue_keys() -> None:
    line = json_line(RESULT)
    assert list(line)[:5] == [
        "added_ttft_p50_ms",
        "rps_c32",
        "events_per_s_c256",
        "kib_per_idle_stream",
        "cpu_s_per_1k",
    ]
    assert line["idle_streams"] == 1000


def test_markdown_table_and_doc_markers(tmp_path: Path) -> None:
    block = markdown(RESULT, "pdgate bench gateway", "load 1.0")
    assert "| added TTFT p50 vs direct (ms) (lower is better) | 2.00 | 0.50 | n/a | 4.00 |" in block
    assert "34.0" in block
    doc = tmp_path / "performance.md"
    doc.write_text(
        "# Perf\n\n<!-- bench-gateway:begin -->\nold\n<!-- bench-gateway:end -->\ntail\n"
    )
    update_gateway_doc(doc, block)
    text = doc.read_text()
    assert "old" not in text and block in text and text.endswith("tail\n")


async def test_a_tiny_run_has_the_json_shape() -> None:
    """The real thing, shrunk: shims, Redis, pdgate and the client, no vllm-router (~8 s)."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server not installed (make redis-server)")
    plan = GatewayPlan(
        ttft_requests=3, concurrencies=(32,), rounds=1, warmup_s=0.1, window_s=0.2,
        idle_streams=20, idle_batch=10, settle_s=0.1, with_router=False,
    )  # fmt: skip
    result = json_line(await run_gateway_bench(plan, lambda _: None))
    # pdgate twice: with the shims' batch endpoint, and plain (vllm-router's endpoints).
    pdgates = {"pdgate", "pdgate_plain"}
    assert set(result["added_ttft_p50_ms"]) == pdgates
    assert set(result["rps_c32"]) == {"direct", *pdgates}
    for front in pdgates:
        assert result["rps_c32"][front] > 0 and result["events_per_s_c32"][front] > 0
    assert result["failures_c32"] == {"direct": 0, "pdgate": 0, "pdgate_plain": 0}
    assert result["idle_streams"] == 20 and result["kib_per_idle_stream"] > 0
    assert set(result["cpu_s_per_1k"]) == pdgates


def test_cli_runs_a_custom_short_comparison(capsys: pytest.CaptureFixture[str]) -> None:
    """The before/after command of docs/performance.md: no idle phase, one concurrency."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server not installed (make redis-server)")
    code = bench.main(
        ["gateway", "--no-router", "--no-doc", "--idle-streams", "0", "--concurrencies", "32",
         "--rounds", "1", "--window-s", "0.3", "--ttft-requests", "3"]
    )  # fmt: skip
    assert code == 0
    result = orjson.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "kib_per_idle_stream" not in result and "rps_c256" not in result
    assert result["rps_c32"]["pdgate"] > 0 and result["failures_c32"]["pdgate"] == 0
    assert result["cpu_s_per_1k"]["pdgate"] > 0


def test_profile_summary_ranks_self_and_inclusive_samples() -> None:
    raw = (
        'process 1:"python";main (gateway/cli.py:9);relay (gateway/relay.py:40) 30\n'
        "main (gateway/cli.py:9);relay (gateway/relay.py:40);send (x/site-packages/u.py:7) 50\n"
        "main (gateway/cli.py:9) 20\n"
        "garbage line\n"
    )
    text = summarize_stacks(raw, top=3)
    assert text.startswith("100 samples")
    self_part, incl_part = text.split("incl %")
    # Self: send 50, relay 30, main 20; inclusive: main 100, relay 80, send 50.
    assert self_part.index("send (u.py)") < self_part.index("relay (gateway/relay.py)")
    assert "100.0   main (gateway/cli.py)" in incl_part
    assert "80.0   relay (gateway/relay.py)" in incl_part
