"""The bench's Python floor (loadtest/gateway_cost/floor.py), as its own process in front of
stock engines: it makes vLLM's two legs and relays the decode's stream byte for byte, so the
bench's figures for it are those of a working front."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest

from pdgate.config.wire import prefill_kv_request
from pdgate.loadtest.gateway_cost.shims import ShimSpec
from pdgate.loadtest.gateway_cost.stock import MODEL
from pdgate.loadtest.lib.children import Child

JSON = {"content-type": "application/json"}


@pytest.fixture
async def fronted() -> AsyncIterator[tuple[str, dict[str, list[str]]]]:
    """Stock engines (one prefill, one decode) and the floor in front of them."""
    spec = ShimSpec(registry_url=None, engine="stock", prefills=1, decodes=1)
    argv = [sys.executable, "-m", "pdgate.loadtest.gateway_cost.shims"]
    engines = Child("stock", [*argv, orjson.dumps(spec.to_json()).decode()], quits_on_eof=True)
    floor: Child | None = None
    try:
        urls = orjson.loads((await engines.start(r'\{"prefills".*\}')).group(0))
        argv = [sys.executable, "-m", "pdgate.loadtest.gateway_cost.floor",
                "--prefill", urls["prefills"][0], "--decode", urls["decodes"][0]]  # fmt: skip
        floor = Child("python_floor", argv)
        ready = await floor.start(r"python floor on (http://[\w.:]+)")
        yield ready.group(1), urls
    finally:
        if floor is not None:
            await floor.stop()
        await engines.stop()


async def _read(session: aiohttp.ClientSession, url: str, body: dict[str, object]) -> bytes:
    async with session.post(url, data=orjson.dumps(body), headers=JSON) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.read()


async def test_two_legs_then_the_decodes_stream_unchanged(
    fronted: tuple[str, dict[str, list[str]]],
) -> None:
    base, urls = fronted
    body = {"model": MODEL, "prompt": "floor", "max_tokens": 5, "stream": True}
    async with aiohttp.ClientSession() as session:
        through = await _read(session, base + "/v1/completions", body)
        # The same request made by hand: the prefill leg, then the decode with its params.
        prefill = urls["prefills"][0] + "/v1/completions"
        leg = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": prefill_kv_request()}
        async with session.post(prefill, data=orjson.dumps(leg), headers=JSON) as resp:
            params = (await resp.json())["kv_transfer_params"]
        direct = await _read(
            session, urls["decodes"][0] + "/v1/completions", {**body, "kv_transfer_params": params}
        )
        async with session.get(urls["decodes"][0] + "/_stats") as resp:
            stats = await resp.json()
    events = [e for e in through.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and len(events) == 6
    texts = [
        [orjson.loads(e[6:])["choices"][0]["text"] for e in raw.split(b"\n\n")[:-2]]
        for raw in (through, direct)
    ]
    assert texts[0] == texts[1]  # the decode's answer, relayed as it came
    assert stats["decode"] == 2 and stats["decode_with_kv"] == 2  # both carried the KV params


async def test_bad_requests_get_a_status_not_a_crash(
    fronted: tuple[str, dict[str, list[str]]],
) -> None:
    base, _ = fronted
    async with aiohttp.ClientSession() as session:
        async with session.post(base + "/v1/completions", data=b"{not json", headers=JSON) as r:
            assert r.status == 400
        async with session.get(base + "/v1/models") as r:
            assert r.status == 404
        # An engine's refusal is the floor's 502, and the floor serves on.
        bad = {"model": MODEL, "prompt": "x", "max_tokens": -1, "stream": True}
        async with session.post(base + "/v1/completions", data=orjson.dumps(bad)) as r:
            assert r.status == 502
            assert "error" in await r.json()
        good = {"model": MODEL, "prompt": "again", "max_tokens": 2, "stream": True}
        assert (await _read(session, base + "/v1/completions", good)).endswith(b"data: [DONE]\n\n")
