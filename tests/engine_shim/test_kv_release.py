"""A decode's client that leaves right after the response headers, while the decode's KV pull
has not reached the prefill yet (still queued behind busy retrieval workers, or its
connection not yet served): the prefill's slot must come back at once, not after the
prefill's hold timeout (issue 9). Real prefill and decode shims on real sockets."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson

from pdgate.config import Role
from pdgate.registry.memory import MemoryRegistry
from tests.engine_shim._fake_prefill import PROMPT, register_prefill, stuck_pull
from tests.engine_shim.conftest import MODEL, Shim, StartShim, wait_load

HOLD_S = 30.0  # the prefill's backstop; the slot must be back long before it


async def _leave_after_headers(decode: Shim, params: dict[str, Any]) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "stream": True}
    resp = await decode.http.post(
        decode.url + "/v1/completions", data=orjson.dumps({**body, "kv_transfer_params": params})
    )
    assert resp.status == 200
    resp.close()


async def test_a_queued_pull_is_released_when_its_client_leaves(
    start_shim: StartShim, registry: MemoryRegistry
) -> None:
    prefill = await start_shim(Role.PREFILL, capacity=2, kv_hold_timeout_s=HOLD_S)
    decode = await start_shim(
        Role.DECODE, capacity=4, kv_retrieval_workers=1, kv_fetch_timeout_s=HOLD_S
    )
    # Another request keeps the only retrieval worker busy (its client stays).
    async with stuck_pull(decode, registry):
        reply = await prefill.prefilled(PROMPT)
        await _leave_after_headers(decode, reply["kv_transfer_params"])
        load = await wait_load(prefill, "used", 0, within=2.0)
        assert (load["kv_released"], load["kv_held"]) == (1, 0)
        assert (await decode.load())["retrieving"] == 1  # the other pull is still stuck


@contextlib.asynccontextmanager
async def _stalling_proxy(target_port: int) -> AsyncIterator[tuple[int, asyncio.Event]]:
    """A TCP proxy to `target_port` whose first connection is accepted but never forwarded
    (a request stuck on its way); later connections pass. Yields its port and an event set
    once the stuck connection has sent its request."""
    stuck = asyncio.Event()
    connections = 0
    writers: list[asyncio.StreamWriter] = []

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        writers.append(writer)
        if connections == 1:
            await reader.readuntil(b"\r\n\r\n")
            stuck.set()
            with contextlib.suppress(OSError):
                await reader.read()  # until the client gives up
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target_port)
        writers.append(up_writer)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], stuck
    finally:
        server.close()
        for writer in writers:
            writer.close()
        await server.wait_closed()


async def test_a_pull_not_yet_served_is_released_when_its_client_leaves(
    start_shim: StartShim, registry: MemoryRegistry
) -> None:
    prefill = await start_shim(Role.PREFILL, capacity=2, kv_hold_timeout_s=HOLD_S)
    decode = await start_shim(Role.DECODE, capacity=4, kv_fetch_timeout_s=HOLD_S)
    reply = await prefill.prefilled(PROMPT)
    async with _stalling_proxy(prefill.settings.port) as (port, stuck):
        await register_prefill(registry, port)  # the proxy stands in for the prefill
        params = {**reply["kv_transfer_params"], "remote_port": port}
        await _leave_after_headers(decode, params)
        await asyncio.wait_for(stuck.wait(), 2)
        load = await wait_load(prefill, "used", 0, within=2.0)
        assert (load["kv_released"], load["kv_fetched"], load["kv_held"]) == (1, 0, 0)
