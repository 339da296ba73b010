"""``pdgate bench gateway``'s statistics and report, and tiny real runs of it (seconds each)."""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import orjson
import pytest

from pdgate.loadtest import bench
from pdgate.loadtest.gateway_cost._timeline import SEGMENTS
from pdgate.loadtest.gateway_cost.bench import GatewayPlan, run_gateway_bench, summarize_ttft
from pdgate.loadtest.gateway_cost.command import update_gateway_doc
from pdgate.loadtest.gateway_cost.profile import summarize_stacks
from pdgate.loadtest.gateway_cost.report import json_line, markdown
from pdgate.loadtest.lib.router import SMG, install_hint, router_binary

# What a front may read from an engine besides the requests it forwards: health, and the model
# list (models, context lengths, adapters) that pdgate and SMG keep up to date.
_CONTROL_READS = {"GET /health", "GET /v1/models"}


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
    # Fronts as columns (direct, pdgate, vllm-router), then pdgate / vllm-router.
    assert "| added TTFT p50 vs direct (ms) (lower is better) | n/a | 2.00 | 0.50 | 4.00 |" in block
    assert "| memory per open idle stream (KiB), 1000 streams (lower is better) | n/a | 34.0 |" in (
        block
    )
    doc = tmp_path / "performance.md"
    doc.write_text(
        "# Perf\n\n<!-- bench-gateway:begin -->\nold\n<!-- bench-gateway:end -->\ntail\n"
    )
    update_gateway_doc(doc, block)
    text = doc.read_text()
    assert "old" not in text and block in text and text.endswith("tail\n")


def test_markdown_has_a_table_per_engine_and_the_hops() -> None:
    stock = {
        "ttft_p50_ms": {"direct": 1.0, "pdgate": 3.0, "vllm_router": 1.5},
        "rps_c32": {"direct": 900.0, "pdgate": 400.0, "pdgate_w2": 700.0, "vllm_router": 800.0},
        "client_cores_c32": {"direct": 0.5, "pdgate": 0.2, "pdgate_w2": 0.95, "vllm_router": 0.4},
        "workers_rps_ratio_c32": {"pdgate_w2": 1.75},
        "ttft_segments_ms": {
            "direct": dict.fromkeys(SEGMENTS, 0.2),
            "pdgate": dict.fromkeys(SEGMENTS, 0.6),
        },
        "engine_requests": {"pdgate": {"POST /v1/completions": 10}},
    }
    result = {**RESULT, "engine": "shim", "by_engine": {"shim": RESULT, "stock": stock}}
    block = markdown(result, "pdgate bench gateway", "load 1.0")
    assert block.count("| metric |") == 2
    assert "**Engines: plain OpenAI servers" in block
    assert "| requests/s of N workers / 1 worker, c=32 (higher is better) | n/a | n/a | 1.75 |" in (
        block
    )
    assert "| load client cores busy (1.0 = client-bound), c=32 | 0.50 | 0.20 | 0.95 | 0.40 |" in (
        block
    )
    assert "| pdgate | 0.60 | 0.60 | 0.60 | 0.60 | 0.60 | 3.00 |" in block  # the hops add up
    assert "POST /v1/completions" in block


def test_markdown_gives_each_rounds_spread_and_ratios_within_rounds() -> None:
    def ttft(pdgate: float, smg: float) -> dict[str, dict[str, float]]:
        return {"added_ttft_p50_ms": {"pdgate": pdgate, "smg": smg}}

    def window(pdgate: float, smg: float) -> dict[str, dict[str, float]]:
        return {"pdgate": {"cpu_s_per_1k": pdgate, "rps": 100.0}, "smg": {"cpu_s_per_1k": smg}}

    part = {
        "ttft_p50_ms": {"direct": 1.0, "pdgate": 2.0, "smg": 1.5},
        "rps_c32": {"direct": 900.0, "pdgate": 400.0, "smg": 800.0},
        "rounds_ttft": [ttft(1.0, 0.5), ttft(3.0, 1.0), ttft(2.0, 2.0)],
        # The ratio is taken within each round: 2.0, 1.5 and 1.2, not max over max.
        "rounds_c32": [window(1.0, 0.5), window(0.9, 0.6), window(1.2, 1.0)],
    }
    block = markdown({"by_engine": {"shim": part}}, "pdgate bench gateway", "load 1.0")
    assert "Spread over the 3 rounds" in block
    spread = "1.00 / 2.00 / 3.00 | 0.50 / 1.00 / 2.00 | 1.00 / 2.00 / 3.00 |"
    assert f"| added TTFT p50, c=1 (ms) | {spread}" in block
    spread = "0.90 / 1.00 / 1.20 | 0.50 / 0.60 / 1.00 | 1.20 / 1.50 / 2.00 |"
    assert f"| front CPU s per 1,000 requests, c=32 | {spread}" in block
    assert "| requests/s, c=32 | 100.0 / 100.0 / 100.0 | n/a | n/a |" in block
    one_round = {**part, "rounds_ttft": part["rounds_ttft"][:1]}
    one_round["rounds_c32"] = part["rounds_c32"][:1]
    assert "Spread over" not in markdown({"by_engine": {"shim": one_round}}, "c", "l")


