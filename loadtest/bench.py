"""``pdgate bench <benchmark>``: the CLI (``pdgate bench --help`` lists them).

Each benchmark is its own suite (loadtest/scheduling, loadtest/gateway_cost, loadtest/soak,
loadtest/ratio, loadtest/upgrade, loadtest/chaos, loadtest/strategies, loadtest/kv_index,
loadtest/kv_copy, loadtest/summary); this module only dispatches. Progress goes to stderr;
stdout gets the benchmark's one JSON line or its report. Every server a benchmark starts is
stopped on every path, Ctrl-C and SIGTERM included.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import NamedTuple

from pdgate.loadtest.chaos import command as chaos
from pdgate.loadtest.gateway_cost import command as gateway_cost
from pdgate.loadtest.kv_copy import command as kv_copy
from pdgate.loadtest.kv_index import command as kv_index
from pdgate.loadtest.ratio import command as ratio
from pdgate.loadtest.scheduling import command as scheduling
from pdgate.loadtest.soak import command as soak
from pdgate.loadtest.strategies import command as strategies
from pdgate.loadtest.summary import command as summary
from pdgate.loadtest.upgrade import command as upgrade

__all__ = ["HELP", "configure", "main"]


class _Bench(NamedTuple):
    configure: Callable[[argparse.ArgumentParser], None]
    main: Callable[[argparse.Namespace, str], int]
    help: str
    description: str | None


def _suite(module: ModuleType) -> _Bench:
    """A suite of one benchmark: its command module's configure, main, HELP and docstring."""
    return _Bench(module.configure, module.main, module.HELP, module.__doc__)


def _gateway_cost(name: str) -> _Bench:
    """One of the gateway_cost suite's benchmarks (configure_NAME, NAME_main, NAME_HELP)."""
    return _Bench(
        getattr(gateway_cost, f"configure_{name}"),
        getattr(gateway_cost, f"{name}_main"),
        getattr(gateway_cost, f"{name.upper()}_HELP"),
        gateway_cost.__doc__,
    )


_GATEWAY_COST = ("gateway", "profile", "compare", "hotpath", "stages", "instructions")

# Name -> what `pdgate bench NAME` runs; the order is --help's.
_BENCHES: dict[str, _Bench] = {
    "scheduling": _suite(scheduling),
    **{name: _gateway_cost(name) for name in _GATEWAY_COST},
    "soak": _suite(soak),
    "ratio": _suite(ratio),
    "upgrade": _suite(upgrade),
    "chaos": _suite(chaos),
    "strategies": _suite(strategies),
    "kv-index": _suite(kv_index),
    "kv-copy": _suite(kv_copy),
    "summary": _suite(summary),
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdgate bench", description=__doc__)
    sub = p.add_subparsers(dest="bench", required=True)
    for name, bench in _BENCHES.items():
        bench.configure(sub.add_parser(name, help=bench.help, description=bench.description))
    return p


HELP = "benchmarks: `pdgate bench " + "|".join(_BENCHES) + " --help`"


def configure(p: argparse.ArgumentParser) -> None:
    # Everything after `bench` belongs to the benchmarks' own parser.
    p.add_argument("bench_args", nargs=argparse.REMAINDER)


def main(args_or_argv: argparse.Namespace | Sequence[str] | None = None) -> int:
    """`pdgate bench ...` (a parsed Namespace) or ``python -m pdgate.loadtest.bench ...``."""
    argv = args_or_argv.bench_args if isinstance(args_or_argv, argparse.Namespace) else args_or_argv
    args = _parser().parse_args(argv)
    command = "pdgate bench " + shlex.join(list(argv) if argv is not None else sys.argv[1:])
    return _BENCHES[args.bench].main(args, command)


if __name__ == "__main__":
    raise SystemExit(main())
