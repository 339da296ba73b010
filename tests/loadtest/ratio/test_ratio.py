"""``pdgate bench ratio``: the advice's rounding, eq. 1 from the sim profile, the report, and
a few seconds of the real thing (a split deployed as processes, its advice read)."""

from __future__ import annotations

import argparse
import csv
import importlib.util
import math
from pathlib import Path

import orjson
import pytest

from pdgate.loadtest import bench
from pdgate.loadtest.lib.stats import RequestResult, summarize
from pdgate.loadtest.ratio.command import _splits, plan_from_args
from pdgate.loadtest.ratio.experiment import Plan, Result, Run, _combine
from pdgate.loadtest.ratio.report import comparisons, markdown, summary_json
from pdgate.loadtest.ratio.workload import (
    DECODE_HEAVY,
    PROMPT_HEAVY,
    QUICK_WORKLOADS,
    Shape,
    model_ratio,
    split_of,
)
from pdgate.loadtest.scheduling.runner import Point
from tests.loadtest._procs import RunBench


def test_the_advice_rounds_to_whole_instances_of_each_role() -> None:
    assert split_of(1.0, 8) == (4, 4)
    assert split_of(3.0, 8) == (6, 2)
    assert split_of(1 / 3, 8) == (2, 6)
    # Extreme advice still leaves one instance of the other role.
    assert split_of(100.0, 8) == (7, 1)
    assert split_of(0.001, 8) == (1, 7)
    assert split_of(0.5, 3) == (1, 2)
    with pytest.raises(ValueError, match="positive ratio"):
        split_of(0.0, 8)


def test_eq1_from_the_sim_profile_points_each_shape_its_own_way() -> None:
    prompt, decode = model_ratio(PROMPT_HEAVY, Shape()), model_ratio(DECODE_HEAVY, Shape())
    # Long prompts need more prefills than decodes; long outputs the opposite.
    assert prompt["ratio"] > 3 and decode["ratio"] < 1 / 3
    for m in (prompt, decode):
        assert math.isclose(m["ratio"], m["per_decode_rps"] / m["per_prefill_rps"])
    # A 4k-token prompt on the A100 profile takes most of a second (sim_profile.py).
    assert 0.6 < prompt["t_prefill_s"] < 1.1
    # The quick workloads keep the shapes.
    quick = {w.name: model_ratio(w, Shape())["ratio"] for w in QUICK_WORKLOADS}
    assert quick["prompt_heavy"] > 3 and quick["decode_heavy"] < 1 / 3


def test_split_arguments_and_the_plan() -> None:
    assert _splits("6:2, 2:6") == ((6, 2), (2, 6))
    for bad in ("6-2", "a:b"):
        with pytest.raises(argparse.ArgumentTypeError):
            _splits(bad)
    with pytest.raises(ValueError, match="8 in all"):
        Plan(starts=((6, 3),))
    with pytest.raises(ValueError, match="each role"):
        Plan(starts=((8, 0),))
    parser = argparse.ArgumentParser()
    bench._parser()  # the subcommand is registered
    from pdgate.loadtest.ratio.command import configure

    configure(parser)
    quick = plan_from_args(parser.parse_args(["--quick"]))
    assert quick.seeds == (0,)
    # --quick starts each shape from the split it suits worst.
    assert quick.starts_of(quick.workloads[0]) == ((2, 6),)
    assert quick.starts_of(quick.workloads[1]) == ((6, 2),)
    full = plan_from_args(parser.parse_args(["--seeds=2", "--seed=4", "--instances=4"]))
    assert full.seeds == (4, 5) and full.starts == ((3, 1), (1, 3))


def test_advice_from_several_gateways_is_combined() -> None:
    a = {"group": "default", "ratio": 2.0, "desired_prefills": 1.5, "desired_decodes": None,
         "demand_rps": 3.0, "t_prefill_s": 0.2, "bottleneck": "prefill"}  # fmt: skip
    b = {"group": "default", "ratio": 4.0, "desired_prefills": 0.5, "desired_decodes": None,
         "demand_rps": 1.0, "t_prefill_s": 0.4, "bottleneck": "prefill"}  # fmt: skip
    both = _combine([a, b])
    assert both is not None
    assert both["ratio"] == 3.0 and both["t_prefill_s"] == pytest.approx(0.3)
    assert both["desired_prefills"] == 2.0 and both["demand_rps"] == 4.0
    assert both["desired_decodes"] is None
    assert _combine([]) is None


