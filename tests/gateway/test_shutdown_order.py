"""Shutdown order: a KV release (``DELETE /v1/kv/{id}``) that an abandoned request started is
still in flight when the gateway is told to stop; it must finish (the prefill answers it and
the gateway reads the answer) before the gateway's upstream session closes.

A real ``pdgate gateway`` process fronts a fake prefill and a fake decode on real sockets: the
prefill accepts at once, the decode never answers, the client leaves while the gateway waits
for the decode, and the prefill takes its time over the release. SIGTERM arrives while the
release is pending. Closing the session first would cut the release's connection, which the
prefill sees as a disconnect.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tests._cluster import Subprocess, gateway_url, start, wait_for
from tests.gateway._threaded import ThreadedInstances

MODEL = "shutdown-model"
RELEASE_S = 1.0  # how long the prefill takes to answer a release


class FakeInstances(ThreadedInstances):
    """One app on two ports: a prefill (accepts, names itself for the KV) and a decode that
    never answers. Counts what happened to each release."""

    model = MODEL

    def __init__(self) -> None:
        super().__init__(ports=2)
        self.prefill_url, self.decode_url = self.urls
        self.state: dict[str, int] = {
            "decode_legs": 0,
            "release_started": 0,
            "release_completed": 0,
            "release_cut": 0,
        }

    async def completions(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            choice = {"index": 0, "text": " a", "finish_reason": "length"}
            params = self.kv_params("kv-1")
            return JSONResponse(
                {"id": "x", "choices": [choice], "kv_transfer_params": params, "model": MODEL}
            )
        self.state["decode_legs"] += 1
        await asyncio.sleep(3600)  # the decode never answers
        return Response(status_code=500)

    async def release(self, request: Request) -> Response:
        self.state["release_started"] += 1
        await asyncio.sleep(RELEASE_S)
        if await request.is_disconnected():
            self.state["release_cut"] += 1
        else:
            self.state["release_completed"] += 1
        return Response(status_code=204)


@pytest.fixture
def fakes() -> Iterator[FakeInstances]:
    with FakeInstances() as f:
        yield f


def _send_then_leave(url: str, fakes: FakeInstances) -> None:
    """A streaming request whose client disconnects while the gateway waits for the decode."""
    host, port = url.removeprefix("http://").split(":")
    body = orjson.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 4, "stream": True})
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=5) as client:
        client.sendall(head + body)
        wait_for(lambda: fakes.state["decode_legs"] == 1, what="the decode leg sent")


def test_a_pending_kv_release_finishes_before_the_upstream_session_closes(
    fakes: FakeInstances, procs: list[Subprocess]
) -> None:
    env: dict[str, Any] = {
        "PDGATE_GATEWAY_TTFT_TIMEOUT_S": "30",
        "PDGATE_GATEWAY_DECODE_HEADER_TIMEOUT_S": "30",
    }
    # They speak pdgate's wire (a stock server's KV is never released by DELETE).
    args = ["gateway", "--port", "0", "--prefill", f"{fakes.prefill_url} connector=pdgate"]
    gw = start(procs, [*args, "--decode", f"{fakes.decode_url} connector=pdgate"], env)
    _send_then_leave(gateway_url(gw), fakes)
    # The abandoned request's KV is released at the prefill ...
    wait_for(lambda: fakes.state["release_started"] == 1, what="the release sent")
    # ... and the gateway is told to stop while the prefill is still answering it.
    assert gw.terminate(timeout=20) == 0
    # It waited for the release to be answered, then closed the session.
    assert fakes.state["release_completed"] == 1, (fakes.state, "".join(gw.lines[-20:]))
    assert fakes.state["release_cut"] == 0
