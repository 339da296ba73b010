"""A few seconds of the real thing: cluster processes, closed loops, report files, JSON line."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import orjson
import pytest

from pdgate.loadtest import bench
from pdgate.loadtest.lib.router import INSTALL_HINT, router_binary
from pdgate.loadtest.scheduling.report import update_doc


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
                 "kv_stranded"}  # fmt: skip
    assert set(data) == per_point | {"deploy", "gateways", "seeds"}
    assert (data["deploy"], data["gateways"], data["seeds"]) == ("inprocess", 1, [0])
    for key in per_point:
        assert set(data[key]) == {"baseline", "least_sse", "affinity_sse"}
        for by_load in data[key].values():
            assert set(by_load) == {"1", "2"}
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


def test_update_doc_needs_its_markers(tmp_path: Path) -> None:
    doc = tmp_path / "d.md"
    doc.write_text("no markers\n")
    assert not update_doc(doc, "full", "table\n")
    assert doc.read_text() == "no markers\n"


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
