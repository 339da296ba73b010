"""``pdgate plan``: the cheapest fleet for the SLOs, mixed where prices favour it and of one
GPU type where they do not; and, in the slow suite, the example verified in the simulator."""

from __future__ import annotations

import tomllib
from dataclasses import replace
from importlib import resources
from pathlib import Path

import orjson
import pytest

from pdgate.config import cli
from pdgate.engine_shim.hardware import Parallel
from pdgate.loadtest.plan.planner import Offer, PlanInput, best_plans, plan_fleet
from tests.loadtest._procs import marked, needs_redis


def _example() -> PlanInput:
    raw = resources.files("pdgate.loadtest.plan").joinpath("example.toml").read_text()
    return PlanInput.from_toml(tomllib.loads(raw))


def test_prices_that_favour_mixing_give_a_mixed_plan_cheaper_than_any_one_type() -> None:
    spec = _example()
    best, single = best_plans(spec)
    assert best is not None and best.mixed
    # Compute-rich, cheap L40S prompts; bandwidth-rich H100 decodes.
    assert (best.prefill.gpu, best.decode.gpu) == ("l40s", "h100")
    cheapest_single = min(p.cost_per_hour for p in single.values() if p is not None)
    assert best.cost_per_hour < cheapest_single
    # Each role within its SLO, with the margins the planner keeps.
    assert best.prefill.latency_s <= spec.ttft_slo_s and best.decode.latency_s <= spec.tpot_slo_s
    assert best.decode.instances * best.decode.throughput_rps >= spec.rate_rps


def test_prices_that_do_not_favour_mixing_give_one_type() -> None:
    spec = _example()
    cheap_h100 = tuple(
        replace(o, price_per_hour=2.0) if o.gpu == "h100" else o for o in spec.offers
    )
    best = plan_fleet(replace(spec, offers=cheap_h100))
    assert best is not None and not best.mixed and best.prefill.gpu == "h100"


def test_a_model_too_large_for_one_gpu_is_split_and_counts_bound_the_plan() -> None:
    spec = replace(_example(), model="llama-3.1-70b", rate_rps=1.0, tpot_slo_s=0.1,
                   offers=(Offer("h100", 16, 3.0),))  # fmt: skip
    best = plan_fleet(spec)
    assert best is not None
    assert best.prefill.parallel != Parallel() and best.decode.parallel != Parallel()
    assert best.prefill.gpus + best.decode.gpus <= 16
    # Eight are too few to keep the TTFT p99 and the TPOT both; one cannot hold the weights.
    for count in (8, 1):
        assert plan_fleet(replace(spec, offers=(Offer("h100", count, 3.0),))) is None


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="lacks 'slo'"):
        PlanInput.from_toml({"model": "llama-3.1-8b", "workload": {}, "gpus": []})
    with pytest.raises(ValueError, match="unknown GPU"):
        Offer("tpu-v9", 1, 1.0)


def test_the_command_prints_a_table_then_one_json_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["plan", "--example"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert (
        lines[0].startswith("| plan | role | GPU |") and "| chosen | prefill | l40s |" in lines[2]
    )
    data = orjson.loads(lines[-1])
    assert data["plan"]["mixed"] is True and data["plan"]["decode"]["gpu"] == "h100"
    assert data["single_type"]["l40s"] is None  # eight L40S cannot serve it alone
    assert data["plan"]["prefill"]["sim_profile"] == "llama-3.1-8b@l40s"
    bad = tmp_path / "bad.toml"
    bad.write_text("model = ")
    assert cli.main(["plan", str(bad)]) == 2
    assert "not TOML" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_example_plan_verifies_in_the_simulator(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    needs_redis()
    with marked(monkeypatch):
        assert cli.main(["plan", "--example", "--verify", "--verify-s", "30"]) == 0
    data = orjson.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert data["verify"]["requests"] > 150
    assert data["verify"]["slo_attainment"] >= 0.99
