"""``pdgate``: the command line (gateway, shim, up, bench)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from config import ClusterSettings, GatewaySettings, RegistrySettings, ShimSettings

log = logging.getLogger("pdgate")


def _overrides(args: argparse.Namespace, names: Sequence[str]) -> dict[str, Any]:
    """CLI flags that were given (None means "not given": env/TOML/defaults decide)."""
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdgate", description=__doc__)
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--config",
            type=Path,
            help="TOML file with [gateway] [shim] [registry] [cluster] tables",
        )
        sp.add_argument(
            "--registry-url", dest="registry_url", help="redis://... (default: in-memory)"
        )

    g = sub.add_parser("gateway", help="run the OpenAI-compatible gateway")
    common(g)
    g.add_argument("--host")
    g.add_argument("--port", type=int)
    g.add_argument("--prefill-policy", dest="prefill_policy")
    g.add_argument("--decode-policy", dest="decode_policy")
    g.add_argument("--ttft-timeout-s", dest="ttft_timeout_s", type=float)

    s = sub.add_parser("shim", help="run one prefill shim or decode worker")
    common(s)
    s.add_argument("--role", choices=["prefill", "decode"])
    s.add_argument("--engine", choices=["sim", "vllm"])
    s.add_argument("--host")
    s.add_argument("--port", type=int)
    s.add_argument("--advertise-url", dest="advertise_url")
    s.add_argument("--instance-id", dest="instance_id")
    s.add_argument("--model")
    s.add_argument("--group")
    s.add_argument("--capacity", type=int)
    s.add_argument("--admission", choices=["reject", "queue"])
    s.add_argument("--sim-profile", dest="sim_profile")

    u = sub.add_parser("up", help="gateway + simulated prefill and decode shims in one process")
    common(u)
    u.add_argument("--host")
    u.add_argument("--port", type=int)
    u.add_argument("--prefills", type=int)
    u.add_argument("--decodes", type=int)
    u.add_argument("--capacity", type=int, help="slots per shim")
    u.add_argument("--engine", choices=["sim", "vllm"])
    u.add_argument("--model", help="served model; with --engine vllm, the model directory")
    u.add_argument("--sim-profile", dest="sim_profile")
    u.add_argument("--prefill-policy", dest="prefill_policy")

    # The benchmarks live in loadtest/ (their own parser): everything after `bench` is theirs.
    b = sub.add_parser("bench", help="benchmarks: `pdgate bench scheduling|gateway --help`")
    b.add_argument("bench_args", nargs=argparse.REMAINDER)
    return p


def _registry_settings(args: argparse.Namespace) -> RegistrySettings:
    over = {"url": args.registry_url} if args.registry_url else {}
    return RegistrySettings.load(args.config, **over)


async def _until_signalled(run: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await run(stop)


async def _gateway(args: argparse.Namespace, stop: asyncio.Event) -> None:
    from gateway._server import bind_socket, bound_port, serving
    from gateway.app import build_gateway_app
    from registry import open_registry

    settings = GatewaySettings.load(
        args.config,
        **_overrides(args, ["host", "port", "prefill_policy", "decode_policy", "ttft_timeout_s"]),
    )
    reg_settings = _registry_settings(args)
    registry = open_registry(reg_settings)
    try:
        sock = bind_socket(settings.host, settings.port)
        async with serving(
            build_gateway_app(settings, registry, reg_settings),
            sock,
            access_log=settings.access_log,
        ):
            print(f"pdgate gateway: http://{settings.host}:{bound_port(sock)}/v1", flush=True)
            await stop.wait()
    finally:
        await registry.aclose()


async def _shim(args: argparse.Namespace, stop: asyncio.Event) -> None:
    from engine_shim.app import build_shim_app, drain_shim
    from gateway._server import bind_socket, bound_port, serving
    from registry import open_registry

    names = [
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
    settings = ShimSettings.load(args.config, **_overrides(args, names))
    reg_settings = _registry_settings(args)
    registry = open_registry(reg_settings)
    try:
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


async def _up(args: argparse.Namespace, stop: asyncio.Event) -> None:
    from gateway.cluster import embedded_cluster

    gateway = GatewaySettings.load(
        args.config, **_overrides(args, ["host", "port", "prefill_policy"])
    )
    shim = ShimSettings.load(
        args.config, **_overrides(args, ["capacity", "sim_profile", "engine", "model"])
    )
    cluster = ClusterSettings.load(args.config, **_overrides(args, ["prefills", "decodes"]))
    async with embedded_cluster(gateway, _registry_settings(args), shim, cluster) as info:
        print(
            f"pdgate up: send OpenAI requests to {info.gateway_url}/v1 "
            f"({len(info.prefill_urls)} prefill, {len(info.decode_urls)} decode, "
            f"{shim.engine} engine, {info.registry} registry); Ctrl-C stops",
            flush=True,
        )
        await stop.wait()
    print("pdgate up: stopped", flush=True)


def _run(coro_fn: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    from gateway._server import run

    run(_until_signalled(coro_fn))


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "bench":
        from loadtest.bench import main as bench_main

        return bench_main(args.bench_args)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    commands = {"gateway": _gateway, "shim": _shim, "up": _up}
    command = commands[args.command]
    try:
        _run(lambda stop: command(args, stop))
    except (ValueError, OSError) as exc:
        # Bad settings or a port in use: one line, not a traceback.
        print(f"pdgate {args.command}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
