"""``pdgate bench compare``: builds named on the command line, an open loop at the offered
rate, turns that rotate, and real (tiny) runs of this checkout's gateway against itself."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys

import pytest

from pdgate.loadtest import bench
from pdgate.loadtest.gateway_cost.compare import (
    ComparePlan,
    GatewayBuild,
    Window,
    parse_builds,
    report,
    run_compare,
)

THIS = f"{shlex.quote(sys.executable)} -m pdgate.config.cli"


def _redis_or_fail() -> None:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server not installed (make redis-server)")


def test_builds_default_to_this_checkout() -> None:
    (build,) = parse_builds([], [])
    assert build.name == "this"
    assert build.argv == (sys.executable, "-m", "pdgate.config.cli")


def test_settings_go_to_their_build_only() -> None:
    builds = parse_builds(
        ["old=env -C /src/old /src/old/.venv/bin/python -m gateway.cli", f"new={THIS}"],
        ["new:PDGATE_GATEWAY_MAX_MIGRATIONS=0", "new:A=b=c"],
    )
    assert [b.name for b in builds] == ["old", "new"]
    assert builds[0].argv[:3] == ("env", "-C", "/src/old") and builds[0].env == {}
    assert builds[1].env == {"PDGATE_GATEWAY_MAX_MIGRATIONS": "0", "A": "b=c"}


@pytest.mark.parametrize(
    ("specs", "sets"),
    [
        (["nameless"], []),
        (["a="], []),
        ([f"a={THIS}", f"a={THIS}"], []),  # names are unique
        ([f"a={THIS}"], ["b:K=V"]),  # a setting of an unknown build
        ([f"a={THIS}"], ["a:K"]),
    ],
)
def test_bad_specs_are_refused(specs: list[str], sets: list[str]) -> None:
    with pytest.raises(ValueError, match="expected"):
        parse_builds(specs, sets)


def test_the_cli_refuses_a_bad_spec_with_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["compare", "--gateway", "nameless"]) == 2
    assert "NAME=COMMAND" in capsys.readouterr().err


def test_report_has_spreads_and_ratios_of_medians() -> None:
    plan = ComparePlan((GatewayBuild("a", ("x",)), GatewayBuild("b", ("y",))), rates=(100.0,))
    windows = [
        Window("a", 100.0, 99.0, 0, 0, 1.0),
        Window("a", 100.0, 100.0, 0, 0, 2.0),
        Window("a", 100.0, 101.0, 0, 0, 3.0),
        Window("b", 100.0, 100.0, 1, 2, 3.0),
        Window("b", 100.0, 100.0, 0, 0, 4.0),
        Window("b", 100.0, 100.0, 0, 0, 9.0),
    ]
    text = report(plan, windows, "pdgate bench compare")
    assert "| 100 | a | 99/100/101 | 0 | 1.000/2.000/3.000 | 1.00 |" in text
    assert "| 100 | b | 100/100/100 | 3 | 3.000/4.000/9.000 | 2.00 |" in text


def test_a_first_build_measured_at_no_cpu_has_no_ratio() -> None:
    """A short window can hold less than one clock tick of a gateway's CPU: the report then
    says so instead of dividing by zero (a tiny pinned run failed so)."""
    plan = ComparePlan((GatewayBuild("a", ("x",)), GatewayBuild("b", ("y",))), rates=(20.0,))
    windows = [Window("a", 20.0, 20.0, 0, 0, 0.0), Window("b", 20.0, 20.0, 0, 0, 1.0)]
    text = report(plan, windows, "x")
    assert "| 20 | a | 20/20/20 | 0 | 0.000/0.000/0.000 | n/a |" in text
    assert "| 20 | b | 20/20/20 | 0 | 1.000/1.000/1.000 | n/a |" in text


async def test_a_tiny_run_offers_the_rate_to_each_build_in_rotating_turns() -> None:
    _redis_or_fail()
    plan = ComparePlan(
        parse_builds([f"a={THIS}", f"b={THIS}"], ["b:PDGATE_GATEWAY_MAX_MIGRATIONS=0"]),
        rates=(40.0,), rounds=2, warmup_s=0.2, window_s=1.0,
    )  # fmt: skip
    windows = await run_compare(plan, lambda _: None)
    assert [w.build for w in windows] == ["a", "b", "b", "a"]
    for w in windows:
        assert w.failed == 0 and w.lost == 0
        # An open loop: the rate is the schedule's, whatever the gateway's latency.
        assert 20 <= w.achieved <= 60, w
        assert w.cpu_ms > 0


async def test_a_setting_reaches_its_own_gateway_only() -> None:
    """With a token limit below the warm-up's, b refuses every request and a does not."""
    _redis_or_fail()
    plan = ComparePlan(
        parse_builds([f"a={THIS}", f"b={THIS}"], ["b:PDGATE_GATEWAY_MAX_TOKENS_LIMIT=2"]),
        rates=(10.0,), rounds=1, warmup_s=0.1, window_s=0.2,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match=r"^b: warm-up request failed"):
        await run_compare(plan, lambda _: None)


async def test_pin_puts_the_gateways_on_a_cpu_of_their_own_and_gives_ours_back() -> None:
    _redis_or_fail()
    before = os.sched_getaffinity(0)
    assert len(before) >= 2, "the pinned comparison needs two CPUs"
    seen: dict[int, set[int]] = {}

    def log(line: str) -> None:
        # Read while the gateways run: each one's affinity, and this process's.
        if line.startswith("pinned: "):
            for pid in re.findall(r"\(pid (\d+)\)", line):
                seen[int(pid)] = os.sched_getaffinity(int(pid))
            seen[0] = os.sched_getaffinity(0)

    plan = ComparePlan(
        parse_builds([f"a={THIS}", f"b={THIS}"], []),
        rates=(20.0,), rounds=1, warmup_s=0.1, window_s=0.5, pin=True,
    )  # fmt: skip
    windows = await run_compare(plan, log)
    assert [w.failed for w in windows] == [0, 0]
    gateway_cpu = max(before)
    assert len(seen) == 3
    assert seen.pop(0) == before - {gateway_cpu}
    assert list(seen.values()) == [{gateway_cpu}, {gateway_cpu}]
    assert os.sched_getaffinity(0) == before
    assert "each on a CPU of its own (--pin)" in report(plan, windows, "x")
