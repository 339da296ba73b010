"""Reads do not write: every GET the gateway serves leaves its state as it found it.

A real embedded cluster (sim shims, in-memory registry, real sockets) whose gateway app
gets one extra route in the test, which hands the test the gateway's lifespan state. The
state reachable from it is walked into plain values before and after calling every GET
route, and the two must be equal. The cluster is a partial group that has routed a request
and whose membership then changed, the case in which ``/admin/queues`` used to split the
group's macro instances again (routing's state) when read.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import socket
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from types import FunctionType, MethodType, ModuleType
from typing import Any

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pdgate.config import (
    ClusterSettings,
    GatewaySettings,
    RegistrySettings,
    ServingStrategy,
    ShimSettings,
)
from pdgate.config.wire import EXT_PHASES, EXT_QUEUELESS, Role
from pdgate.gateway.app import GatewayApp
from pdgate.loadtest import up
from pdgate.registry.base import InstanceRecord
from pdgate.registry.memory import MemoryRegistry
from tests._cluster import SIM_MODEL

# What the walk does not descend into: machinery, not state a read could change.
_OPAQUE: tuple[type, ...] = (
    type,
    ModuleType,
    FunctionType,
    MethodType,
    asyncio.AbstractEventLoop,
    asyncio.Future,
    asyncio.Event,
    asyncio.Lock,
    asyncio.Condition,
    asyncio.Semaphore,
    asyncio.BaseTransport,
    asyncio.StreamReader,
    asyncio.StreamWriter,
    socket.socket,
    logging.Logger,
    type(threading.Lock()),
    enum.Enum,
)
_PLAIN = (int, float, str, bytes, bool, type(None))


def _walk(root: Any) -> dict[str, object]:
    """Every plain value reachable from `root`, by its path (each object once)."""
    out: dict[str, object] = {}
    seen: set[int] = set()

    def visit(value: Any, path: str, depth: int) -> None:
        if isinstance(value, (*_PLAIN, enum.Enum)):
            out[path] = value
            return
        if depth > 40 or id(value) in seen or isinstance(value, _OPAQUE) or callable(value):
            return
        module = type(value).__module__
        if module.startswith(("prometheus_client", "aiohttp", "opentelemetry", "redis")):
            return
        seen.add(id(value))
        if isinstance(value, dict | weakref.WeakKeyDictionary | weakref.WeakValueDictionary):
            out[path + "#len"] = len(value)
            for k, v in list(value.items()):
                visit(v, f"{path}[{k!r}]", depth + 1)
        elif isinstance(value, list | tuple | deque):
            out[path + "#len"] = len(value)
            for n, v in enumerate(value):
                visit(v, f"{path}[{n}]", depth + 1)
        elif isinstance(value, set | frozenset | weakref.WeakSet):
            out[path + "#len"] = len(value)
        else:
            for name in _attributes(value):
                visit(getattr(value, name, None), f"{path}.{name}", depth + 1)

    visit(root, "state", 0)
    return out


def _attributes(value: object) -> Iterator[str]:
    yield from getattr(value, "__dict__", {})
    for cls in type(value).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        yield from (slots,) if isinstance(slots, str) else slots


def _phase_record(url: str) -> InstanceRecord:
    """One more instance of the partial group (never routed to: the test sends no more)."""
    return InstanceRecord(
        id="late-joiner",
        role=Role.AGGREGATED,
        url=url,
        model=SIM_MODEL,
        capacity=4,
        extensions=(EXT_PHASES, EXT_QUEUELESS),
    )


async def test_every_get_leaves_the_gateway_state_as_it_found_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    states: list[dict[str, Any]] = []
    routes: list[Any] = []
    build = up.build_gateway_app

    def instrumented(*args: Any, **kwargs: Any) -> GatewayApp:
        app = build(*args, **kwargs)

        async def lifespan_state(request: Request) -> Response:
            states.append(dict(request.scope["state"]))
            return Response(status_code=204)

        routes.extend(app.app.routes)
        app.app.router.routes.append(Route("/test/state", lifespan_state, methods=["POST"]))
        return app

    monkeypatch.setattr(up, "build_gateway_app", instrumented)
    registry = MemoryRegistry()
    async with (
        up.embedded_cluster(
            GatewaySettings(port=0),
            RegistrySettings(),
            ShimSettings(port=0),
            ClusterSettings(prefills=1, decodes=2, strategy=ServingStrategy.PARTIAL),
            registry=registry,
        ) as info,
        httpx.AsyncClient(base_url=info.gateway_url, timeout=10) as http,
    ):

        async def eventually(check: Callable[[], Any]) -> None:
            for _ in range(200):
                if await check():
                    return
                await asyncio.sleep(0.05)
            raise AssertionError("the gateway never got there")

        async def instances() -> int:
            return len((await http.get("/admin/instances")).json()["instances"])

        await eventually(lambda: _equals(instances(), 3))
        body = {"model": SIM_MODEL, "prompt": "routed once", "max_tokens": 2}
        assert (await http.post("/v1/completions", json=body)).status_code == 200
        # The group changes after routing saw it: the next read must not re-split it.
        await registry.put(_phase_record("http://127.0.0.1:9"), 60.0)
        await eventually(lambda: _equals(instances(), 4))
        assert (await http.post("/test/state")).status_code == 204
        state = states[-1]

        gets = sorted(
            route.path.replace("{response_id}", "resp_unknown")
            for route in routes
            if isinstance(route, Route) and "GET" in (route.methods or ())
        )
        assert {"/admin/queues", "/admin/instances", "/health", "/metrics"} <= set(gets)
        before = _walk(state)
        for path in gets:
            assert (await http.get(path)).status_code < 500, path
        after = _walk(state)
        changed = sorted(
            k
            for k in before.keys() | after.keys()
            if before.get(k) != after.get(k) and not _timer_driven(k)
        )
        assert not changed, changed[:20]


def _timer_driven(path: str) -> bool:
    """State that timers move whatever the requests: the event loop's lag sample, and the
    expiry of each record in the in-memory registry, renewed by the shims' heartbeats."""
    expiry = "._registry._records[" in path and path.endswith("][1]")
    return ".loop_lag." in path or expiry


async def _equals(value: Any, expected: object) -> bool:
    return bool(await value == expected)
