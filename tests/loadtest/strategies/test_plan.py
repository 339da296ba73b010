"""What ``pdgate bench strategies`` deploys for each strategy, and how it reports."""

from __future__ import annotations

import argparse
import random

import pytest

from pdgate.config import GatewaySettings, ShimSettings
from pdgate.loadtest.lib.stats import RequestResult, summarize
from pdgate.loadtest.scheduling.modes import gateway_fields, shim_fields, shim_role
from pdgate.loadtest.scheduling.runner import Point
from pdgate.loadtest.scheduling.workload import Scenario, WorkloadSpec, workload_named
from pdgate.loadtest.strategies import command
from pdgate.loadtest.strategies.experiment import Capacity, Outcome, Result
from pdgate.loadtest.strategies.plan import StrategiesPlan, advised_split
from pdgate.loadtest.strategies.report import markdown, summary_json, sustained


def _one(name: str, body: int, out: int) -> WorkloadSpec:
    return WorkloadSpec(name, "", (Scenario(name, 0, body, body, out, 4.0),))


def test_the_split_follows_eq1_for_the_workload_and_the_link() -> None:
    kw = {"prefill_slots": 1, "decode_slots": 64}
    prompt_heavy = advised_split(_one("p", 6000, 16), "llama-3.1-8b-a100", 8, kv_gbps=400, **kw)
    decode_heavy = advised_split(_one("d", 200, 2000), "llama-3.1-8b-a100", 8, kv_gbps=400, **kw)
    assert sum(prompt_heavy) == sum(decode_heavy) == 8
    assert prompt_heavy[0] > decode_heavy[0] and min(*prompt_heavy, *decode_heavy) >= 1
    # A slow link lengthens each decode's share of a request: never fewer decodes.
    slow = advised_split(_one("d", 200, 2000), "llama-3.1-8b-a100", 8, kv_gbps=0.1, **kw)
    assert slow[1] >= decode_heavy[1]


def test_each_strategy_gets_the_same_gpus_and_its_own_settings() -> None:
    plan = StrategiesPlan(workloads=("mix",), interconnects_gbps=(25.0, 400.0))
    shapes = plan.shapes("mix")
    # Only disaggregation moves KV: one cluster per link for it, one for each other.
    assert [(s.strategy, s.kv_gbps) for s in shapes] == [
        ("aggregated", None), ("disaggregated", 25.0), ("disaggregated", 400.0), ("partial", None)
    ]  # fmt: skip
    for s in shapes:
        assert s.spec.prefills + s.spec.decodes == plan.gpus
        roles = {shim_role(s.mode, r) for r in ("prefill", "decode")}
        for role in ("prefill", "decode"):
            fields = shim_fields(s.spec, s.mode, role)
            settings = ShimSettings(role=shim_role(s.mode, role), **fields)
            if s.strategy == "disaggregated":
                assert settings.sim_kv_bandwidth_gbps == s.kv_gbps
            if s.strategy == "partial":
                assert settings.phases and settings.tpot_slo_s == plan.tpot_slo_s
        gateway = GatewaySettings(**gateway_fields(s.spec, s.mode))
        if s.strategy == "disaggregated":
            assert roles == {"prefill", "decode"} and s.instances == "7P+1D"
        else:
            assert roles == {"aggregated"} and s.spec.decodes == 0
        if s.strategy == "partial":
            assert gateway.tpot_slo_s == plan.tpot_slo_s
    # Every request is held to the plan's TPOT SLO beside its scenario's deadline.
    prompt = plan.workload_for("mix", 0).next_prompt(random.Random(1))
    assert prompt.scenario.tpot_slo_s == plan.tpot_slo_s
    deadlines = {s.ttft_deadline_s for s in workload_named("mix").scenarios}
    assert prompt.scenario.ttft_deadline_s in deadlines


