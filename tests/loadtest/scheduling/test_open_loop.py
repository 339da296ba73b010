"""The open loop: seeded Poisson and bursty arrivals at the asked mean rate, a client that
bounds itself against a server that stops answering, and the tenant headers on the wire."""

from __future__ import annotations

import asyncio
import itertools
import random
import statistics
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import orjson
import pytest
from aiohttp import web

from pdgate.loadtest.lib.sse import PRIORITY_HEADER, TENANT_HEADER, TTFT_HEADER
from pdgate.loadtest.lib.stats import DROPPED, summarize
from pdgate.loadtest.scheduling.closed_loop import ClosedLoop
from pdgate.loadtest.scheduling.open_loop import Arrivals, OpenLoop, arrival_times
from pdgate.loadtest.scheduling.workload import WORKLOADS, Workload
from tests.loadtest.scheduling._fake_server import completions_server


def _times(arrivals: Arrivals, rate: float, horizon: float, seed: int = 1) -> list[float]:
    times = arrival_times(arrivals, rate, random.Random(seed))
    return list(itertools.takewhile(lambda t: t < horizon, times))


def _per_second(times: list[float], horizon: int) -> list[int]:
    counts = [0] * horizon
    for t in times:
        counts[int(t)] += 1
    return counts


def test_poisson_mean_rate_and_seeding() -> None:
    times = _times(Arrivals("poisson"), 20.0, 2000.0)
    assert len(times) / 2000.0 == pytest.approx(20.0, rel=0.03)
    assert times == sorted(times)
    counts = _per_second(times, 2000)  # Poisson: variance of counts ~ their mean
    assert statistics.variance(counts) / statistics.mean(counts) == pytest.approx(1.0, abs=0.15)
    assert times[:50] == _times(Arrivals("poisson"), 20.0, 2000.0)[:50]
    assert times[:50] != _times(Arrivals("poisson"), 20.0, 2000.0, seed=2)[:50]


def test_bursty_keeps_the_mean_rate_and_bursts() -> None:
    bursty = Arrivals("bursty", burst_factor=4.0, burst_on_s=1.0)
    times = _times(bursty, 20.0, 4000.0)
    assert len(times) / 4000.0 == pytest.approx(20.0, rel=0.08)
    counts = _per_second(times, 4000)
    # ON a quarter of the time at 4x the rate: many silent seconds, and busy ones far above
    # the mean, where a Poisson process at the same rate has neither.
    silent = sum(c == 0 for c in counts) / len(counts)
    assert silent > 0.4
    assert statistics.variance(counts) / statistics.mean(counts) > 5
    poisson = _per_second(_times(Arrivals("poisson"), 20.0, 4000.0), 4000)
    assert sum(c == 0 for c in poisson) == 0
    with pytest.raises(ValueError, match="burst"):
        Arrivals("bursty", burst_factor=1.0)
    with pytest.raises(ValueError, match="unknown arrivals"):
        Arrivals("weekly")


def test_in_flight_bound_default() -> None:
    assert Arrivals("poisson").in_flight_bound(2) == 16  # the floor
    assert Arrivals("poisson").in_flight_bound(24) == 96  # 4x the level's users
    assert Arrivals("poisson", max_in_flight=5).in_flight_bound(24) == 5


@dataclass
class _Server:
    url: str
    release: asyncio.Event = field(default_factory=asyncio.Event)
    open_now: int = 0
    most_open: int = 0
    seen: list[dict[str, str]] = field(default_factory=list)


@pytest.fixture
async def server() -> AsyncIterator[_Server]:
    """A completions server that records each request's headers and answers a short
    stream, or, until `release` is set, hangs (a collapsed server)."""
    state = _Server("")

    async def complete(request: web.Request) -> web.StreamResponse:
        state.seen.append(dict(request.headers))
        state.open_now += 1
        state.most_open = max(state.most_open, state.open_now)
        try:
            await state.release.wait()
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            chunk = {"id": "c", "choices": [{"index": 0, "text": " a"}]}
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\ndata: [DONE]\n\n")
            return resp
        finally:
            state.open_now -= 1

    async with completions_server(complete) as state.url:
        try:
            yield state
        finally:
            state.release.set()


async def test_a_hung_server_cannot_grow_the_client(server: _Server) -> None:
    workload = Workload(seed=3)
    async with aiohttp.ClientSession() as session:
        loop = OpenLoop(session, [server.url], "m", workload, Arrivals("poisson"), 200.0,
                        max_in_flight=5)  # fmt: skip
        loop.start()
        loop.open_window()
        await asyncio.sleep(0.5)
        window = loop.close_window()
        assert server.most_open <= 5  # never more than the bound at the server
        # About 100 arrivals: 5 sent and hanging, the rest dropped as failures.
        assert loop.issued >= 50 and loop.dropped >= loop.issued - 5
        cancelled = await loop.stop(0.2)  # the hung ones are cancelled, nothing outlives it
        assert cancelled == 5
    dropped = [r for r in loop.results if r.status == DROPPED]
    assert len(dropped) >= len(loop.results) - 5 > 0
    summary = summarize(loop.results, window)
    assert summary.dropped == len(dropped) and summary.success_rate == 0.0


async def test_open_loop_serves_at_its_rate_when_the_server_keeps_up(server: _Server) -> None:
    server.release.set()
    spec = WORKLOADS["tenants"]
    workload = Workload(spec.scenarios, seed=4, tenants=spec.tenants)
    async with aiohttp.ClientSession() as session:
        loop = OpenLoop(session, [server.url, server.url], "m", workload, Arrivals("poisson"),
                        100.0, max_in_flight=50)  # fmt: skip
        loop.start()
        loop.open_window()
        await asyncio.sleep(1.0)
        window = loop.close_window()
        assert await loop.stop(5.0) == 0
    summary = summarize(loop.results, window)
    assert summary.dropped == 0 and summary.success_rate == 1.0
    assert summary.offered_rps == pytest.approx(100.0, rel=0.35)
    assert set(summary.success_by_gateway) == {0, 1}  # arrival i to gateway i mod 2
    assert sum(summary.requests_by_gateway.values()) == summary.requests
    assert abs(summary.requests_by_gateway[0] - summary.requests_by_gateway[1]) <= 1
    assert set(summary.success_by_tenant) == {t.name for t in spec.tenants}
    heavy = sum(r.tenant == "heavy" for r in loop.results) / len(loop.results)
    assert heavy == pytest.approx(0.5, abs=0.2)  # 3 of 6 weight units


async def test_tenant_headers_on_the_wire(server: _Server) -> None:
    """The closed loop sends each user's tenant and priority class as the gateway's headers,
    next to the scenario's deadline; a workload without tenants sends none."""
    server.release.set()
    spec = WORKLOADS["tenants"]
    async with aiohttp.ClientSession() as session:
        for workload in (Workload(spec.scenarios, seed=5, tenants=spec.tenants), Workload()):
            loop = ClosedLoop(session, [server.url], "m", workload, 6, ramp_s=0.0)
            loop.start()
            await asyncio.sleep(0.2)
            assert await loop.stop(5.0) == 0
    with_tenants = [h for h in server.seen if TENANT_HEADER in h]
    without = [h for h in server.seen if TENANT_HEADER not in h]
    assert with_tenants and without
    assert {h[TENANT_HEADER] for h in with_tenants} == {t.name for t in spec.tenants}
    assert {h[PRIORITY_HEADER] for h in with_tenants} == {"normal"}
    assert all(TTFT_HEADER in h and PRIORITY_HEADER not in h for h in without)
