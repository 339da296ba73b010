"""A gateway told to stop (SIGTERM) answers every request it holds: those waiting for a
prefill get 503 ``shutting_down`` at once (their clients can go to another gateway); those
placed go on until the server's grace ends, and then get the same error, in-band once they
stream, rather than a cut connection or a plain 500 and a traceback each.

A real ``pdgate gateway`` process fronts a fake prefill of one slot and a fake decode on
real sockets: the prefill answers at once, except for prompts saying "hang"; the decode
sends one token and then only keep-alive comments.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from tests._cluster import Subprocess, gateway_url, start
from tests.gateway._fakes import eventually
from tests.gateway._threaded import ThreadedInstances

MODEL = "stopping-model"


class FakeInstances(ThreadedInstances):
    model = MODEL

    def __init__(self) -> None:
        super().__init__(ports=2)
        self.prefill_url, self.decode_url = self.urls
        self.prefill_calls = 0

    async def completions(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            self.prefill_calls += 1
            if "hang" in body["prompt"]:
                await asyncio.sleep(3600)
            choice = {"index": 0, "text": " a", "finish_reason": "length"}
            params = self.kv_params("kv0123456789")
            return JSONResponse({"id": "x", "choices": [choice], "kv_transfer_params": params})

        async def one_token_then_nothing() -> Any:
            choice = {"index": 0, "text": " a", "logprobs": None, "finish_reason": None}
            event = {"id": "d", "object": "text_completion", "model": MODEL, "choices": [choice]}
            yield b"data: " + orjson.dumps(event) + b"\n\n"
            while True:  # alive (a stall would end the stream) but no more tokens
                await asyncio.sleep(0.5)
                yield b": ping\n\n"

        return StreamingResponse(one_token_then_nothing(), media_type="text/event-stream")


@pytest.fixture
def fakes() -> Iterator[FakeInstances]:
    with FakeInstances() as f:
        yield f


async def _collect(url: str, prompt: str, *, stream: bool, out: dict[str, Any]) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "stream": stream}
    async with (
        httpx.AsyncClient(timeout=60) as client,
        client.stream("POST", url + "/v1/completions", json=body) as resp,
    ):
        out["status"] = resp.status_code
        out["chunks"] = []
        async for chunk in resp.aiter_bytes():
            out["chunks"].append(chunk)
            out.setdefault("first_at", time.monotonic())
    out["ended_at"] = time.monotonic()


def test_a_stopping_gateway_answers_what_it_holds(
    fakes: FakeInstances, procs: list[Subprocess]
) -> None:
    env = {"PDGATE_GATEWAY_TTFT_TIMEOUT_S": "60", "PDGATE_GATEWAY_DECODE_HEADER_TIMEOUT_S": "60"}
    args = ["gateway", "--port", "0", "--prefill", f"{fakes.prefill_url} capacity=1"]
    gw = start(procs, [*args, "--decode", fakes.decode_url], env)
    url = gateway_url(gw)
    results: dict[str, dict[str, Any]] = {k: {} for k in ("streaming", "held", "q1", "q2")}

    async def scenario() -> float:
        streaming = asyncio.create_task(_collect(url, "go", stream=True, out=results["streaming"]))
        await eventually(lambda: "first_at" in results["streaming"])  # its prefill slot free
        held = asyncio.create_task(_collect(url, "hang", stream=False, out=results["held"]))
        await eventually(lambda: fakes.prefill_calls == 2)  # the one slot is the held one's
        queued = [
            asyncio.create_task(_collect(url, "hang too", stream=True, out=results[k]))
            for k in ("q1", "q2")
        ]
        await asyncio.sleep(0.5)  # both queued at the gateway
        stopped = time.monotonic()
        gw.proc.terminate()
        await asyncio.gather(streaming, held, *queued)
        return stopped

    stopped = asyncio.run(scenario())
    assert gw.proc.wait(timeout=20) == 0
    for key in ("q1", "q2"):  # refused at once, not at the grace's end
        queued = results[key]
        assert queued["status"] == 503, queued
        assert orjson.loads(b"".join(queued["chunks"]))["error"]["code"] == "shutting_down"
        assert queued["ended_at"] - stopped < 2.0
    held = results["held"]  # placed: answered when the grace ended
    assert held["status"] == 503
    assert orjson.loads(b"".join(held["chunks"]))["error"]["code"] == "shutting_down"
    stream = b"".join(results["streaming"]["chunks"])  # streaming: an in-band error, then DONE
    assert results["streaming"]["status"] == 200
    assert b'"code":"shutting_down"' in stream and stream.endswith(b"data: [DONE]\n\n")
    output = "".join(gw.lines)
    assert "Traceback" not in output and "Exception in ASGI application" not in output, output
