"""A few seconds of the real thing: cluster processes, closed and open loops, capacity,
report files, JSON line."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from pdgate.loadtest import bench
from pdgate.loadtest.lib.docs import publish
from pdgate.loadtest.lib.router import INSTALL_HINT, router_binary
from pdgate.loadtest.scheduling.clusters import open_cluster
from pdgate.loadtest.scheduling.modes import ClusterSpec, Mode
from tests.loadtest._procs import marked, needs_redis


def test_bench_scheduling_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path
    doc = out / "scheduling.md"
    doc.write_text(
        "intro\n<!-- scheduling:quick:begin -->\nOLD TABLE\n<!-- scheduling:quick:end -->\n"
    )
    code = bench.main(
        [
            "scheduling",
            "--quick",
            "--base-users=2",
            "--multiples=1,2",
            "--warmup-s=0.5",
            "--measure-s=1.5",
            f"--out={out}",
            f"--doc={doc}",
        ]
    )
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1  # progress goes to stderr
    data = orjson.loads(lines[0])
    per_point = {"success", "goodput", "prefix_hit_rate", "kv_hold_max_s", "kv_hold_over_5s",
                 "kv_stranded", "goodput_fraction", "offered_rps", "rejections_per_request",
                 "retries_per_request", "fleet_calls_per_request", "fleet_acquire_ms"}  # fmt: skip
    run = {"deploy", "gateways", "seeds", "base_users", "workload", "arrivals", "client",
           "prefill_slots", "batch_forwarding", "capacity", "load_fraction",
           "level_users"}  # fmt: skip
    assert set(data) == per_point | run
    assert (data["deploy"], data["gateways"], data["seeds"]) == ("inprocess", 1, [0])
    assert (data["workload"], data["arrivals"], data["prefill_slots"]) == ("mix", "closed", 1)
    assert (data["batch_forwarding"], data["base_users"]) == ("default", 2)
    for key in per_point:
        assert set(data[key]) == {"baseline", "least_sse", "affinity_sse"}
        for by_load in data[key].values():
            assert set(by_load) == {"1", "2"}
    # The quick run's capacity is a fixed rough one: each level is a share of it.
    cap = data["capacity"]
    assert cap["source"] == "fixed" and cap["rps"] > 0 and cap["user_rps"] > 0
    assert data["load_fraction"] == {
        k: pytest.approx(int(k) * 2 * cap["user_rps"] / cap["rps"]) for k in ("1", "2")
    }
    for by_load in data["success"].values():
        assert all(0.0 <= r <= 1.0 for r in by_load.values())
    # The shims report their KV holds: two users at light load hold KV for milliseconds.
    for by_load in data["kv_hold_max_s"].values():
        assert all(0.0 < h < 5.0 for h in by_load.values())
    for key in ("kv_hold_over_5s", "kv_stranded"):
        assert all(v == 0 for by_load in data[key].values() for v in by_load.values())
    for name in ("quick.csv", "quick.md"):
        assert (out / name).stat().st_size > 0
    if importlib.util.find_spec("matplotlib") is not None:  # the loadtest extra
        assert (out / "quick.png").stat().st_size > 0
    text = doc.read_text()
    assert text.startswith("intro\n") and "OLD TABLE" not in text and "| baseline | 2A |" in text


def test_publishing_into_a_doc_needs_its_markers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = tmp_path / "d.md"
    doc.write_text("no markers\n")
    publish("table\n", tmp_path, "full", doc, "scheduling")
    assert doc.read_text() == "no markers\n"
    assert (tmp_path / "full.md").read_text() == "table\n"
    assert "no scheduling:full markers" in capsys.readouterr().err


def test_bench_scheduling_behind_vllm_router(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A router mode end to end: the same queue-less cluster, vllm-router in front (the
    loadtest extra installs it), its own output kind and doc block."""
    if router_binary() is None:
        pytest.fail(INSTALL_HINT)  # in the loadtest extra: its absence is a broken install
    doc = tmp_path / "scheduling.md"
    doc.write_text("<!-- scheduling:router:begin -->\n<!-- scheduling:router:end -->\n")
    code = bench.main(
        [
            "scheduling",
            "--modes=router_round_robin,least_sse",
            "--kind=router",
            "--base-users=2",
            "--multiples=1",
            "--warmup-s=0.5",
            "--measure-s=2",
            "--seeds=1",
            "--capacity=off",
            "--parallel",
            f"--out={tmp_path}",
            f"--doc={doc}",
        ]
    )
    assert code == 0
    data = orjson.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # Two users at light load: every request through the router succeeds, and the prefills
    # saw its traffic (their prefix-cache counters moved).
    assert data["success"]["router_round_robin"]["1"] == 1.0
    assert data["goodput"]["router_round_robin"]["1"] > 0
    assert data["prefix_hit_rate"]["router_round_robin"]["1"] >= 0
    assert (tmp_path / "router.csv").stat().st_size > 0
    assert "| router_round_robin | 1A |" in doc.read_text()


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert bench.main(["scheduling", *argv]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    data: dict[str, Any] = orjson.loads(lines[0])
    return data


def test_slots_batch_forwarding_ablation_open_loop_and_tenants(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Several slots per prefill, batch forwarding on and off side by side, Poisson arrivals
    at the rate the given capacity puts on 1A, and per-tenant success."""
    data = _run(
        capsys, "--prefill-slots=2", "--batch-forwarding=both", "--modes=baseline,least_sse",
        "--workload=tenants", "--arrivals=poisson", "--capacity=8", "--user-rps=1",
        "--base-users=2", "--multiples=1", "--warmup-s=0.5", "--measure-s=2", "--seeds=1",
        "--parallel", f"--out={tmp_path}", "--no-doc", "--kind=k",
    )  # fmt: skip
    series = {"baseline", "least_sse+bf", "least_sse-bf"}
    assert set(data["success"]) == series
    assert (data["prefill_slots"], data["batch_forwarding"]) == (2, "both")
    assert (data["workload"], data["arrivals"]) == ("tenants", "poisson")
    # 1A = 2 users x 1 req/s each = 2 req/s = a quarter of the 8 req/s capacity.
    assert data["rate_rps"] == {"1": pytest.approx(2.0)}
    assert data["load_fraction"] == {"1": pytest.approx(0.25)}
    assert data["capacity"]["source"] == "fixed"
    tenants = {"heavy", "light-a", "light-b", "light-c"}
    for name in series:
        assert data["client_dropped"][name]["1"] == 0  # light load: the bound never bites
        assert data["success"][name]["1"] >= 0.5
        assert data["offered_rps"][name]["1"] > 0
        by_tenant = data["success_by_tenant"][name]["1"]
        assert by_tenant and set(by_tenant) <= tenants
    table = (tmp_path / "k.md").read_text()
    assert "x 2 slot(s)" in table and "batch forwarding on (+bf) and off (-bf)" in table
    assert "open loop, Poisson arrivals" in table and "| success per tenant |" in table
    assert "| least_sse-bf | 1A | 25.0% |" in table


def test_capacity_sweep_then_levels_as_shares_of_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _run(
        capsys, "--modes=least_sse", "--base-users=2", "--load-fractions=0.5",
        "--capacity-users=1,2", "--calibrate-s=1", "--warmup-s=0.3", "--measure-s=1",
        "--seeds=1", f"--out={tmp_path}", "--no-doc", "--kind=c",
    )  # fmt: skip
    cap = data["capacity"]
    assert (cap["source"], cap["mode"]) == ("measured", "least_sse")
    assert cap["users"] in (1, 2) and cap["rps"] > 0 and cap["user_rps"] > 0
    assert not cap["plateau"]  # two points cannot show two without a rise
    # The level: the users whose demand is half the measured capacity.
    users = max(1, round(0.5 * cap["rps"] / cap["user_rps"]))
    assert data["level_users"] == {"0.5c": users}
    assert data["load_fraction"]["0.5c"] == pytest.approx(users * cap["user_rps"] / cap["rps"])
    assert data["goodput_fraction"]["least_sse"]["0.5c"] == pytest.approx(
        data["goodput"]["least_sse"]["0.5c"] / cap["rps"]
    )
    phases = [row.split(",")[0] for row in (tmp_path / "c.csv").read_text().splitlines()[1:]]
    assert phases == ["capacity", "capacity", "run"]
    table = (tmp_path / "c.md").read_text()
    assert "| least_sse users |" in table and "| least_sse | 0.5x cap |" in table


@pytest.mark.parametrize("deploy", ["inprocess", "processes"])
async def test_mode_overrides_and_slots_reach_the_servers(
    deploy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mode's setting overrides and the slots per prefill are what the servers run with,
    in either deployment (the in-process child gets the whole mode, not its name)."""
    if deploy == "processes":
        needs_redis()
    spec = ClusterSpec(prefills=1, prefill_capacity=3)
    mode = Mode("custom", "reject", "queue", "least_sse", gateway={"prefill_policy": "round_robin"},
                decode={"capacity": 5})  # fmt: skip
    with marked(monkeypatch):
        async with aiohttp.ClientSession() as session, open_cluster(spec, mode, deploy) as c:
            await c.wait_ready(session)
            urls = c.urls
            health, prefill, decode = await asyncio.gather(
                _json(session, urls.gateways[0] + "/health"),
                _json(session, urls.prefills[0] + "/load"),
                _json(session, urls.decodes[0] + "/load"),
            )
    assert "round_robin" in orjson.dumps(health["prefill_policy"]).decode()
    assert (prefill["capacity"], decode["capacity"]) == (3, 5)


async def _json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url) as resp:
        assert resp.status == 200
        return await resp.json()
