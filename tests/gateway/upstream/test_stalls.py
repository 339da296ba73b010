"""Stall detection from the decode's own pace (gateway/upstream/stalls.py), for both upstream
clients against a real HTTP server: a decode that streamed every few milliseconds and then
stops is given up on after a bound learned from its gaps, not the fixed ceiling; and when it
answers none of its streams, every stream on it is given up at once (`DecodeSilent`), the
one still waiting for its first data included."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
from aiohttp import web

from pdgate.gateway.errors import DecodeSilent
from pdgate.gateway.upstream.stalls import DecodePace, StallBound
from tests.gateway.upstream._server import Client, both_clients, connect, event_stream, serving

EVENTS = 120
CEILING_S = 20.0
BOUND = StallBound(floor_s=0.3, ceiling_s=CEILING_S, factor=8.0, min_samples=50)


def test_the_bound_is_a_multiple_of_the_decode_s_high_quantile_within_floor_and_ceiling() -> None:
    pace = DecodePace()
    assert pace.limit_s(BOUND) == CEILING_S  # nothing known yet: the ceiling
    for _ in range(99):
        pace.heard(0.01, 1.0)
    pace.heard(0.2, 1.0)  # one slow step in a hundred: the 0.99 quantile
    assert pace.limit_s(BOUND) == pytest.approx(8 * 0.2)
    fast = DecodePace()
    for _ in range(100):
        fast.heard(0.001, 1.0)
    assert fast.limit_s(BOUND) == BOUND.floor_s  # 8 ms would be too eager: the floor
    slow = DecodePace()
    for _ in range(100):
        slow.heard(10.0, 1.0)
    assert slow.limit_s(BOUND) == CEILING_S
    first = DecodePace()
    first.heard(None, 5.0)  # a stream's first data: the KV's pull, not the pace
    assert first.limit_s(BOUND) == CEILING_S and first.heard_at == 5.0
    # A decode that has not streamed enough yet is judged by every decode's waits.
    every = DecodePace()
    known, new = DecodePace(every), DecodePace(every)
    for _ in range(99):
        known.heard(0.05, 1.0)
    known.heard(0.1, 1.0)
    assert new.limit_s(BOUND) == known.limit_s(BOUND) == pytest.approx(8 * 0.1)


@pytest.fixture
async def decode() -> AsyncIterator[str]:
    """``/paced``: an event every 2 ms, then silence; ``/never``: silence from the start
    (a stream whose decode is still pulling its KV)."""
    done = asyncio.Event()

    async def paced(request: web.Request) -> web.StreamResponse:
        resp = await event_stream(request)
        for n in range(EVENTS):
            await resp.write(b'data: {"n": %d}\n\n' % n)
            await asyncio.sleep(0.002)
        await done.wait()
        return resp

    async def never(request: web.Request) -> web.StreamResponse:
        resp = await event_stream(request)
        await done.wait()
        return resp

    async with serving({"/paced": paced, "/never": never}) as url:
        yield url
        done.set()


@both_clients
async def test_a_decode_that_stops_is_given_up_on_its_own_pace_with_all_its_streams(
    decode: str, client: Client
) -> None:
    # A ceiling (and read timeout) past the test's time limit: only the pace can give up.
    upstream = connect(client, stall_bound=replace(BOUND, ceiling_s=600.0))
    try:
        waiting = await upstream.open_decode(
            decode, {}, request_id="w", connect_timeout_s=1, path="/never"
        )
        pending = asyncio.ensure_future(waiting.read(1024))
        stream = await upstream.open_decode(
            decode, {}, request_id="r", connect_timeout_s=1, path="/paced"
        )
        seen = b""
        while seen.count(b"\n\n") < EVENTS:
            seen += await stream.read(65536)
        with pytest.raises(DecodeSilent):
            await stream.read(1024)
        # Its other stream, which never had data, went with it.
        with pytest.raises(DecodeSilent):
            await pending
        stream.close()
        waiting.close()
    finally:
        await upstream.aclose()
