"""``pdgate bench hotpath``: pdgate's ASGI app over MockUpstream, driven in process."""

from __future__ import annotations

import asyncio

import pytest

from pdgate.loadtest import bench
from pdgate.loadtest.gateway_cost.hotpath import HotpathPlan, run_hotpath


async def test_each_round_reports_the_cpu_of_its_requests() -> None:
    plan = HotpathPlan(requests=40, concurrency=4, rounds=2, tokens=4, warmup=8)
    result = await run_hotpath(plan)
    assert len(result.us_per_request) == 2 and len(result.requests_per_s) == 2
    assert all(us > 0 for us in result.us_per_request)
    assert result.profile == ""
    text = result.report(plan, "pdgate bench hotpath")
    assert "| CPU us per request (min/median/max) |" in text and "cProfile" not in text


async def test_a_larger_fleet_is_registered_and_named() -> None:
    plan = HotpathPlan(requests=30, concurrency=6, rounds=1, tokens=2, warmup=6, instances=6)
    result = await run_hotpath(plan)
    assert len(result.us_per_request) == 1
    assert "(6 prefills and 6 decodes)" in result.report(plan, "x")


async def test_the_profile_names_pdgate_functions_per_request() -> None:
    plan = HotpathPlan(requests=20, concurrency=2, rounds=1, tokens=4, warmup=4, profile=True)
    result = await run_hotpath(plan)
    assert (
        "gateway/stream/relay.py" in result.profile
        and "gateway/api/completions.py" in result.profile
    )
    assert "include cProfile's overhead" in result.report(plan, "x")


async def test_a_refused_request_fails_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway's own settings come from the environment, as for ``pdgate gateway``:
    a token limit below the requests' makes every one a 400, and the run says so."""
    monkeypatch.setenv("PDGATE_GATEWAY_MAX_TOKENS_LIMIT", "2")
    with pytest.raises(RuntimeError, match=r"a request failed: \[400\]"):
        await run_hotpath(HotpathPlan(requests=4, concurrency=1, rounds=1, tokens=4, warmup=1))


def test_the_cli_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    code = bench.main(["hotpath", "--requests", "20", "--rounds", "1", "--tokens", "4"])
    assert code == 0
    out = capsys.readouterr().out
    assert out.startswith("`pdgate bench hotpath --requests 20") and "|---|---|" in out
    assert "on asyncio's event loop" in out


def test_the_cli_runs_on_uvloop_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    """As the deployed gateway runs; the process's loop policy is left as it was."""
    before = asyncio.get_event_loop_policy()
    code = bench.main(["hotpath", "--requests", "20", "--rounds", "1", "--tokens", "4", "--uvloop"])
    assert code == 0 and "on uvloop's event loop" in capsys.readouterr().out
    assert asyncio.get_event_loop_policy() is before


@pytest.mark.parametrize(
    ("stream", "migrations"),
    [(True, "2"), (True, "0"), (False, "2")],
    ids=["parsed", "bytes", "whole"],
)
async def test_requests_leave_no_cycles_for_the_collector(
    monkeypatch: pytest.MonkeyPatch, stream: bool, migrations: str
) -> None:
    """Every request's objects are freed by reference counting as it ends. A cycle (the
    prefill grant once held a closure over its call, whose waiter's future held the grant)
    leaves each request's waiter, leases and closures to the cyclic collector, whose young
    collections then cost in proportion to all of them. The relay's three paths: events
    parsed (migration on), bytes relayed (off) and a non-streaming answer assembled."""
    monkeypatch.setenv("PDGATE_GATEWAY_MAX_MIGRATIONS", migrations)
    plan = HotpathPlan(requests=200, concurrency=4, rounds=2, tokens=4, warmup=20, stream=stream)
    result = await run_hotpath(plan)
    assert result.garbage_per_request == [0.0, 0.0]
    assert f"{'streaming' if stream else 'non-streaming'} requests" in result.report(plan, "x")
