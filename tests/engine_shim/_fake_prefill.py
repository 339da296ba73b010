"""Fake prefills for the decode's KV pull: registered servers that answer ``GET /v1/kv/{id}``
as a test wants (corrupt KV, KV of another prompt, slowly, or never)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pdgate.config import Role
from pdgate.config.server import bind_socket, bound_port, serving
from pdgate.config.wire import KV_DIGEST_HEADER, KV_TOKENS_HEADER
from pdgate.registry.base import InstanceRecord
from pdgate.registry.memory import MemoryRegistry
from tests.engine_shim.conftest import MODEL, Shim

PROMPT = "Tell me a story about disaggregated inference."


async def register_prefill(registry: MemoryRegistry, port: int) -> None:
    """A prefill record for 127.0.0.1:`port`: decodes pull KV from registered prefills only."""
    record = InstanceRecord(
        id=f"fake-prefill-{port}", role=Role.PREFILL, url=f"http://127.0.0.1:{port}", model=MODEL
    )
    await registry.put(record, ttl_s=60, announce=True)


@contextlib.asynccontextmanager
async def fake_prefill(handler: Any, registry: MemoryRegistry) -> AsyncIterator[int]:
    """A registered server answering ``GET /v1/kv/{id}`` with `handler`; yields its port."""
    sock = bind_socket("127.0.0.1", 0)
    app = Starlette(routes=[Route("/v1/kv/{request_id}", handler, methods=["GET", "DELETE"])])
    await register_prefill(registry, bound_port(sock))
    async with serving(app, sock):
        yield bound_port(sock)


def kv_params(port: int, rid: str = "abcdefgh") -> dict[str, Any]:
    """``kv_transfer_params`` naming KV `rid` at the prefill on `port`."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "fake",
        "remote_host": "127.0.0.1",
        "remote_port": port,
        "remote_block_ids": [0],
        "remote_request_id": rid,
        "tp_size": 1,
    }


def kv_response(tokens: int, body: bytes, digest: str | None = None) -> Response:
    return Response(
        body,
        media_type="application/octet-stream",
        headers={
            KV_TOKENS_HEADER: str(tokens),
            KV_DIGEST_HEADER: digest or hashlib.blake2b(body, digest_size=16).hexdigest(),
        },
    )


@contextlib.asynccontextmanager
async def stuck_pull(
    decode: Shim, registry: MemoryRegistry
) -> AsyncIterator[aiohttp.ClientResponse]:
    """A streaming request on `decode` whose KV pull hangs at a fake prefill, holding one of
    the decode's retrieval workers until the block ends; yields its open response once the
    pull has reached the fake prefill."""
    pulled = asyncio.Event()
    unstick = asyncio.Event()

    async def stuck(request: Request) -> Response:
        pulled.set()
        await unstick.wait()
        return Response(status_code=500)

    async with fake_prefill(stuck, registry) as port, contextlib.AsyncExitStack() as stack:
        stack.callback(unstick.set)  # lets the fake server shut down at once
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True}
        resp = await decode.http.post(
            decode.url + "/v1/completions",
            data=orjson.dumps({**body, "kv_transfer_params": kv_params(port)}),
        )
        stack.callback(resp.close)
        assert resp.status == 200
        await asyncio.wait_for(pulled.wait(), 2)
        yield resp
