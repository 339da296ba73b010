"""The gateway bench's plain engine (loadtest/gateway_cost/stock.py), as its own process: vLLM's
P/D handshake and nothing of pdgate's, deterministic, and what it tells the benchmark."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Mapping

import aiohttp
import orjson
import pytest

from pdgate.config.wire import prefill_kv_request
from pdgate.loadtest.gateway_cost._timeline import SEGMENTS, Probe, segment_medians
from pdgate.loadtest.gateway_cost.shims import ShimSpec
from pdgate.loadtest.gateway_cost.stock import MODEL, prompt_key
from pdgate.loadtest.lib.children import Child

JSON = {"content-type": "application/json"}


async def _engines(tokenizer: bool) -> AsyncIterator[dict[str, list[str]]]:
    spec = ShimSpec(registry_url=None, engine="stock", prefills=1, decodes=1, tokenizer=tokenizer)
    argv = [sys.executable, "-m", "pdgate.loadtest.gateway_cost.shims"]
    child = Child("stock", [*argv, orjson.dumps(spec.to_json()).decode()], quits_on_eof=True)
    try:
        ready = await child.start(r'\{"prefills".*\}')
        yield orjson.loads(ready.group(0))
    finally:
        await child.stop()


@pytest.fixture
async def engines() -> AsyncIterator[dict[str, list[str]]]:
    async for urls in _engines(tokenizer=True):
        yield urls


async def _post(
    session: aiohttp.ClientSession, url: str, body: Mapping[str, object]
) -> tuple[int, bytes]:
    async with session.post(url, data=orjson.dumps(body), headers=JSON) as resp:
        return resp.status, await resp.read()


def _body(prompt: str, max_tokens: int, **extra: object) -> dict[str, object]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **extra}


async def test_handshake_then_a_deterministic_stream(engines: dict[str, list[str]]) -> None:
    prefill = engines["prefills"][0] + "/v1/completions"
    decode = engines["decodes"][0] + "/v1/completions"
    async with aiohttp.ClientSession() as session:
        leg = _body("hello there", 1, stream=False, kv_transfer_params=prefill_kv_request())
        status, raw = await _post(session, prefill, leg)
        assert status == 200
        params = orjson.loads(raw)["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert params["remote_port"] == int(engines["prefills"][0].rsplit(":", 1)[1])
        texts = []
        for _ in range(2):  # the same prompt gives the same text, whatever the request id
            status, raw = await _post(
                session, decode, _body("hello there", 3, stream=True, kv_transfer_params=params)
            )
            assert status == 200
            events = [e for e in raw.split(b"\n\n") if e]
            assert events[-1] == b"data: [DONE]" and len(events) == 4
            chunks = [orjson.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
            assert all(e.startswith(b'data: {"id"') for e in events[:-1])  # the bench's marker
            assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
            texts.append("".join(c["choices"][0]["text"] for c in chunks))
        assert texts[0] == texts[1] and texts[0]
        async with session.get(engines["decodes"][0] + "/_stats") as resp:
            stats = await resp.json()
        assert stats["decode"] == 2 and stats["decode_with_kv"] == 2
        assert stats["paths"] == {"POST /v1/completions": 2, "GET /_stats": 1}
        async with session.get(engines["prefills"][0] + "/_timeline") as resp:
            timeline = await resp.json()
        key = prompt_key("hello there")
        assert [row[:2] for row in timeline] == [[key, "prefill_in"], [key, "prefill_out"]]
        assert timeline[0][2] <= timeline[1][2]


async def test_no_pdgate_extension_and_openai_errors(engines: dict[str, list[str]]) -> None:
    base = engines["prefills"][0]
    async with aiohttp.ClientSession() as session:
        for path in ("/v1/completions/batch", "/load", "/v1/kv/x"):
            status, raw = await _post(session, base + path, _body("x", 1))
            assert status == 404, path
            assert set(orjson.loads(raw)["error"]) == {"message", "type", "param", "code"}
        async with session.post(base + "/v1/completions", data=b"{no", headers=JSON) as resp:
            assert resp.status == 400 and "error" in await resp.json()
        status, _ = await _post(session, base + "/v1/completions", {**_body("x", 1), "model": "m"})
        assert status == 404
        leg = _body("x", 2, kv_transfer_params=prefill_kv_request())  # a prefill leg wants 1
        assert (await _post(session, base + "/v1/completions", leg))[0] == 400
        assert (await _post(session, base + "/v1/completions", _body("x", 0)))[0] == 400
        status, raw = await _post(session, base + "/tokenize", {"model": MODEL, "prompt": "ab"})
        assert status == 200 and orjson.loads(raw)["tokens"] == [97, 98]


async def test_tokenizer_endpoints_can_be_off() -> None:
    async for urls in _engines(tokenizer=False):
        async with aiohttp.ClientSession() as session:
            for path in ("/tokenize", "/v1/completions/render"):
                body = {"model": MODEL, "prompt": "ab"}
                assert (await _post(session, urls["prefills"][0] + path, body))[0] == 404


def test_ttft_splits_into_hops_that_add_up() -> None:
    prompt = "ttft probe 0.1"
    key = prompt_key(prompt)
    timeline = {
        key: {"prefill_in": 10.001, "prefill_out": 10.002, "decode_in": 10.004,
              "first_out": 10.0045},
        prompt_key("seen by one engine only"): {"prefill_in": 11.0},
    }  # fmt: skip
    probes = [
        Probe("pdgate", prompt, start=10.0, ttft_s=0.005),
        Probe("pdgate", "seen by one engine only", start=11.0, ttft_s=0.1),
    ]
    parts = segment_medians(probes, timeline)
    assert list(parts) == ["pdgate"] and list(parts["pdgate"]) == list(SEGMENTS)
    assert parts["pdgate"]["to_prefill"] == pytest.approx(1.0)
    assert parts["pdgate"]["between_legs"] == pytest.approx(2.0)
    assert parts["pdgate"]["to_client"] == pytest.approx(0.5)
    assert sum(parts["pdgate"].values()) == pytest.approx(5.0)
