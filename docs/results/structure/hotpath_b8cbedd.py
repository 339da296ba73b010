"""`pdgate bench hotpath`'s measurement for b8cbedd, the commit before issue 10's work.

b8cbedd has neither the hotpath benchmark nor `MockUpstream`, so this script runs the
benchmark's driver (loadtest/gateway_cost/_asgi.py, loaded from this tree by path: the
gateway's ASGI app in process, called as uvicorn calls it, `CONCURRENCY` loops of streaming
completions whose decodes send one-token events, one a chunk) over a minimal stand-in for
b8cbedd's `Upstream` class. It is run from a checkout of b8cbedd,
with that checkout's environment (see docs/results/structure/README.md):

    git worktree add /tmp/base b8cbedd && make -C /tmp/base install
    env -C /tmp/base .venv/bin/python "$PWD/docs/results/structure/hotpath_b8cbedd.py" --tokens 16
    (add --uvloop to run on uvloop, as `pdgate bench hotpath --uvloop` does)

It prints the CPU µs per request (min/median/max over the rounds), as
`pdgate bench hotpath` does. The stand-in does less than `MockUpstream` (no call records,
no handler, no task per batch member), so b8cbedd's figure is, if anything, slightly low.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import statistics
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson

# b8cbedd's own modules: they resolve in its checkout, not in this tree.
import gateway.app as gateway_app
from config.settings import GatewaySettings, RegistrySettings, Role
from registry import open_registry
from registry.base import InstanceRecord

MODEL = "sim-llama-3.1-8b"
CONCURRENCY = 8


def _load_driver() -> Any:
    """This tree's driver module: it imports nothing of pdgate's, so it loads in b8cbedd's
    environment, where pdgate's package is not installed."""
    path = Path(__file__).resolve().parents[3] / "loadtest" / "gateway_cost" / "_asgi.py"
    spec = importlib.util.spec_from_file_location("_pdgate_asgi_driver", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


async def main(tokens: int, rounds: int, requests: int, warmup: int) -> None:
    driver = _load_driver()
    StandInUpstream.chunks = [*driver.decode_events(tokens, MODEL), b"data: [DONE]\n\n"]
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

    us: list[float] = []
    async with driver.Lifespan(app) as state:
        await driver.requests(app, state, body, warmup, CONCURRENCY)
        for _ in range(rounds):
            gc.collect()
            cpu = time.process_time()
            await driver.requests(app, state, body, requests, CONCURRENCY)
            us.append(1e6 * (time.process_time() - cpu) / requests)
    print(f"| {min(us):.1f}/{statistics.median(us):.1f}/{max(us):.1f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--warmup", type=int, default=400)
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop, as deployed")
    args = parser.parse_args()
    if args.uvloop:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    asyncio.run(main(args.tokens, args.rounds, args.requests, args.warmup))
