"""The Retry-After every 503 and 429 carries (gateway/admission/retry_after.py), through a
real gateway server: the figure from what the gateway knows, in ``Retry-After`` (whole
seconds), ``retry-after-ms`` and the error body, on every API it serves, and at the gateway's
own limits (``max_pending``, ``max_uploads``). The queue's own
figures are pinned in tests/gateway/placement/test_admission.py; the key's rate limit in
tests/gateway/admission/test_auth.py."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from pdgate.config import GatewaySettings, QueueOrder, RegistrySettings, Role
from pdgate.config.server import bind_socket, bound_port, serving
from pdgate.gateway.api.completions import TTFT_HEADER
from pdgate.gateway.app import build_gateway_app
from pdgate.gateway.upstream.mock import MockUpstream, Reply
from pdgate.registry import InstanceRecord, MemoryRegistry
from tests.gateway._fakes import FakeCluster, eventually


@asynccontextmanager
async def _gateway(
    *, instances: bool, poll_s: float = 1.0, prefill_delay_s: float = 0.0, **settings: Any
) -> AsyncIterator[str]:
    """A gateway server on a memory registry, with one prefill of one slot and one decode
    (`instances`) or none, before `MockUpstream` instances."""
    registry = MemoryRegistry()
    if instances:
        for role, capacity in ((Role.PREFILL, 1), (Role.DECODE, 64)):
            record = InstanceRecord(
                id=role.value, role=role, url=f"http://{role.value}", model="m",
                capacity=capacity,
            )  # fmt: skip
            await registry.put(record, ttl_s=60)
    app = build_gateway_app(
        GatewaySettings(port=0, **settings),
        registry,
        RegistrySettings(poll_interval_s=poll_s),
        upstream=MockUpstream(FakeCluster(prefill_delay_s=prefill_delay_s)),
    )
    sock = bind_socket("127.0.0.1", 0)
    async with serving(app, sock):
        yield f"http://127.0.0.1:{bound_port(sock)}"


def _told(resp: httpx.Response, shape: str = "openai") -> float:
    """The wait `resp` tells, checked to be the same in its headers and its body."""
    assert resp.status_code in (429, 503), resp.text
    error = resp.json()["error"]
    if shape == "anthropic":
        assert resp.json()["type"] == "error"
    seconds = error["retry_after"]
    assert isinstance(seconds, float | int)
    assert resp.headers["retry-after-ms"] == str(round(seconds * 1000))
    assert resp.headers["retry-after"] == str(math.ceil(seconds))
    return float(seconds)


_CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
_REQUESTS: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2}, "openai"),
    ("/v1/chat/completions", _CHAT, "openai"),
    ("/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 2}, "openai"),
    ("/v1/messages", {"model": "m", "max_tokens": 2, "messages": _CHAT["messages"]}, "anthropic"),
    ("/v1/messages/count_tokens", {"model": "m", "messages": _CHAT["messages"]}, "anthropic"),
    ("/v1/embeddings", {"model": "m", "input": "hi"}, "openai"),
]


@pytest.mark.parametrize(("path", "body", "shape"), _REQUESTS, ids=[r[0] for r in _REQUESTS])
async def test_no_instance_tells_the_wait_until_the_gateway_next_reads_the_fleet(
    path: str, body: dict[str, Any], shape: str
) -> None:
    """With no instance registered, a new one shows at the gateway's next read of the
    membership: the registry's poll interval (2.5 s here), not a fixed second."""
    async with _gateway(instances=False, poll_s=2.5) as url, httpx.AsyncClient() as client:
        resp = await client.post(url + path, json=body)
        assert resp.status_code == 503
        assert _told(resp, shape) == 2.5


async def test_a_request_the_queue_cannot_reach_is_told_when_it_would() -> None:
    """One prefill slot, 0.05 s a prompt (some 20 grants a second), a FIFO queue of some 60
    requests due in 30 s: a request due in half a second is refused on arrival (drain
    admission), told to come back once the pace has served all but the few it reaches in
    its half second: some 2.5 s, where a fixed second would bring it back to the same
    queue."""
    async with (
        _gateway(instances=True, prefill_delay_s=0.05, queue_order=QueueOrder.FIFO) as url,
        httpx.AsyncClient(timeout=60) as client,
    ):

        async def post(ttft_ms: int) -> httpx.Response:
            return await client.post(
                url + "/v1/completions",
                json={"model": "m", "prompt": "hi", "max_tokens": 2},
                headers={TTFT_HEADER: str(ttft_ms)},
            )

        async def paced() -> bool:
            """Drain admission counts on a pace (it shows on /metrics once it has one)."""
            return "pdgate_queue_drain_pace{" in (await client.get(url + "/metrics")).text

        backlog = [asyncio.create_task(post(30_000)) for _ in range(80)]
        try:
            waited = time.monotonic() + 20.0  # saturated for over a second: the pace is known
            while not await paced():
                assert time.monotonic() < waited, "no drain pace after 20 s of backlog"
                await asyncio.sleep(0.05)
            resp = await post(500)
            told = _told(resp)
            assert resp.json()["error"]["code"] == "gateway_overloaded"
            # Some 2.5 s at this pace; a loaded machine's slower pace tells more, but never
            # past the backlog's own deadline, when all ahead of it has gone.
            assert 1.5 < told <= 30.0
        finally:
            for task in backlog:
                task.cancel()
            await asyncio.gather(*backlog, return_exceptions=True)


