"""``pdgate gateway``: run the OpenAI-compatible gateway."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import socket

from pdgate.config.cli import overrides, registry_settings, serve_until_signalled
from pdgate.config.settings import (
    STATIC_DECODE_CAPACITY,
    STATIC_PREFILL_CAPACITY,
    GatewaySettings,
)
from pdgate.gateway.admission.auth import check_exposure
from pdgate.gateway.workers import READY

log = logging.getLogger("pdgate.gateway")

HELP = "run the OpenAI-compatible gateway"
_FLAGS = [
    "host",
    "port",
    "prefill_policy",
    "decode_policy",
    "ttft_timeout_s",
    "workers",
    "static_prefills",
    "static_decodes",
    "static_aggregated",
]
_STATIC_HELP = (
    "a {role} server fronted by URL, without registration (stock vLLM, any OpenAI server "
    "with vLLM's kv_transfer_params handshake); repeatable: 'URL [capacity=N] [group=G] "
    "[model=M] [id=ID] [api_key_env=VAR]', capacity default {capacity}, model default: the "
    "server's GET /v1/models, api_key_env: the variable holding its own API key. Replaces "
    "static_{role}s of the config file"
)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--prefill-policy", dest="prefill_policy")
    p.add_argument("--decode-policy", dest="decode_policy")
    p.add_argument("--ttft-timeout-s", dest="ttft_timeout_s", type=float)
    p.add_argument(
        "--workers",
        type=int,
        help="worker processes on one port (they share load through the Redis registry)",
    )
    for role, capacity in (
        ("prefill", STATIC_PREFILL_CAPACITY),
        ("decode", STATIC_DECODE_CAPACITY),
    ):
        p.add_argument(
            f"--{role}",
            dest=f"static_{role}s",
            action="append",
            metavar="'URL [capacity=N] ...'",
            help=_STATIC_HELP.format(role=role, capacity=capacity),
        )
    p.add_argument(
        "--aggregated",
        dest="static_aggregated",
        action="append",
        metavar="'URL [capacity=N] ...'",
        help=f"a server that computes prompts and decodes them (plain vllm serve), fronted by "
        f"URL: its group is served aggregated; as --decode, capacity default "
        f"{STATIC_DECODE_CAPACITY}. Replaces static_aggregated of the config file",
    )
    # Internal: a --workers supervisor hands each worker its listening socket.
    p.add_argument("--listen-fd", dest="listen_fd", type=int, help=argparse.SUPPRESS)


async def _serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    from pdgate.config.server import bind_socket, bound_port, serving
    from pdgate.gateway.app import _upstream_headers, build_gateway_app
    from pdgate.registry import check_access, open_registry
    from pdgate.registry.static import with_static_instances

    settings = GatewaySettings.load(args.config, **overrides(args, _FLAGS))
    warning = check_exposure(
        settings.host,
        keys=bool(settings.api_keys or settings.api_keys_file),
        allow_unauthenticated=settings.allow_unauthenticated,
    )
    if warning:
        log.warning("%s", warning)
    worker = args.listen_fd is not None
    if settings.workers > 1 and not worker:
        await _supervise(args, settings, stop)
        return
    reg_settings = registry_settings(args)
    registry = open_registry(reg_settings)
    try:
        await check_access(registry)
        # Static --prefill/--decode servers join the same membership (probed, never written).
        registry = with_static_instances(
            registry, settings, headers=_upstream_headers(settings, reg_settings)
        )
        sock = (
            socket.socket(fileno=args.listen_fd)
            if worker
            else bind_socket(settings.host, settings.port)
        )
        sock.setblocking(False)
        app = build_gateway_app(settings, registry, reg_settings)
        async with serving(app, sock, access_log=settings.access_log):
            _settle_gc()
            if worker:
                print(f"{READY} {settings.worker_index}: ready", flush=True)
            else:
                print(f"pdgate gateway: http://{settings.host}:{bound_port(sock)}/v1", flush=True)
            await stop.wait()
            app.stop()
    finally:
        await registry.aclose()


def _settle_gc() -> None:
    """Once serving: what start-up built lives as long as the process, so it leaves the
    cyclic collector's view (``gc.freeze``, as vLLM and SGLang do after warm-up), and the
    youngest generation is collected every 10,000 allocations instead of 700. Requests
    allocate many short-lived containers, freed by reference counting; at 700 the collector
    ran often enough to double its share of the gateway's CPU a request (measured in
    docs/results/structure/README.md). Only the gateway's own process: tests and ``pdgate
    up`` that host gateways in-process keep the interpreter's defaults."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, *gc.get_threshold()[1:])


async def _supervise(
    args: argparse.Namespace, settings: GatewaySettings, stop: asyncio.Event
) -> None:
    from pdgate.config.server import bind_socket, bound_port
    from pdgate.gateway.workers import Supervisor

    sock = bind_socket(settings.host, settings.port)
    try:
        url = f"http://{settings.host}:{bound_port(sock)}/v1"
        supervisor = Supervisor(sock, settings.workers, args.argv, gateway_id=settings.gateway_id)
        code = await supervisor.run(stop, f"pdgate gateway: {url} ({settings.workers} workers)")
    finally:
        sock.close()
    if code:
        raise SystemExit(code)


def main(args: argparse.Namespace) -> int:
    return serve_until_signalled(lambda stop: _serve(args, stop))