def _redis_or_fail() -> None:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server not installed (make redis-server)")


def _router_or_skip(name: str = "vllm-router") -> None:
    if router_binary(name) is None:
        if os.environ.get("CI", "").strip().lower() == "true":
            pytest.fail(install_hint(name))
        pytest.skip(install_hint(name))


async def test_a_tiny_run_has_the_json_shape() -> None:
    """The real thing, shrunk: both engines, Redis, pdgate and the client, no vllm-router."""
    _redis_or_fail()
    plan = GatewayPlan(
        # A warm-up and window long enough that a cold gateway's first requests end inside
        # it on a loaded machine (the suite runs in several processes).
        ttft_requests=3, concurrencies=(32,), rounds=1, warmup_s=0.5, window_s=1.0,
        idle_streams=20, idle_batch=10, settle_s=0.1, with_router=False, with_smg=False,
        aiohttp=True, floor=True,
    )  # fmt: skip
    result = json_line(await run_gateway_bench(plan, lambda _: None))
    # On the shims pdgate runs three times: with their batch endpoint, plain (vllm-router's
    # endpoints), and on aiohttp's client; the Python floor is a front like them. The
    # top-level keys are the first engine's.
    pdgates = {"pdgate", "pdgate_plain", "pdgate_aiohttp", "python_floor"}
    assert result["engine"] == "shim" and set(result["by_engine"]) == {"shim", "stock"}
    assert set(result["added_ttft_p50_ms"]) == pdgates
    assert set(result["rps_c32"]) == {"direct", *pdgates}
    for front in pdgates:
        assert result["rps_c32"][front] > 0 and result["events_per_s_c32"][front] > 0
    assert result["failures_c32"] == dict.fromkeys({"direct", *pdgates}, 0)
    assert set(result["cpu_s_per_1k"]) == pdgates
    assert result["cpu_s_per_1k_c32"] == result["cpu_s_per_1k"]
    # The load client's own cost, for every front, direct included.
    for key in ("client_cpu_s_per_1k_c32", "client_cores_c32", "engine_cpu_s_per_1k_c32"):
        assert set(result[key]) == {"direct", *pdgates}
        assert all(v > 0 for v in result[key].values()), key
    assert 0 < result["client_cores_c32"]["direct"] <= 1.05  # one event loop: one core at most
    # Stock engines: no batch endpoint to use, so no pdgate_plain; only the handshake's path.
    stock = result["by_engine"]["stock"]
    on_stock = {"direct", "pdgate", "pdgate_aiohttp", "python_floor"}
    assert set(stock["rps_c32"]) == on_stock
    assert stock["failures_c32"] == dict.fromkeys(on_stock, 0)
    assert set(stock["ttft_segments_ms"]) == on_stock
    assert set(stock["added_ttft_segments_ms"]["pdgate"]) == set(SEGMENTS)
    for front, paths in stock["engine_requests"].items():
        assert set(paths) <= _CONTROL_READS | {"POST /v1/completions"}, front
    assert result["idle_engine"] == "stock"
    assert result["idle_streams"] == 20 and result["kib_per_idle_stream"] > 0
    assert set(result["kib_per_idle_stream_by_front"]) == {"pdgate", "python_floor"}


