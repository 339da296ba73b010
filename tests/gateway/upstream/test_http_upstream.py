"""Both upstream clients, `HttpUpstream` (aiohttp) and `H1Upstream` (pdgate's own), against a
real HTTP server: a decode stream that starts and then goes silent (a hung or SIGSTOP'd
decode) is given up after the stall timeout; silence before its first data (the decode
pulling KV, or queueing) is not a stall."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from pdgate.gateway.errors import UpstreamUnreachable
from tests.gateway.upstream._server import Client, both_clients, connect, event_stream, serving


@pytest.fixture
async def decode() -> AsyncIterator[str]:
    """``/first-then-silence``: one event, then nothing; ``/slow-start``: nothing for 0.8 s,
    then an event and the end."""

    done = asyncio.Event()

    async def first_then_silence(request: web.Request) -> web.StreamResponse:
        resp = await event_stream(request)
        await resp.write(b'data: {"n": 1}\n\n')
        await done.wait()  # silent until the test ends
        return resp

    async def slow_start(request: web.Request) -> web.StreamResponse:
        resp = await event_stream(request)
        await asyncio.sleep(0.8)
        await resp.write(b'data: {"n": 1}\n\ndata: [DONE]\n\n')
        return resp

    async with serving(
        {"/first-then-silence": first_then_silence, "/slow-start": slow_start}
    ) as url:
        yield url
        done.set()


@both_clients
async def test_a_stream_that_goes_silent_after_its_first_data_is_given_up(
    decode: str, client: Client
) -> None:
    upstream = connect(client, stall_timeout_s=0.4)
    try:
        stream = await upstream.open_decode(
            decode, {}, request_id="r", connect_timeout_s=1, path="/first-then-silence"
        )
        assert await stream.read(1024) == b'data: {"n": 1}\n\n'
        # Given up by the stall limit: the read timeout is past the test's time limit.
        with pytest.raises(UpstreamUnreachable, match=r"decode (stalled|silent)"):
            await stream.read(1024)
        stream.close()
        # Before its first data the decode may be pulling KV or queueing: not a stall.
        slow = await upstream.open_decode(
            decode, {}, request_id="r", connect_timeout_s=1, path="/slow-start"
        )
        assert b"[DONE]" in await slow.read(1024) + await slow.read(1024)
        slow.close()
    finally:
        await upstream.aclose()
