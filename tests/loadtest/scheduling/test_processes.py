"""``pdgate bench scheduling --deploy processes``: every shim and gateway its own process,
one and two gateways on one Redis side by side, several seeds; and nothing left running
afterwards."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from pdgate.loadtest.lib.router import SMG, install_hint, router_binary
from tests.loadtest._procs import RunBench


def test_processes_one_and_two_gateways_two_seeds(tmp_path: Path, run_bench: RunBench) -> None:
    lines = run_bench(
        ["scheduling", "--deploy=processes", "--gateways=1,2", "--seeds=2", "--seed=5",
         "--modes=least_sse", "--base-users=2", "--multiples=1", "--prefills=2",
         "--warmup-s=0.5", "--measure-s=2", "--capacity=off", "--parallel",
         f"--out={tmp_path}", "--no-doc", "--kind=p", "--trace"]
    )  # fmt: skip
    data = orjson.loads(lines[-1])
    assert (data["deploy"], data["gateways"], data["seeds"]) == ("processes", [1, 2], [5, 6])
    series = ("least_sse/g1", "least_sse/g2")  # one set of rows per gateway count
    assert set(data["success"]) == set(series)
    for name in series:
        # Two users at light load: nearly all in time (a busy shared box may delay a few).
        assert data["success"][name]["1"] >= 0.5
        spread = data["spread"]["goodput"][name]["1"]
        assert 0 < spread["min"] <= spread["median"] <= spread["max"]
        assert data["kv_hold_max_s"][name]["1"] > 0.0  # measured: a number, not NaN
        assert data["kv_hold_over_5s"][name]["1"] >= 0
        assert data["kv_stranded"][name]["1"] == 0  # every KV fetched or released
        assert data["rejections_per_request"][name]["1"] >= 0  # measured: a number, not null
    # Users are split across the gateways: one user each, and each gateway served.
    assert len(data["success_by_gateway"]["least_sse/g1"]["1"]) == 1
    per_gateway = data["success_by_gateway"]["least_sse/g2"]["1"]
    assert len(per_gateway) == 2 and all(r > 0 for r in per_gateway)
    csv = (tmp_path / "p.csv").read_text().splitlines()
    assert len(csv) == 1 + 2 * 2  # a header, one row per series and seed
    # Each gateway's own early drops and fleet yields, where there are several.
    header = csv[0].split(",")
    for column in ("early_drops_gateway0", "early_drops_gateway1", "fleet_yields_gateway1",
                   "loop_lag_p99_ms_gateway0", "loop_lag_p99_ms_gateway1"):  # fmt: skip
        assert column in header
    # The gateways' own event-loop lag, read from their histograms (a bucket's bound, > 0).
    lags = [float(row.split(",")[header.index("loop_lag_p99_ms")]) for row in csv[1:]]
    assert all(0 < lag < 10_000 for lag in lags), lags
    # The trace: every request of every window, where and when it went and how it ended.
    trace = [orjson.loads(line) for line in (tmp_path / "p-trace.jsonl").read_bytes().splitlines()]
    requests = header.index("requests")
    for row in csv[1:]:
        cells = row.split(",")
        series, seed = cells[header.index("mode")], int(cells[header.index("seed")])
        mine = [t for t in trace if (t["series"], t["seed"]) == (series, seed)]
        assert len(mine) == int(cells[requests]) > 0, (series, seed)
        ok = sum(t["success"] for t in mine) / len(mine)
        assert ok == pytest.approx(float(cells[header.index("success_rate")]), abs=1e-3)
        gateways = 2 if series.endswith("/g2") else 1
        assert {t["gateway"] for t in mine} == set(range(gateways))
        issued = [t["issued_s"] for t in mine]
        assert issued == sorted(issued) and 0 <= issued[0] < issued[-1] < 2.5  # in the window
        assert all(t["level"] == "1A" and t["scenario"] for t in mine)
        # Each one served names its prefill (one of the two: prefill-0, prefill-1, ...).
        assert all(t["prefill"].startswith("prefill") for t in mine if t["status"] == 200)
    table = (tmp_path / "p.md").read_text()
    assert "every shim and gateway its own process" in table and "Spread over seeds" in table
    assert "1, 2 gateways (rows /gN)" in table and "| least_sse/g2 | 1A |" in table


def test_smg_with_its_prefill_queue_fronts_the_deployed_cluster(
    tmp_path: Path, run_bench: RunBench
) -> None:
    """SMG in its vLLM P/D mode before the same processes, its prefill admission queue on
    (tests/loadtest/scheduling/test_plan.py checks its flags): 4 users on one prefill of one
    slot, users that honour Retry-After; the figures come out as for any mode. (Its queue
    counts a prefill's slot free when the prefill answers, the shim only once the decode has
    pulled the KV: some 429s remain, each retried by SMG.)"""
    if router_binary(SMG) is None:
        pytest.fail(install_hint(SMG))  # in the loadtest extra: its absence is a broken install
    lines = run_bench(
        ["scheduling", "--deploy=processes", "--modes=smg_cache_aware", "--base-users=4",
         "--multiples=1", "--prefills=1", "--prefill-slots=1", "--warmup-s=0.5",
         "--measure-s=3", "--seeds=1", "--capacity=off", f"--out={tmp_path}", "--no-doc",
         "--kind=smg", "--client=honour"]
    )  # fmt: skip
    data = orjson.loads(lines[-1])
    assert data["client"] == "honour"
    assert 0 < data["success"]["smg_cache_aware"]["1"] <= 1
    assert data["goodput"]["smg_cache_aware"]["1"] > 0
    assert data["rejections_per_request"]["smg_cache_aware"]["1"] >= 0  # measured
    assert "| smg_cache_aware | 1A |" in (tmp_path / "smg.md").read_text()
    # The users were the client asked for (the closed loop once ran `instant` whatever it
    # was told).
    rows = (tmp_path / "smg.csv").read_text().splitlines()
    assert [row.split(",")[rows[0].split(",").index("client")] for row in rows[1:]] == ["honour"]
