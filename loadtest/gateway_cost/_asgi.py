"""Driving a gateway's ASGI app in process, as uvicorn drives it: `pdgate bench hotpath`'s
requests, and the same driver for an older checkout's gateway (docs/results/structure/
hotpath_*.py loads this file by path). So it imports nothing of pdgate's."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

__all__ = ["Lifespan", "decode_events", "request", "requests"]


def decode_events(tokens: int, model: str) -> list[bytes]:
    """A vLLM-shaped stream asked for ``return_token_ids`` (the gateway asks it when migration
    is on), with an id of the decode's own: one token an event (the caller adds [DONE])."""
    out = []
    for i in range(tokens):
        event = {
            "id": "cmpl-decode",
            "object": "text_completion",
            "created": 1,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "text": " tok",
                    "logprobs": None,
                    "finish_reason": "length" if i == tokens - 1 else None,
                    "stop_reason": None,
                    "token_ids": [100 + i],
                }
            ],
            "usage": None,
        }
        out.append(b"data: " + orjson.dumps(event) + b"\n\n")
    return out


class Lifespan:
    """The app's ASGI lifespan, driven as uvicorn drives it."""

    def __init__(self, app: Any) -> None:
        self._app = app
        self.state: dict[str, Any] = {}
        self._in: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._out: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def _message(self, kind: str) -> None:
        await self._in.put({"type": f"lifespan.{kind}"})
        reply = await self._out.get()
        if reply["type"] != f"lifespan.{kind}.complete":
            raise RuntimeError(f"lifespan {kind} failed: {reply}")

    async def __aenter__(self) -> dict[str, Any]:
        scope = {"type": "lifespan", "state": self.state, "asgi": {"version": "3.0"}}
        self._task = asyncio.create_task(self._app(scope, self._in.get, self._out.put))
        await self._message("startup")
        return self.state

    async def __aexit__(self, *exc: object) -> None:
        await self._message("shutdown")
        if self._task is not None:
            await self._task


async def request(app: Any, state: dict[str, Any], body: bytes) -> None:
    """One ``POST /v1/completions`` with `body`; raises unless the answer is a 200."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "query_string": b"", "root_path": "", "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 40000), "state": state,
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())],
    }  # fmt: skip
    sent = False
    status: list[int] = []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client stays: cancelled when the response ends
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])

    await app(scope, receive, send)
    if status != [200]:
        raise RuntimeError(f"a request failed: {status}")


async def requests(app: Any, state: dict[str, Any], body: bytes, n: int, concurrency: int) -> None:
    """`n` requests over `concurrency` loops, each sending its next when the last ended."""

    async def loop(count: int) -> None:
        for _ in range(count):
            await request(app, state, body)

    share, extra = divmod(n, concurrency)
    await asyncio.gather(*(loop(share + (i < extra)) for i in range(concurrency)))