_PROMPT = {"model": "m", "prompt": "hi", "max_tokens": 2}


async def _told_at_a_limit(
    send: Callable[[], Awaitable[httpx.Response]], message: str
) -> tuple[float, float]:
    """A client keeps one request at a time in the gateway with `send`, while another tries
    until it is refused with `message`: what it was told, and one over the rate the
    requests have been leaving the count, as their answers came (the first finished some
    five before)."""
    left: list[float] = []

    async def one() -> httpx.Response:
        resp = await send()
        if resp.status_code == 200:
            left.append(time.monotonic())
        return resp

    async def keep_one() -> None:
        while True:
            if (await one()).status_code != 200:
                await asyncio.sleep(0.01)  # the other got in: its turn first

    feeder = asyncio.create_task(keep_one())
    try:
        await eventually(lambda: len(left) >= 6, timeout_s=20)
        while (resp := await one()).status_code == 200:
            pass  # it got in between two of the feeder's: once more
        told = _told(resp)
        rate = (len(left) - 1) / (time.monotonic() - left[0])
    finally:
        feeder.cancel()
        await asyncio.gather(feeder, return_exceptions=True)
    assert resp.status_code == 503 and resp.json()["error"]["message"] == message
    return told, 1 / rate


async def test_a_request_past_max_pending_is_told_when_a_pending_one_will_have_finished() -> None:
    """``max_pending`` 1, held by one request after another, each some 0.2 s (one prefill
    slot, 0.2 s a prompt): a request beyond it is told when the pending one will likely
    have finished, one over the rate they have been finishing at (some 0.2 s), not the
    floor (0.01 s here)."""
    async with (
        _gateway(instances=True, prefill_delay_s=0.2, max_pending=1, retry_after_s=0.01) as url,
        httpx.AsyncClient(timeout=30) as client,
    ):
        told, expected = await _told_at_a_limit(
            lambda: client.post(url + "/v1/completions", json=_PROMPT),
            "the gateway is at its limit of pending requests",
        )
        assert 0.15 < told == pytest.approx(expected, rel=0.25)


async def test_a_request_past_max_uploads_is_told_when_an_upload_will_have_finished() -> None:
    """``max_uploads`` 1, held by one upload after another, each some 0.2 s (its body's
    second half 0.2 s after the first): a request beyond it is told when the upload will
    likely have finished (some 0.2 s), not the floor (0.01 s here)."""

    async def slow_body() -> AsyncIterator[bytes]:
        yield b'{"model": "m", '
        await asyncio.sleep(0.2)
        yield b'"prompt": "hi", "max_tokens": 2}'

    async with (
        _gateway(instances=True, max_uploads=1, retry_after_s=0.01) as url,
        httpx.AsyncClient(timeout=30) as client,
    ):
        told, expected = await _told_at_a_limit(
            lambda: client.post(url + "/v1/completions", content=slow_body()),
            "the gateway is at its limit of requests being uploaded",
        )
        assert 0.15 < told == pytest.approx(expected, rel=0.25)


async def test_tokens_no_instance_could_count_tell_the_wait_for_the_next_read_of_the_fleet() -> (
    None
):
    """Every instance of the model failed to count (the mock serves no tokenizer): others
    may join at the gateway's next read of the membership, 2.5 s here, not a fixed second."""
    async with (
        _gateway(instances=True, poll_s=2.5, retry_after_s=0.01) as url,
        httpx.AsyncClient() as client,
    ):
        resp = await client.post(url + _REQUESTS[4][0], json=_REQUESTS[4][1])
        assert "could count the tokens" in resp.json()["error"]["message"]
        assert _told(resp, "anthropic") == 2.5


async def test_a_side_request_every_instance_failed_until_its_deadline_tells_the_poll_wait() -> (
    None
):
    """The one instance serving /v1/embeddings answers 500, after the request's deadline:
    another instance may show at the gateway's next read of the membership, 2.5 s here, not
    the floor (0.01 s)."""
    registry = MemoryRegistry()
    record = InstanceRecord(
        id="pool", role=Role.AGGREGATED, url="http://pool", model="m", capacity=1,
        endpoints=("/v1/embeddings",),
    )  # fmt: skip
    await registry.put(record, ttl_s=60)

    async def failing(call: Any) -> Any:
        await asyncio.sleep(0.7)  # past the 0.5 s deadline: its one call
        return Reply(status=500, json={})

    settings = GatewaySettings(
        port=0, retry_after_s=0.01, ttft_timeout_s=0.5, eject_after_failures=1000,
        retry_budget_burst=1000,
    )  # fmt: skip
    app = build_gateway_app(
        settings, registry, RegistrySettings(poll_interval_s=2.5), upstream=MockUpstream(failing)
    )
    sock = bind_socket("127.0.0.1", 0)
    async with serving(app, sock), httpx.AsyncClient(timeout=30) as client:
        url = f"http://127.0.0.1:{bound_port(sock)}"
        resp = await client.post(url + "/v1/embeddings", json={"model": "m", "input": "hi"})
        assert "before the request's deadline" in resp.json()["error"]["message"], resp.text
        assert _told(resp) == 2.5
