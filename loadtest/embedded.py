"""``pdgate up``, the embedded cluster: a gateway plus prefill and decode shims, one process.

It lives here, with the other harnesses that run whole clusters, because it depends on both
the gateway and the shim packages (which never import each other).

One event loop hosts every server, which is what lets the in-memory registry work; with
``PDGATE_REGISTRY_URL`` set, the same processes register in Redis instead and other gateways
or shims can join them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pydantic import SecretStr
from starlette.applications import Starlette

from pdgate.config import ClusterSettings, GatewaySettings, RegistrySettings, Role, ShimSettings
from pdgate.config.cli import overrides, registry_settings, serve_until_signalled
from pdgate.config.server import bind_socket, bound_port, serving
from pdgate.engine_shim.app import build_shim_app, drain_shim
from pdgate.gateway.app import build_gateway_app
from pdgate.registry import open_registry
from pdgate.registry.base import Registry


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


HELP = "gateway + simulated prefill and decode shims in one process"


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--prefills", type=int)
    p.add_argument("--decodes", type=int)
    p.add_argument("--capacity", type=int, help="slots per shim")
    p.add_argument("--engine", help="engine backend by name (sim, vllm) or module:factory")
    p.add_argument("--model", help="served model; with --engine vllm, the model directory")
    p.add_argument("--sim-profile", dest="sim_profile")
    p.add_argument("--prefill-policy", dest="prefill_policy")


def with_cluster_token(settings: RegistrySettings) -> RegistrySettings:
    """`settings` with a freshly generated cluster token when none is set and the registry
    is this process's own (in-memory): the shims listen on real sockets, and only this
    process's gateway and decodes may use them. A Redis registry is shared with processes
    that must know the token, so there the operator sets one (the shims refuse to listen
    beyond loopback without it)."""
    if settings.cluster_token is not None or settings.url:
        return settings
    return settings.model_copy(update={"cluster_token": SecretStr(secrets.token_urlsafe(32))})


async def _up(args: argparse.Namespace, stop: asyncio.Event) -> None:
    gateway = GatewaySettings.load(
        args.config, **overrides(args, ["host", "port", "prefill_policy"])
    )
    shim = ShimSettings.load(
        args.config, **overrides(args, ["capacity", "sim_profile", "engine", "model"])
    )
    cluster = ClusterSettings.load(args.config, **overrides(args, ["prefills", "decodes"]))
    registry = with_cluster_token(registry_settings(args))
    async with embedded_cluster(gateway, registry, shim, cluster) as info:
        print(
            f"pdgate up: send OpenAI requests to {info.gateway_url}/v1 "
            f"({len(info.prefill_urls)} prefill, {len(info.decode_urls)} decode, "
            f"{shim.engine} engine, {info.registry} registry); Ctrl-C stops",
            flush=True,
        )
        await stop.wait()
    print("pdgate up: stopped", flush=True)


def main(args: argparse.Namespace) -> int:
    return serve_until_signalled(lambda stop: _up(args, stop))
