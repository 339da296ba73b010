"""Shims on real sockets, an in-memory registry and an aiohttp client."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import pytest
from multidict import CIMultiDictProxy
from starlette.applications import Starlette

from pdgate.config import RegistrySettings, Role, ShimSettings
from pdgate.config.server import bind_socket, bound_port, serving
from pdgate.config.wire import COMPLETIONS_PATH, kv_url
from pdgate.engine_shim.app import build_shim_app
from pdgate.registry.memory import MemoryRegistry

MODEL = "sim-llama-3.1-8b"
PROMPT = "Hello there, general Kenobi."
REGISTRY_SETTINGS = RegistrySettings(heartbeat_interval_s=0.2, ttl_s=1.0)


@dataclass
class Shim:
    url: str
    settings: ShimSettings
    app: Starlette
    http: aiohttp.ClientSession

    async def load(self) -> dict[str, Any]:
        async with self.http.get(self.url + "/load") as resp:
            assert resp.status == 200
            data: dict[str, Any] = await resp.json()
            return data

    async def post(
        self, body: dict[str, Any], path: str = COMPLETIONS_PATH
    ) -> tuple[int, dict[str, Any], CIMultiDictProxy[str]]:
        async with self.http.post(self.url + path, data=orjson.dumps(body)) as resp:
            return resp.status, orjson.loads(await resp.read()), resp.headers

    async def prefilled(self, prompt: Any = PROMPT, **extra: Any) -> dict[str, Any]:
        """This prefill's answer to a prefill leg for `prompt` (which must be 200): the first
        token and the ``kv_transfer_params`` a decode pulls the KV by."""
        status, body, _ = await self.post(prefill_body(prompt, **extra))
        assert status == 200, body
        return body

    async def kv(self, method: str, reply: dict[str, Any]) -> int:
        """``GET`` or ``DELETE`` the KV a prefill's `reply` names (the answer read whole); the
        status."""
        url = kv_url(reply["kv_transfer_params"])
        assert url is not None
        async with self.http.request(method, url) as resp:
            await resp.read()
            return resp.status

    async def stream(self, body: dict[str, Any], path: str = COMPLETIONS_PATH) -> list[Any]:
        """The events of `body` streamed (which must be a 200 event stream), [DONE] last."""
        data = orjson.dumps({**body, "stream": True})
        async with self.http.post(self.url + path, data=data) as resp:
            assert resp.status == 200, await resp.text()
            assert resp.headers["content-type"].startswith("text/event-stream")
            return await sse_events(resp)


StartShim = Callable[..., Awaitable[Shim]]
Pair = tuple[Shim, Shim]  # a prefill and a decode


@pytest.fixture
async def registry() -> AsyncIterator[MemoryRegistry]:
    reg = MemoryRegistry()
    yield reg
    await reg.aclose()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def start_shim(
    registry: MemoryRegistry, http: aiohttp.ClientSession
) -> AsyncIterator[StartShim]:
    """`await start_shim(role, **settings)`: a shim serving until the test ends."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(role: Role = Role.PREFILL, **overrides: Any) -> Shim:
            sock = bind_socket("127.0.0.1", 0)
            settings = ShimSettings(role=role, host="127.0.0.1", port=bound_port(sock), **overrides)
            app = build_shim_app(settings, registry, REGISTRY_SETTINGS)
            await stack.enter_async_context(serving(app, sock))
            return Shim(f"http://127.0.0.1:{settings.port}", settings, app, http)

        yield start


@pytest.fixture
async def pair(start_shim: StartShim) -> Pair:
    """A prefill and a decode, 4 slots each."""
    return await start_shim(Role.PREFILL, capacity=4), await start_shim(Role.DECODE, capacity=4)


def prefill_body(prompt: Any = PROMPT, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
        **extra,
    }


def prefill_leg(body: dict[str, Any]) -> dict[str, Any]:
    """A request of any API as the gateway sends it to a prefill: one token, its KV kept."""
    return {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}


def assert_openai_error(body: dict[str, Any]) -> dict[str, Any]:
    assert set(body) == {"error"}, body
    err: dict[str, Any] = body["error"]
    # A refusal to retry carries the wait it tells in the body too.
    assert set(err) - {"retry_after"} == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str)
    assert err["message"]
    assert isinstance(err["type"], str)
    assert err["type"]
    return err


async def sse_events(resp: aiohttp.ClientResponse) -> list[Any]:
    """Payloads of every ``data:`` line until ``[DONE]`` (as the string "[DONE]"); comments
    (keep-alive pings) are skipped, as SSE clients do."""
    events: list[Any] = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line or line.startswith(":"):
            continue
        assert line.startswith("data: "), line
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            events.append(data)
            break
        events.append(orjson.loads(data))
    return events


async def wait_load(shim: Shim, key: str, value: int, within: float = 2.0) -> dict[str, Any]:
    """Poll /load until ``load[key] == value``; fail after `within` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        load = await shim.load()
        if load[key] == value:
            return load
        assert loop.time() < deadline, f"{key} stayed {load[key]}, wanted {value}: {load}"
        await asyncio.sleep(0.01)
