"""What both roles share (engine_shim/_service.py), on real sockets: the body deadline and
one id per completion."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from pdgate.config import Role
from tests.engine_shim.conftest import Shim, StartShim, prefill_body, sse_events


async def _stalled_upload(shim: Shim, path: str) -> tuple[bytes, float]:
    """Send headers and part of the body, then nothing; the answer and how long it took."""
    host, port = shim.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        writer.write(
            f"POST {path} HTTP/1.1\r\nhost: shim\r\ncontent-type: application/json\r\n"
            "content-length: 100\r\n\r\n".encode()
            + b'{"prompt": "st'
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        return head, loop.time() - started
    finally:
        writer.close()


@pytest.mark.parametrize(
    ("role", "path"),
    [
        (Role.PREFILL, "/v1/completions"),
        (Role.PREFILL, "/v1/completions/batch"),
        (Role.DECODE, "/v1/completions"),
    ],
)
async def test_a_stalled_upload_gets_408(start_shim: StartShim, role: Role, path: str) -> None:
    shim = await start_shim(role, capacity=1, body_timeout_s=0.3)
    head, took = await _stalled_upload(shim, path)
    assert head.startswith(b"HTTP/1.1 408 "), head
    assert took >= 0.3  # at the body timeout, not before
    load = await shim.load()
    assert (load["used"], load["admitted"]) == (0, 0)


async def test_the_completion_id_is_the_callers_request_id(start_shim: StartShim) -> None:
    prefill = await start_shim(Role.PREFILL, capacity=4)
    decode = await start_shim(Role.DECODE, capacity=4)

    async def prefill_id(headers: dict[str, str]) -> tuple[str, dict[str, Any]]:
        async with prefill.http.post(
            prefill.url + "/v1/completions", data=orjson.dumps(prefill_body()), headers=headers
        ) as resp:
            body = await resp.json()
            assert resp.status == 200, body
            return body["id"], body["kv_transfer_params"]

    rid = "req-0123456789abcdef"
    got, params = await prefill_id({"x-request-id": rid})
    assert got == rid
    decode_body = {
        "prompt": prefill_body()["prompt"],
        "max_tokens": 3,
        "kv_transfer_params": params,
    }
    async with decode.http.post(
        decode.url + "/v1/completions",
        data=orjson.dumps(
            {**decode_body, "stream": True, "stream_options": {"include_usage": True}}
        ),
        headers={"x-request-id": rid},
    ) as resp:
        events = await sse_events(resp)
    assert events[-1] == "[DONE]"
    assert {e["id"] for e in events[:-1]} == {rid}  # every chunk, the usage chunk too

    _, params = await prefill_id({})
    async with decode.http.post(
        decode.url + "/v1/completions",
        data=orjson.dumps({**decode_body, "kv_transfer_params": params}),
        headers={"x-request-id": rid},
    ) as resp:
        assert (await resp.json())["id"] == rid

    # No id, or one unfit to echo: a fresh one.
    for headers in ({}, {"x-request-id": "x" * 200}):
        got, params = await prefill_id(headers)
        assert got.startswith("cmpl-")
        assert len(got) == len("cmpl-") + 32
        async with prefill.http.delete(f"{prefill.url}/v1/kv/{params['remote_request_id']}"):
            pass


@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE])
async def test_a_shim_answers_what_vllm_answers_for_its_models_and_version(
    start_shim: StartShim, role: Role
) -> None:
    """Routers that identify a vLLM backend by these (SMG, vllm-router) can front a shim."""
    shim = await start_shim(role, max_model_len=4096)
    async with shim.http.get(shim.url + "/v1/models") as resp:
        assert resp.status == 200
        models = await resp.json()
    assert models["object"] == "list"
    (model,) = models["data"]
    assert (model["id"], model["object"], model["owned_by"]) == (
        shim.settings.model,
        "model",
        "vllm",
    )
    assert model["max_model_len"] == 4096 and model["root"] == shim.settings.model
    async with shim.http.get(shim.url + "/version") as resp:
        assert resp.status == 200
        assert isinstance((await resp.json())["version"], str)
