"""``pdgate bench upgrade``: the load balancer's rotation, the retry rule, the phases, and a
few seconds of the real thing (a prefill and both gateways replaced under load)."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import orjson
import pytest

from pdgate.loadtest.lib.pool import GatewayPool
from pdgate.loadtest.upgrade.load import Record
from pdgate.loadtest.upgrade.report import by_phase, markdown, summary_json
from pdgate.loadtest.upgrade.run import Phase, Restart, UpgradePlan, UpgradeResult
from tests.loadtest._procs import RunBench


def test_the_pool_sends_users_to_gateways_in_rotation() -> None:
    pool = GatewayPool(["http://a", "http://b"])
    assert [pool.pick(u, 0)[1] for u in range(4)] == ["http://a", "http://b"] * 2
    assert pool.pick(0, 1) == (1, "http://b")  # a retry goes to the next gateway
    pool.remove(0)
    assert [pool.pick(u, a)[1] for u in range(2) for a in range(2)] == ["http://b"] * 4
    pool.add(0, "http://c")  # the replacement, at a new address
    assert pool.rotation == [0, 1] and pool.pick(0, 0) == (0, "http://c")
    pool.remove(0)
    pool.remove(1)
    assert pool.pick(0, 0)[0] in (0, 1)  # none in rotation: try them all rather than none
    with pytest.raises(ValueError, match="needs a gateway"):
        GatewayPool([])


def _record(issued: float, ended: float, *, status: int = 200, completed: bool = True,
            ttft: float | None = 0.1, reconnects: int = 0) -> Record:  # fmt: skip
    return Record(0, issued, ended, 0, status, ttft, 10, completed, reconnects)


def test_failures_count_where_they_happen_and_ttft_where_requests_began() -> None:
    assert _record(0, 1).why() == "ok"
    assert _record(0, 1, status=0, completed=False, ttft=None).why().startswith("no response")
    assert _record(0, 1, status=503, completed=False, ttft=None).why() == "HTTP 503"
    assert _record(0, 1, completed=False).why() == "stream broken after it started"
    records = [
        _record(1.0, 3.0, ttft=0.1),
        _record(2.0, 12.0, ttft=0.2, completed=False),  # issued steady, broke in "gateway"
        _record(11.0, 13.0, ttft=0.9, reconnects=1),
        _record(21.0, 22.0, ttft=0.1),
    ]
    phases = [Phase("steady", 0, 10), Phase("gateway", 10, 20), Phase("after", 20, 25)]
    restart = Restart("gateway", 0, "gateway-0", "gateway-4", 11.0, 11.5, 12.0, 13.0, 0,
                      out_of_rotation_s=10.0, open_at_signal=0)  # fmt: skip
    result = UpgradeResult(UpgradePlan(), records, [restart], phases, 30.0, (1.0, 1.5))
    stats = by_phase(result)
    assert (stats["steady"]["issued"], stats["steady"]["failed"]) == (2, 0)
    assert (stats["gateway"]["issued"], stats["gateway"]["failed"]) == (1, 1)
    assert stats["gateway"]["reconnects"] == 1 and stats["gateway"]["ttft_p50_s"] == 0.9
    data = summary_json(result)
    assert data["failed"] == 1 and data["failed_by_phase"]["gateway"] == 1
    assert data["ttft_bump_p50"]["gateway"] == pytest.approx(0.9 / 0.15)
    assert data["restarts"][0]["begin_s"] == 10.0 and data["restarts"][0]["drain_s"] == 0.5
    text = markdown(result, "pdgate bench upgrade", None)
    assert "**1 failed of 4 requests**, 1 reconnects" in text
    assert "| gateway-0 -> gateway-4 | 0.5 | 0 | 1.5 | 0 |" in text
    assert "stream broken after it started (gateway 0, ended at 12.0 s" in text


def test_a_plan_refuses_what_it_cannot_restart() -> None:
    with pytest.raises(ValueError, match="roles"):
        UpgradePlan(roles=("router",))
    with pytest.raises(ValueError, match="at least one"):
        UpgradePlan(decodes=0)


def test_a_short_rolling_restart_under_load(tmp_path: Path, run_bench: RunBench) -> None:
    doc = tmp_path / "ops.md"
    doc.write_text("# Ops\n\n<!-- upgrade:t:begin -->\nOLD\n<!-- upgrade:t:end -->\nkept\n")
    lines = run_bench(
        ["upgrade", "--quick", "--roles=prefill,gateway", "--steady-s=1.5",
         "--gateway-prestop-s=1", "--after-s=1", f"--out={tmp_path}", f"--doc={doc}",
         "--kind=t"]
    )  # fmt: skip
    data = orjson.loads(lines[-1])
    # The prefill drained and each process was replaced by a new one.
    restarts = data["restarts"]
    assert [r["role"] for r in restarts] == ["prefill", "gateway", "gateway"]
    assert all(r["exit_code"] == 0 and r["old"] != r["new"] for r in restarts)
    # Load ran through every restart, and nothing the clients sent failed.
    assert data["requests"] > 10 and data["failed"] == 0, data["failures"]
    assert data["phases"]["prefill"]["issued"] > 0 and data["phases"]["gateway"]["issued"] > 0
    assert data["cancelled"] == 0
    rows = list(csv.DictReader((tmp_path / "t.csv").open()))
    assert len(rows) == data["requests"] and {r["phase"] for r in rows} >= {"steady", "gateway"}
    text = doc.read_text()
    assert "OLD" not in text and text.endswith("kept\n") and "**0 failed of" in text
    if importlib.util.find_spec("matplotlib") is not None:  # the loadtest extra
        assert (tmp_path / "t.png").stat().st_size > 0
