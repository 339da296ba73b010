"""What a scheduling run compares and refuses: modes with setting overrides, the series of a
plan (batch forwarding on/off, deployments, gateway counts), settings checked before start."""

from __future__ import annotations

import argparse
import itertools
import math
from dataclasses import replace

import pytest

from pdgate.loadtest.lib.router import router_argv
from pdgate.loadtest.scheduling import command, modes
from pdgate.loadtest.scheduling.capacity import Capacity, CapacityPlan
from pdgate.loadtest.scheduling.clusters import InProcessCluster
from pdgate.loadtest.scheduling.experiment import Plan, _router_options, levels_of
from pdgate.loadtest.scheduling.modes import (
    FEATURE_MODES,
    ClusterSpec,
    Mode,
    check_settings,
    gateway_fields,
    mode_named,
    shim_fields,
    shim_role,
)
from pdgate.loadtest.scheduling.open_loop import Arrivals


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    command.configure(parser)
    return parser.parse_args(list(argv))


def test_feature_modes_are_one_line_overrides() -> None:
    spec = ClusterSpec()
    fields = {m.name: gateway_fields(spec, m) for m in FEATURE_MODES}
    assert fields["least_tokens"]["prefill_policy"] == "least_tokens"
    assert fields["first_token_early"]["first_token_early"] is True
    assert fields["first_token_early"]["prefill_policy"] == "least_sse"
    assert fields["local_prefill"]["local_prefill_max_uncached_chars"] == 4000
    assert fields["affinity_overload"]["prefill_policy"] == "affinity_hold"
    for m in FEATURE_MODES:  # all on-demand forwarding: queue-less prefills, gateway queue
        assert (m.admission, fields[m.name]["dispatch"]) == ("reject", "queue")
    # A mode's overrides win over the cluster's extras, for the gateway and per shim role.
    mode = Mode("x", "reject", "queue", "least_sse", gateway={"batch_forwarding": False},
                prefill={"capacity": 3}, decode={"capacity": 7})  # fmt: skip
    spec = replace(spec, gateway={"batch_forwarding": True})
    assert gateway_fields(spec, mode)["batch_forwarding"] is False
    assert shim_fields(spec, mode, "prefill")["capacity"] == 3
    assert shim_fields(spec, mode, "decode")["capacity"] == 7
    # The aggregated mode starts every place as an aggregated instance with a decode's
    # slots; the others keep the roles.
    agg = mode_named("aggregated")
    assert [shim_role(agg, r) for r in ("prefill", "decode")] == ["aggregated", "aggregated"]
    assert shim_fields(spec, agg, "prefill")["capacity"] == spec.decode_capacity
    assert shim_role(mode, "prefill") == "prefill"
    check_settings(ClusterSpec(), agg)
    # The in-process cluster gets the mode itself, overrides included.
    assert Mode.from_json(mode.to_json()) == mode


def test_unknown_settings_fail_before_start_naming_the_mode() -> None:
    check_settings(ClusterSpec(), mode_named("least_sse"))  # known settings pass
    typo = Mode("typo", "reject", "queue", "least_sse", gateway={"batch_fowarding": True})
    with pytest.raises(ValueError, match=r"mode typo: (?s:.)*batch_fowarding"):
        check_settings(ClusterSpec(), typo)
    bad_shim = Mode("shim", "reject", "queue", "least_sse", decode={"no_such_field": 1})
    with pytest.raises(ValueError, match=r"mode shim: (?s:.)*no_such_field"):
        check_settings(ClusterSpec(), bad_shim)
    no_policy = Mode("pol", "reject", "queue", "no_such_policy")
    with pytest.raises(ValueError, match=r"mode pol: (?s:.)*no_such_policy"):
        check_settings(ClusterSpec(), no_policy)
    # A plan checks every series' mode and the calibrations' before anything runs.
    plan = Plan(modes=(mode_named("least_sse"), typo), base_users=2)
    with pytest.raises(ValueError, match="mode typo"):
        plan.check()


