"""``pdgate shim``: run one prefill shim, decode worker or aggregated instance."""

from __future__ import annotations

import argparse
import asyncio

from pdgate.config.cli import overrides, registry_settings, serve_until_signalled
from pdgate.config.settings import ShimSettings
from pdgate.config.wire import Role

HELP = "run one prefill shim, decode worker or aggregated instance"
_FLAGS = [
    "role",
    "engine",
    "host",
    "port",
    "advertise_url",
    "instance_id",
    "model",
    "group",
    "capacity",
    "admission",
    "sim_profile",
]


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--role", choices=[r.value for r in Role])
    p.add_argument("--engine", help="engine backend by name (sim, vllm) or module:factory")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--advertise-url", dest="advertise_url")
    p.add_argument("--instance-id", dest="instance_id")
    p.add_argument("--model")
    p.add_argument("--group")
    p.add_argument("--capacity", type=int)
    p.add_argument("--admission", choices=["reject", "queue"])
    p.add_argument("--sim-profile", dest="sim_profile")


async def _serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    from pdgate.config.server import bind_socket, bound_port, serving
    from pdgate.engine_shim.app import build_shim_app, drain_shim
    from pdgate.registry import check_access, open_registry

    settings = ShimSettings.load(args.config, **overrides(args, _FLAGS))
    reg_settings = registry_settings(args)
    registry = open_registry(reg_settings)
    try:
        await check_access(registry)
        sock = bind_socket(settings.host, settings.port)
        settings = settings.model_copy(update={"port": bound_port(sock)})
        app = build_shim_app(settings, registry, reg_settings)
        async with serving(app, sock):
            print(
                f"pdgate shim ({settings.role.value}, {settings.engine}): "
                f"http://{settings.host}:{settings.port}",
                flush=True,
            )
            await stop.wait()
            await drain_shim(app, settings.drain_timeout_s)
    finally:
        await registry.aclose()


def main(args: argparse.Namespace) -> int:
    return serve_until_signalled(lambda stop: _serve(args, stop))
