"""`pdgate bench hotpath`'s measurement for b8cbedd, the commit before issue 10's work.

b8cbedd has neither the hotpath benchmark nor `MockUpstream`, so this script carries the
same driver (the gateway's ASGI app in process, called as uvicorn calls it, `CONCURRENCY`
loops of streaming completions whose decodes send one-token events, one a chunk) over a
minimal stand-in for b8cbedd's `Upstream` class. It is run from a checkout of b8cbedd,
with that checkout's environment (see docs/structure.md):

    git worktree add /tmp/base b8cbedd && make -C /tmp/base install
    env -C /tmp/base .venv/bin/python "$PWD/docs/structure/hotpath_b8cbedd.py" --tokens 16

It prints the CPU µs per request (min/median/max over the rounds), as
`pdgate bench hotpath` does. The stand-in does less than `MockUpstream` (no call records,
no handler, no task per batch member), so b8cbedd's figure is, if anything, slightly low.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson

# b8cbedd's own modules: they resolve in its checkout, not in this tree.
import gateway.app as gateway_app
from config.settings import GatewaySettings, RegistrySettings, Role
from registry import open_registry
from registry.base import InstanceRecord

MODEL = "sim-llama-3.1-8b"
CONCURRENCY = 8


def decode_chunks(tokens: int) -> list[bytes]:
    """The events `pdgate bench hotpath` streams: one token each, ids included."""
    out = []
    for i in range(tokens):
        choice = {"index": 0, "text": " tok", "logprobs": None,
                  "finish_reason": "length" if i == tokens - 1 else None,
                  "stop_reason": None, "token_ids": [100 + i]}  # fmt: skip
        event = {"id": "cmpl-decode", "object": "text_completion", "created": 1, "model": MODEL,
                 "choices": [choice], "usage": None}  # fmt: skip
        out.append(b"data: " + orjson.dumps(event) + b"\n\n")
    return [*out, b"data: [DONE]\n\n"]


def prefill_answer(kv_id: str) -> dict[str, Any]:
    params = {"do_remote_prefill": True, "remote_host": "h", "remote_port": 1,
              "remote_request_id": kv_id}  # fmt: skip
    return {"choices": [{"text": "x", "token_ids": [1]}], "usage": {"prompt_tokens": 24},
            "kv_transfer_params": params}  # fmt: skip


class _Content:
    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = chunks

    async def iter_chunked(self, size: int) -> AsyncIterator[bytes]:
        for chunk in self._chunks:
            yield chunk


class _Response:
    status = 200

    def __init__(self, url: str, chunks: list[bytes]) -> None:
        self.url = url
        self.content = _Content(chunks)
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def release(self) -> None:
        pass


class StandInUpstream:
    """b8cbedd's `Upstream` methods, answering as pdgate's shims would, without sockets:
    bodies are serialised and answers parsed as the real class does."""

    chunks: list[bytes] = []

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    async def prefill(
        self, base_url: str, body: dict[str, Any], *, request_id: str, timeout_s: float,
        kv_id: str | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        orjson.dumps(body)
        await asyncio.sleep(0)
        answer: dict[str, Any] = orjson.loads(orjson.dumps(prefill_answer(kv_id or "kv")))
        return answer

    async def prefill_batch(
        self, base_url: str, bodies: list[dict[str, Any]], *, kv_ids: list[str],
        request_id: str, timeout_s: float,
    ) -> AsyncIterator[tuple[int, int, dict[str, Any]]]:  # fmt: skip
        orjson.dumps({"requests": bodies, "kv_ids": kv_ids})
        await asyncio.sleep(0)
        for i, kv_id in enumerate(kv_ids):
            line = orjson.dumps({"index": i, "status": 200, "body": prefill_answer(kv_id)})
            item = orjson.loads(line)
            yield int(item["index"]), int(item["status"]), item["body"]

    async def open_decode(
        self, base_url: str, body: dict[str, Any], *, request_id: str, connect_timeout_s: float
    ) -> _Response:
        orjson.dumps(body)
        await asyncio.sleep(0)
        return _Response(base_url + "/v1/completions", self.chunks)

    async def release_kv_id(self, *args: object, **kwargs: object) -> None:
        pass

    async def release_kv(self, *args: object, **kwargs: object) -> None:
        pass


class Lifespan:
    def __init__(self, app: Any) -> None:
        self._app = app
        self.state: dict[str, Any] = {}
        self._in: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._out: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

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
        await self._task


async def one(app: Any, state: dict[str, Any], body: bytes) -> None:
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
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])

    await app(scope, receive, send)
    if status != [200]:
        raise RuntimeError(f"a request failed: {status}")


async def main(tokens: int, rounds: int, requests: int, warmup: int) -> None:
    StandInUpstream.chunks = decode_chunks(tokens)
    gateway_app.Upstream = StandInUpstream
    registry = open_registry(RegistrySettings())
    for role in (Role.PREFILL, Role.DECODE):
        for i in range(2):
            name = f"{role.value}{i}"
            record = InstanceRecord(id=name, role=role, url=f"http://{name}", model=MODEL,
                                    capacity=1024)  # fmt: skip
            await registry.put(record, ttl_s=3600)
    app = gateway_app.build_gateway_app(GatewaySettings.load(), registry, RegistrySettings())
    body = orjson.dumps({"model": MODEL, "prompt": "hello world " * 8, "max_tokens": tokens,
                         "stream": True, "temperature": 0})  # fmt: skip

    async def run(n: int, state: dict[str, Any]) -> None:
        async def loop(count: int) -> None:
            for _ in range(count):
                await one(app, state, body)

        share, extra = divmod(n, CONCURRENCY)
        await asyncio.gather(*(loop(share + (i < extra)) for i in range(CONCURRENCY)))

    us: list[float] = []
    async with Lifespan(app) as state:
        await run(warmup, state)
        for _ in range(rounds):
            gc.collect()
            cpu = time.process_time()
            await run(requests, state)
            us.append(1e6 * (time.process_time() - cpu) / requests)
    print(f"| {min(us):.1f}/{statistics.median(us):.1f}/{max(us):.1f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--warmup", type=int, default=400)
    args = parser.parse_args()
    asyncio.run(main(args.tokens, args.rounds, args.requests, args.warmup))
