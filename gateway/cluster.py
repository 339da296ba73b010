"""The embedded cluster (``pdgate up``): a gateway plus prefill and decode shims, one process.

One event loop hosts every server, which is what lets the in-memory registry work; with
``PDGATE_REGISTRY_URL`` set, the same processes register in Redis instead and other gateways
or shims can join them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.applications import Starlette

from config import ClusterSettings, GatewaySettings, RegistrySettings, Role, ShimSettings
from engine_shim.app import build_shim_app, drain_shim
from gateway._server import bind_socket, bound_port, serving
from gateway.app import build_gateway_app
from registry import open_registry
from registry.base import Registry


@dataclass(frozen=True)
class ClusterInfo:
    gateway_url: str
    prefill_urls: list[str] = field(default_factory=list)
    decode_urls: list[str] = field(default_factory=list)
    registry: str = "memory"


def _shim_port(cluster: ClusterSettings, index: int) -> int:
    return 0 if cluster.shim_base_port == 0 else cluster.shim_base_port + index


@contextlib.asynccontextmanager
async def embedded_cluster(
    gateway: GatewaySettings,
    registry_settings: RegistrySettings,
    shim: ShimSettings,
    cluster: ClusterSettings,
    *,
    registry: Registry | None = None,
) -> AsyncIterator[ClusterInfo]:
    """Start everything, yield where it listens, stop it all (gateway first) on exit."""
    async with contextlib.AsyncExitStack() as stack:
        if registry is None:
            registry = open_registry(registry_settings)
            stack.push_async_callback(registry.aclose)
        urls: dict[Role, list[str]] = {Role.PREFILL: [], Role.DECODE: []}
        shim_apps: list[Starlette] = []
        roles = [Role.PREFILL] * cluster.prefills + [Role.DECODE] * cluster.decodes
        for index, role in enumerate(roles):
            sock = bind_socket(shim.host, _shim_port(cluster, index))
            settings = shim.model_copy(
                update={"role": role, "port": bound_port(sock), "instance_id": None}
            )
            app = build_shim_app(settings, registry, registry_settings)
            await stack.enter_async_context(serving(app, sock))
            shim_apps.append(app)
            urls[role].append(f"http://{shim.host}:{settings.port}")

        async def drain() -> None:
            # Runs after the gateway stopped and before the shims close their sockets, so
            # held KV can still be pulled and running streams finish.
            await asyncio.gather(*(drain_shim(a, shim.drain_timeout_s) for a in shim_apps))

        stack.push_async_callback(drain)
        sock = bind_socket(gateway.host, gateway.port)
        gateway_app = build_gateway_app(gateway, registry, registry_settings)
        await stack.enter_async_context(serving(gateway_app, sock, access_log=gateway.access_log))
        yield ClusterInfo(
            gateway_url=f"http://{gateway.host}:{bound_port(sock)}",
            prefill_urls=urls[Role.PREFILL],
            decode_urls=urls[Role.DECODE],
            registry="memory" if registry_settings.url is None else "redis",
        )