def _point(goodput_requests: int, window_s: float = 10.0) -> Point:
    rows = [RequestResult("s", 1.0, 200, 0.5, 1.0, True) for _ in range(goodput_requests)]
    rows.append(RequestResult("s", 1.0, 503, None, 1.0, False))
    return Point("s", 4, summarize(rows, window_s), {}, 1.0, 0.1, 1.5, {}, 20.0)


def test_the_report_compares_each_start_with_its_advised_split() -> None:
    plan = Plan(workloads=(PROMPT_HEAVY,), starts=((2, 6), (6, 2)), seeds=(0, 1))
    advice = {"ratio": 8.0, "bottleneck": "prefill", "t_prefill_s": 0.84, "xi_s": 0.05,
              "tokens": 33.0, "tpot_s": 0.011, "t_decode_s": 0.42}  # fmt: skip
    runs = []
    for seed in (0, 1):
        runs += [
            Run("prompt_heavy", seed, (2, 6), "start", _point(20 + seed), advice, (7, 1), 1.0),
            Run("prompt_heavy", seed, (6, 2), "start", _point(60), advice, (7, 1), 1.0),
            Run("prompt_heavy", seed, (7, 1), "advised", _point(70), advice, (7, 1), 1.0),
        ]
    result = Result(plan, runs, 100.0, (1.0, 2.0))
    c = comparisons(result, PROMPT_HEAVY)
    assert c["2:6"]["gains"] == pytest.approx([70 / 20 - 1, 70 / 21 - 1])
    assert c["6:2"]["gains"] == pytest.approx([70 / 60 - 1] * 2)
    data = summary_json(result)
    start = data["workloads"]["prompt_heavy"]["starts"]["6:2"]
    assert start["advised"] == ["7:1", "7:1"] and start["goodput"]["median"] == 6.0
    assert start["advised_goodput"]["median"] == 7.0
    assert data["workloads"]["prompt_heavy"]["model_split"] == "7:1"
    assert set(data["workloads"]["prompt_heavy"]["splits"]) == {"2:6", "6:2", "7:1"}
    text = markdown(result, "pdgate bench ratio", "ratio/x.png", "a cluster")
    assert "| prompt_heavy | 6:2 | 6.00 / 6.00 / 6.00 |" in text
    assert "+17% / +17% / +17%" in text and "![ratio benchmark](ratio/x.png)" in text
    assert "load average 1.0 at the start, 2.0 at the end" in text


def test_a_short_real_run_reads_the_gateways_advice(tmp_path: Path, run_bench: RunBench) -> None:
    doc = tmp_path / "ratio.md"
    doc.write_text("# Ratio\n\nprose kept\n<!-- ratio:t:begin -->\nOLD\n<!-- ratio:t:end -->\n")
    lines = run_bench(
        ["ratio", "--quick", "--workloads=prompt_heavy", "--instances=3", "--starts=1:2",
         "--users-scale=0.3", "--warmup-s=1", "--measure-s=4", f"--out={tmp_path}",
         f"--doc={doc}", "--kind=t"]
    )  # fmt: skip
    assert len(lines) == 1  # progress goes to stderr
    data = orjson.loads(lines[0])
    assert data["instances"] == 3 and data["seeds"] == [0]
    start = data["workloads"]["prompt_heavy"]["starts"]["1:2"]
    assert start["goodput"]["median"] > 0  # 4 users on one prefill: served
    rows = list(csv.DictReader((tmp_path / "t.csv").open()))
    first = rows[0]
    assert (first["kind"], first["split"], first["users"]) == ("start", "1:2", "4")
    # The gateway's GET /admin/ratio saw the split this run deployed, and measured prefills.
    assert (first["advice_prefills"], first["advice_decodes"]) == ("1", "2")
    assert float(first["advice_samples"]) > 0 and int(first["requests"]) > 0
    text = doc.read_text()
    assert text.startswith("# Ratio\n\nprose kept\n") and "OLD" not in text
    assert "| prompt_heavy | 1:2 |" in text
    if importlib.util.find_spec("matplotlib") is not None:  # the loadtest extra
        assert (tmp_path / "t.png").stat().st_size > 0