def test_the_command_refuses_an_unknown_setting_at_once(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mode whose setting the gateway does not know (a feature not merged yet, like the
    placeholder of affinity_overload) stops the run before any server starts: exit status
    2, the reason on stderr, nothing on stdout."""
    unknown = Mode("not_merged", "reject", "queue", "least_sse", gateway={"no_such_knob": 1})
    monkeypatch.setattr(modes, "FEATURE_MODES", (*modes.FEATURE_MODES, unknown))
    code = command.main(
        _args("--modes=least_sse,not_merged", "--base-users=2", "--capacity=off"), "cmd"
    )
    out = capsys.readouterr()
    assert code == 2 and out.out == ""
    assert "mode not_merged" in out.err and "no_such_knob" in out.err


def test_series_for_batch_forwarding_deploys_and_gateways() -> None:
    modes = (mode_named("baseline"), mode_named("least_sse"))
    plan = Plan(modes=modes, batch_forwarding=(True, False), deploys=("processes",),
                gateways=(1, 2), base_users=2)  # fmt: skip
    series = plan.series()
    # The baseline dispatches directly (no gateway queue): batch forwarding does not apply,
    # so it runs once per gateway count, not twice.
    assert [s.name for s in series] == [
        "baseline/g1", "baseline/g2",
        "least_sse+bf/g1", "least_sse+bf/g2", "least_sse-bf/g1", "least_sse-bf/g2",
    ]  # fmt: skip
    by_name = {s.name: s for s in series}
    assert by_name["least_sse-bf/g2"].gateways == 2
    assert (
        gateway_fields(ClusterSpec(), by_name["least_sse-bf/g1"].mode)["batch_forwarding"] is False
    )
    assert (
        gateway_fields(ClusterSpec(), by_name["least_sse+bf/g1"].mode)["batch_forwarding"] is True
    )
    assert "batch_forwarding" not in gateway_fields(ClusterSpec(), by_name["baseline/g1"].mode)
    # One value: the setting is applied, the names stay plain.
    one = replace(plan, batch_forwarding=(False,), gateways=(1,), deploys=("inprocess",))
    assert [s.name for s in one.series()] == ["baseline", "least_sse"]
    both = replace(one, deploys=("inprocess", "processes"), batch_forwarding=())
    assert [s.name for s in both.series()][:2] == ["baseline@inprocess", "baseline@processes"]


def test_a_fleet_needs_processes() -> None:
    with pytest.raises(ValueError, match="--deploy processes"):
        Plan(gateways=(1, 2))
    with pytest.raises(ValueError, match="--deploy processes"):
        Plan(gateways=(2,), deploys=("inprocess", "processes"))
    with pytest.raises(ValueError, match="not a fleet"):
        InProcessCluster(ClusterSpec(gateways=2), mode_named("least_sse"))
    Plan(gateways=(1, 2, 4), deploys=("processes",))  # fine


def test_open_loop_needs_a_capacity() -> None:
    with pytest.raises(ValueError, match="capacity"):
        Plan(arrivals=Arrivals("poisson"), capacity=CapacityPlan(how="off"))
    with pytest.raises(ValueError, match="unknown workload"):
        Plan(workload="nope")


def test_plan_from_args() -> None:
    plan = command.plan_from_args(
        _args("--prefill-slots=4", "--batch-forwarding=both", "--workload=shared-prefix",
              "--arrivals=bursty", "--burst-factor=3", "--capacity=20", "--user-rps=0.5",
              "--gateways=1,2,4", "--deploy=processes", "--calibrate-s=5", "--warmup-s=1")
    )  # fmt: skip
    assert plan.spec.prefill_capacity == 4 and plan.batch_forwarding == (True, False)
    assert plan.workload == "shared-prefix" and plan.gateways == (1, 2, 4)
    assert plan.arrivals == Arrivals("bursty", burst_factor=3.0)
    assert plan.capacity.fixed is not None and plan.capacity.fixed.rps == 20.0
    assert plan.capacity.fixed.rate(10) == 5.0
    assert (plan.calibration_timing.measure_s, plan.calibration_timing.warmup_s) == (5.0, 1.0)
    assert len(plan.seeds) == command.FULL_SEEDS == 5  # the full run: five seeds per point
    assert plan.capacity.how == "fixed"
    full = command.plan_from_args(_args())
    assert full.capacity.how == "measure" and len(full.seeds) == 5
    quick = command.plan_from_args(_args("--quick"))
    assert len(quick.seeds) == 1 and quick.capacity.fixed == command.QUICK_CAPACITY
    with pytest.raises(ValueError, match="--user-rps"):
        command.plan_from_args(_args("--capacity=20"))
    with pytest.raises(SystemExit):
        _args("--gateways=1,0")


def test_levels_as_multiples_of_a_or_shares_of_capacity() -> None:
    assert [(lv.key, lv.label, lv.users) for lv in levels_of(Plan(base_users=3), 3, None)] == [
        ("1", "1A", 3), ("2", "2A", 6), ("3", "3A", 9), ("4", "4A", 12),
    ]  # fmt: skip
    cap = Capacity(rps=10.0, user_rps=0.5)
    plan = Plan(load_fractions=(2.0, 0.5), capacity=CapacityPlan(how="fixed", fixed=cap))
    low, high = levels_of(plan, 4, cap)
    # Users whose demand is that share of capacity: 0.5 x 10 / 0.5 and 2 x 10 / 0.5.
    assert (low.key, low.label, low.users) == ("0.5c", "0.5x cap", 10)
    assert (high.key, high.users, high.rate(cap)) == ("2c", 40, 20.0)
    assert high.load_fraction(cap, open_loop=True) == 2.0
    assert math.isnan(high.load_fraction(None, open_loop=False))
    with pytest.raises(ValueError, match="capacity"):
        Plan(load_fractions=(1.0,), capacity=CapacityPlan(how="off"))
    with pytest.raises(ValueError, match="positive"):
        Plan(load_fractions=(0.0,))
    assert command.plan_from_args(_args("--load-fractions=0.5,2")).load_fractions == (0.5, 2.0)


def test_several_prefill_slot_counts_are_series_of_their_own() -> None:
    plan = command.plan_from_args(
        _args("--prefill-slots=1,4,8", "--gateways=1,2", "--deploy=processes", "--modes=least_sse")
    )
    assert plan.prefill_slots == (1, 4, 8)
    assert [(s.name, s.prefill_slots, s.gateways) for s in plan.series()] == [
        ("least_sse/s1/g1", 1, 1), ("least_sse/s1/g2", 1, 2),
        ("least_sse/s4/g1", 4, 1), ("least_sse/s4/g2", 4, 2),
        ("least_sse/s8/g1", 8, 1), ("least_sse/s8/g2", 8, 2),
    ]  # fmt: skip
    one = command.plan_from_args(_args("--prefill-slots=4"))
    assert one.prefill_slots == () and one.spec.prefill_capacity == 4
    assert [s.name for s in one.series()][:1] == [one.modes[0].name]
    assert "1, 4, 8 (rows /sK)" in command.describe(plan)
    with pytest.raises(SystemExit):
        _args("--prefill-slots=4,0")


def test_smg_modes_start_smg_with_its_prefill_queue_at_the_prefills_slots() -> None:
    """SMG's prefill admission: each prefill's slots in flight, the rest waiting up to the
    gateway's TTFT timeout, the mode's policy for the prefills; vllm-router's modes keep
    their one policy."""
    spec = replace(ClusterSpec(), prefill_capacity=4, gateway_ttft_timeout_s=9.5)
    plan = Plan()
    smg = _router_options(plan.router, modes.mode_named("smg_round_robin"), spec)
    argv = router_argv("smg", 8000, ["http://p0"], ["http://d0"], smg)
    flags = dict(itertools.pairwise(argv))
    assert argv[1:5] == ["launch", "--pd-disaggregation", "--backend", "vllm"]
    assert flags["--prefill-max-inflight-requests-per-worker"] == "4"
    assert flags["--prefill-queue-timeout-secs"] == "10"
    assert flags["--prefill-policy"] == "round_robin"
    vllm = _router_options(plan.router, modes.mode_named("router_round_robin"), spec)
    argv = router_argv("vllm-router", 8000, ["http://p0"], ["http://d0"], vllm)
    assert "--prefill-max-inflight-requests-per-worker" not in argv
    assert dict(itertools.pairwise(argv))["--policy"] == "round_robin"