def test_the_command_line_builds_the_plan_and_refuses_nonsense() -> None:
    p = argparse.ArgumentParser()
    command.configure(p)
    plan = command.plan_from_args(p.parse_args(["--quick", "--gpus=4", "--tpot-slo-ms=50"]))
    assert (plan.gpus, plan.tpot_slo_s, plan.workloads, plan.seeds) == (4, 0.05, ("mix",), (0,))
    plan = command.plan_from_args(p.parse_args(["--seeds=3", "--seed=7", "--loads=1,2"]))
    assert plan.seeds == (7, 8, 9) and plan.loads == (1.0, 2.0)
    assert plan.interconnects_gbps == (25.0, 400.0)
    for bad in (["--strategies=nodg"], ["--loads=0"], ["--workloads=nope"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)
    with pytest.raises(ValueError, match="at least 2 GPUs"):
        StrategiesPlan(gpus=1)


def _point(strategy: str, ok: int, seed: int) -> Point:
    rows = [RequestResult("chat", 1.0, 200, 0.1, 1.0, True, tpot_s=0.02, tpot_slo_s=0.1)] * ok
    rows += [RequestResult("chat", 1.0, 200, 0.1, 9.0, True, tpot_s=0.2, tpot_slo_s=0.1)] * (
        10 - ok
    )
    counters = {"shim_phase_switch_waits": 4.0, "shim_phase_switch_wait_s": 0.2}
    return Point(strategy, 4, summarize(rows, 2.0), counters, 0.1, 0.1, 0.2, {}, 2.0,
                 seed=seed, arrivals="poisson", rate_rps=5.0)  # fmt: skip


def test_the_json_line_has_each_strategy_by_load_in_every_setting() -> None:
    plan = StrategiesPlan(workloads=("mix",), interconnects_gbps=(25.0, 400.0), loads=(1.0,),
                          seeds=(0, 1, 2), gpus=8)  # fmt: skip
    outcomes = []
    for shape in plan.shapes("mix"):
        o = Outcome(shape, Capacity(8.0, True, ((4.0, 1.0), (8.0, 0.95), (16.0, 0.5))), [])
        o.points["1"] = [_point(shape.strategy, ok, seed) for seed, ok in enumerate((10, 8, 9))]
        outcomes.append(o)
    data = summary_json(Result(plan, outcomes))
    assert set(data["strategies"]) == {"aggregated", "disaggregated", "partial"}
    assert list(data["settings"]) == ["mix@25Gb/s", "mix@400Gb/s"]
    agg = data["strategies"]["aggregated"]
    assert agg["slo_attainment"] == {"1": pytest.approx(0.9)}  # median of 1, .8, .9
    assert agg["goodput_per_gpu"]["1"] == pytest.approx(9 / 2.0 / 8)
    assert agg["spread"]["slo_attainment"]["1"]["min"] == pytest.approx(0.8)
    assert agg["tpot_attainment"]["1"] == pytest.approx(0.9)
    assert agg["phase_switch_wait_s"]["1"] == pytest.approx(0.05)
    assert agg["capacity_per_gpu"] == 1.0 and agg["capacity_probes"][1] == [8.0, 0.95]
    # The most goodput at a load whose median attainment meets the 90% target.
    assert agg["sustained"] == {"load": "1", "goodput_per_gpu": pytest.approx(9 / 2.0 / 8)}
    assert sustained({**agg, "slo_attainment": {"1": 0.85}}, 0.9) == (None, 0.0)
    # The same aggregated run stands in both settings; disaggregation has one per link.
    assert data["settings"]["mix@400Gb/s"]["aggregated"] == agg
    assert data["settings"]["mix@400Gb/s"]["disaggregated"]["instances"] == "7P+1D"
    table = markdown(Result(plan, outcomes))
    assert "**mix@25Gb/s**" in table and "| partial | 8xpartial | 1.00 | 0.56 (at 1x) |" in table
    assert "80.0% / 90.0% / 100.0%" in table
