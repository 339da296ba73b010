"""The bench's clients (loadtest/scheduling/clients.py) against a server that refuses each
request's first try with 503 and a Retry-After: ``instant`` moves on, ``honour`` (a closed
loop's users or an open loop's arrivals) and the official openai client wait what they are
told (its milliseconds, read first) and are served on their first retry, which the summary
counts."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import aiohttp
import orjson
import pytest
from aiohttp import web

from pdgate.loadtest.lib.stats import RequestResult, summarize
from pdgate.loadtest.scheduling._load import LoadGenerator
from pdgate.loadtest.scheduling.clients import OpenAIUser, send_honouring
from pdgate.loadtest.scheduling.closed_loop import ClosedLoop
from pdgate.loadtest.scheduling.open_loop import Arrivals, OpenLoop
from pdgate.loadtest.scheduling.workload import Prompt, Scenario, Workload
from tests.loadtest.scheduling._fake_server import completions_server

_SCENARIO = Scenario("chat", prefix_tokens=0, body_min=1, body_max=1, max_tokens=4,
                     ttft_deadline_s=10.0)  # fmt: skip


@dataclass
class _Refusing:
    """Refuses every prompt's first try (503, ``retry-after-ms: 300``, ``Retry-After: 5``:
    a client that reads the seconds waits far longer), streams the second."""

    url: str = ""
    tries: dict[str, list[float]] = field(default_factory=dict)  # prompt -> when each came

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        prompt = str(body.get("prompt") or body["messages"][0]["content"])
        seen = self.tries.setdefault(prompt, [])
        seen.append(time.monotonic())
        if len(seen) == 1:
            error = {"error": {"message": "busy", "type": "service_unavailable", "param": None,
                               "code": "gateway_overloaded", "retry_after": 0.3}}  # fmt: skip
            headers = {"retry-after-ms": "300", "retry-after": "5"}
            return web.json_response(error, status=503, headers=headers)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for piece in ("a", "b"):
            chunk = {"id": "c", "object": "text_completion", "created": 0, "model": "m",
                     "choices": [{"index": 0, "text": piece, "finish_reason": None,
                                  "logprobs": None}]}  # fmt: skip
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp


@asynccontextmanager
async def _server() -> AsyncIterator[_Refusing]:
    server = _Refusing()
    async with completions_server(server.handle) as server.url:
        yield server


def _served_on_the_first_retry(server: _Refusing, prompt: str) -> None:
    first, retry = server.tries[prompt]
    assert 0.3 <= retry - first < 5.0  # the milliseconds, not the whole seconds


async def test_honour_waits_the_retry_after_it_is_told_and_retries_the_same_request() -> None:
    async with _server() as server, aiohttp.ClientSession() as session:
        result = await send_honouring(
            session, server.url, "m", Prompt(_SCENARIO, "p1", 1), gateway=0
        )
    assert (result.status, result.attempts, result.success) == (200, 2, True)
    _served_on_the_first_retry(server, "p1")


async def test_the_openai_client_retries_by_its_own_policy_reading_retry_after_ms() -> None:
    async with _server() as server:
        user = OpenAIUser(server.url, "m")
        try:
            result = await user.send(Prompt(_SCENARIO, "p2", 1), gateway=3)
        finally:
            await user.aclose()
    assert (result.status, result.attempts, result.completed, result.gateway) == (200, 2, True, 3)
    assert result.ttft_s is not None and result.success
    _served_on_the_first_retry(server, "p2")
    summary = summarize([result], 1.0)
    assert (summary.retried, summary.first_retry_success) == (1, 1.0)


async def _one_second(loop: LoadGenerator) -> None:
    """Run `loop` through a one-second window; nothing may be left running after it."""
    loop.start()
    loop.open_window()
    await asyncio.sleep(1.0)
    loop.close_window()
    assert await loop.stop(5.0) == 0


def _each_refusal_handled(client: str, results: list[RequestResult]) -> None:
    """`instant` records each refusal and moves on; the others are served on their first
    retry."""
    summary = summarize(results, 1.0)
    if client == "instant":
        assert summary.retried == 0 and {r.status for r in results} == {503}
    else:
        assert summary.retried == len(results) and summary.first_retry_success == 1.0


@pytest.mark.parametrize("client", ["instant", "honour", "openai"])
async def test_a_closed_loops_users_run_each_client(client: str) -> None:
    """Every try is refused at first: `instant` users record each refusal and move on, the
    others are served on their first retry."""
    async with _server() as server, aiohttp.ClientSession() as session:
        loop = ClosedLoop(session, [server.url], "m", Workload(seed=7), 2, ramp_s=0.0,
                          client=client)  # fmt: skip
        await _one_second(loop)
    assert loop.results
    _each_refusal_handled(client, loop.results)


@pytest.mark.parametrize("client", ["instant", "honour"])
async def test_an_open_loops_arrivals_run_each_client(client: str) -> None:
    """Arrivals at a rate, each refused at first: `instant` records the refusal, `honour`
    sends it again after the Retry-After and is served on that retry."""
    async with _server() as server, aiohttp.ClientSession() as session:
        arrivals = Arrivals("poisson", client=client)
        loop = OpenLoop(session, [server.url], "m", Workload(seed=8), arrivals, 20.0,
                        max_in_flight=50)  # fmt: skip
        await _one_second(loop)
    assert len(loop.results) >= 5
    _each_refusal_handled(client, loop.results)
    if client == "honour":
        for prompt in server.tries:
            _served_on_the_first_retry(server, prompt)


def test_the_openai_client_needs_a_closed_loop() -> None:
    assert "sent again after the Retry-After" in Arrivals("bursty", client="honour").describe()
    with pytest.raises(ValueError, match="closed loop"):
        Arrivals("poisson", client="openai")
    with pytest.raises(ValueError, match="unknown client"):
        Arrivals(client="patient")