async def test_every_front_hits_the_same_stock_endpoints() -> None:
    """pdgate with 1 and 2 workers, vllm-router and SMG in front of the stock engines: only
    ``POST /v1/completions`` (plus health checks and the model list that pdgate and SMG read
    for models, context lengths and adapters), and the workers' requests/s ratio."""
    _redis_or_fail()
    _router_or_skip()
    _router_or_skip(SMG)
    plan = GatewayPlan(
        ttft_requests=3, concurrencies=(8,), rounds=1, warmup_s=0.1, window_s=0.3,
        idle_streams=0, workers=(1, 2), engines=("stock",),
    )  # fmt: skip
    result = await run_gateway_bench(plan, lambda _: None)
    fronts = {"direct", "pdgate", "pdgate_w2", "vllm_router", "smg"}
    assert set(result["rps_c8"]) == fronts and result["missing"] == {}
    assert set(result["engine_requests"]) == fronts
    for front, paths in result["engine_requests"].items():
        assert paths.get("POST /v1/completions", 0) > 0, front
        assert set(paths) <= _CONTROL_READS | {"POST /v1/completions"}, front
    ratio = result["workers_rps_ratio_c8"]["pdgate_w2"]
    assert ratio == pytest.approx(result["rps_c8"]["pdgate_w2"] / result["rps_c8"]["pdgate"])
    assert set(result["cpu_s_per_1k_c8"]) == {"pdgate", "pdgate_w2", "vllm_router", "smg"}


def test_cli_runs_a_custom_short_comparison(capsys: pytest.CaptureFixture[str]) -> None:
    """The before/after command of docs/results/performance/README.md: no idle phase, one
    concurrency; SMG in front of the shims beside pdgate, both on a CPU of their own."""
    _redis_or_fail()
    _router_or_skip(SMG)
    code = bench.main(
        ["gateway", "--no-router", "--no-doc", "--idle-streams", "0", "--concurrencies", "32",
         "--rounds", "1", "--window-s", "0.3", "--ttft-requests", "3", "--engine", "shim",
         "--pin"]
    )  # fmt: skip
    assert code == 0
    result = orjson.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "kib_per_idle_stream" not in result and "rps_c256" not in result
    for front in ("pdgate", "smg"):
        assert result["rps_c32"][front] > 0 and result["failures_c32"][front] == 0, front
        assert result["cpu_s_per_1k"][front] > 0
    assert set(result["by_engine"]) == {"shim"} and result["pinned"] is True


def test_profile_summary_ranks_self_and_inclusive_samples() -> None:
    raw = (
        'process 1:"python";main (gateway/cli.py:9);relay (gateway/stream/relay.py:40) 30\n'
        "main (gateway/cli.py:9);relay (gateway/stream/relay.py:40);"
        "send (x/site-packages/u.py:7) 50\n"
        "main (gateway/cli.py:9) 20\n"
        "garbage line\n"
    )
    text = summarize_stacks(raw, top=3)
    assert text.startswith("100 samples")
    self_part, incl_part = text.split("incl %")
    # Self: send 50, relay 30, main 20; inclusive: main 100, relay 80, send 50.
    assert self_part.index("send (u.py)") < self_part.index("relay (gateway/stream/relay.py)")
    assert "100.0   main (gateway/cli.py)" in incl_part
    assert "80.0   relay (gateway/stream/relay.py)" in incl_part


def test_profile_summary_gives_each_layer_and_its_cpu_per_request() -> None:
    site = "/v/lib/python3.12/site-packages"
    raw = (
        f"run (asyncio/runners.py:1);send ({site}/uvicorn/protocols/http/h.py:5) 40\n"
        f"run (asyncio/runners.py:1);read ({site}/aiohttp/streams.py:9) 20\n"
        "run (asyncio/runners.py:1);relay (/w/main/gateway/stream/relay.py:40) 30\n"
        "run (asyncio/runners.py:1) 10\n"
    )
    # 100 samples at 1,000 Hz are 0.1 s of CPU; over 50 requests, 2,000 us each.
    text = summarize_stacks(raw, top=3, requests=50, rate_hz=1000)
    layers = text.split("self %   function")[0]
    assert "  40.0          800   HTTP server (uvicorn)" in layers
    assert "  30.0          600   pdgate: relay (gateway/stream)" in layers
    assert "  20.0          400   HTTP client (aiohttp)" in layers
    assert "  10.0          200   event loop (uvloop, asyncio)" in layers
    assert layers.index("uvicorn") < layers.index("pdgate: relay")  # largest first
