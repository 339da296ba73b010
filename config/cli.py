"""``pdgate``: the command line."""

# Each subcommand lives with the package it runs and is loaded by name (like policies and
# engines), so this module depends on none of them: ``pdgate gateway`` never imports the shim
# package, ``pdgate shim`` never imports the gateway. A command module provides ``HELP``,
# ``configure(parser)`` and ``main(args) -> int``.

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from pdgate.config.settings import RegistrySettings

__all__ = ["COMMANDS", "main", "overrides", "registry_settings", "serve_until_signalled"]

# What `pdgate --help` says above the commands: for users, what pdgate and its flags are.
DESCRIPTION = (
    "pdgate: an OpenAI-compatible gateway for prefill/decode-disaggregated LLM serving, "
    "its engine shims and its benchmarks. Every command takes the common flags "
    "(--log-level, --config, --registry-url), before or after its name; "
    "`pdgate COMMAND --help` lists a command's own."
)

# name -> module; more plug in here (or through `python -m` of the module itself).
COMMANDS: dict[str, str] = {
    "gateway": "pdgate.gateway.cli",
    "shim": "pdgate.engine_shim.cli",
    "announce": "pdgate.registry.announce",
    "keys": "pdgate.gateway.keys",
    "up": "pdgate.loadtest.up",
    "bench": "pdgate.loadtest.bench",
    "plan": "pdgate.loadtest.plan.command",
}
LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR"]


def _common(suppress: bool) -> argparse.ArgumentParser:
    """The flags every subcommand takes. On subcommands they default to SUPPRESS, so a value
    given before the subcommand's name is not overwritten by the subparser's default."""
    default: Any = argparse.SUPPRESS if suppress else None
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "--log-level", choices=LOG_LEVELS, default=argparse.SUPPRESS if suppress else "INFO"
    )
    p.add_argument(
        "--config",
        type=Path,
        default=default,
        help="TOML file with [gateway] [shim] [registry] [cluster] tables",
    )
    p.add_argument(
        "--registry-url",
        dest="registry_url",
        default=default,
        help="redis://... or rediss://... (default: in-memory)",
    )
    return p


def _load(name: str) -> ModuleType:
    return importlib.import_module(COMMANDS[name])


def _parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdgate", description=DESCRIPTION, parents=[_common(False)])
    sub = p.add_subparsers(dest="command", required=True)
    # Only the named command's module is imported (they import heavy things: vLLM, Locust).
    wanted = next((a for a in argv if a in COMMANDS), None)
    for name in COMMANDS:
        if wanted is not None and name != wanted:
            sub.add_parser(name)
            continue
        module = _load(name)
        sp = sub.add_parser(name, help=module.HELP, parents=[_common(True)])
        module.configure(sp)
    return p


def overrides(args: argparse.Namespace, names: Sequence[str]) -> dict[str, Any]:
    """CLI flags that were given (None means "not given": env/TOML/defaults decide)."""
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def registry_settings(args: argparse.Namespace) -> RegistrySettings:
    over = {"url": args.registry_url} if args.registry_url else {}
    return RegistrySettings.load(args.config, **over)


def serve_until_signalled(run: Callable[[asyncio.Event], Awaitable[None]]) -> int:
    """Run a server coroutine on uvloop until SIGINT/SIGTERM sets its stop event."""
    from pdgate.config.server import run as run_loop

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await run(stop)

    run_loop(main())
    return 0


# Third-party HTTP clients that log every request at INFO: a benchmark's official openai
# clients would write a line per request, on the CPU the load is measured with.
_CHATTY_CLIENTS = ("httpx", "httpx2", "httpcore", "openai", "anthropic")


def _quiet_http_clients() -> None:
    """Keep the HTTP client libraries to warnings and worse, whatever the log level."""
    for name in _CHATTY_CLIENTS:
        logger = logging.getLogger(name)
        logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser(argv).parse_args(argv)
    args.argv = argv  # a supervisor (``--workers``) starts its workers with the same ones
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    _quiet_http_clients()
    try:
        code: int = _load(args.command).main(args)
    except Exception as exc:
        # Bad settings, a port in use, refused credentials: one line, not a traceback.
        if not isinstance(exc, ValueError | OSError) and not getattr(exc, "user_facing", False):
            raise
        print(f"pdgate {args.command}: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    raise SystemExit(main())
