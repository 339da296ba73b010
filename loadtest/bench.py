"""``pdgate bench scheduling|gateway|profile|compare|hotpath|soak|ratio|upgrade|chaos|strategies|
kv-index``: the CLI.

Each benchmark is its own suite (loadtest/scheduling, loadtest/gateway_cost, loadtest/soak,
loadtest/ratio, loadtest/upgrade, loadtest/chaos, loadtest/strategies);
this module only dispatches. Progress goes to stderr; stdout gets the benchmark's one JSON
line (``profile``: its report). Every server a benchmark starts is stopped on every path,
Ctrl-C and SIGTERM included.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable, Sequence

from pdgate.loadtest.chaos import command as chaos
from pdgate.loadtest.gateway_cost import command as gateway_cost
from pdgate.loadtest.kv_index import command as kv_index
from pdgate.loadtest.ratio import command as ratio
from pdgate.loadtest.scheduling import command as scheduling
from pdgate.loadtest.soak import command as soak
from pdgate.loadtest.strategies import command as strategies
from pdgate.loadtest.upgrade import command as upgrade

__all__ = ["HELP", "configure", "main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdgate bench", description=__doc__)
    sub = p.add_subparsers(dest="bench", required=True)
    scheduling.configure(
        sub.add_parser("scheduling", help=scheduling.HELP, description=scheduling.__doc__)
    )
    gateway_cost.configure_gateway(
        sub.add_parser("gateway", help=gateway_cost.GATEWAY_HELP, description=gateway_cost.__doc__)
    )
    gateway_cost.configure_profile(
        sub.add_parser("profile", help=gateway_cost.PROFILE_HELP, description=gateway_cost.__doc__)
    )
    gateway_cost.configure_compare(
        sub.add_parser("compare", help=gateway_cost.COMPARE_HELP, description=gateway_cost.__doc__)
    )
    gateway_cost.configure_hotpath(
        sub.add_parser("hotpath", help=gateway_cost.HOTPATH_HELP, description=gateway_cost.__doc__)
    )
    soak.configure(sub.add_parser("soak", help=soak.HELP, description=soak.__doc__))
    ratio.configure(sub.add_parser("ratio", help=ratio.HELP, description=ratio.__doc__))
    upgrade.configure(sub.add_parser("upgrade", help=upgrade.HELP, description=upgrade.__doc__))
    chaos.configure(sub.add_parser("chaos", help=chaos.HELP, description=chaos.__doc__))
    kv_index.configure(sub.add_parser("kv-index", help=kv_index.HELP, description=kv_index.__doc__))
    strategies.configure(
        sub.add_parser("strategies", help=strategies.HELP, description=strategies.__doc__)
    )
    return p


_MAINS: dict[str, Callable[[argparse.Namespace, str], int]] = {
    "scheduling": scheduling.main,
    "gateway": gateway_cost.gateway_main,
    "profile": gateway_cost.profile_main,
    "compare": gateway_cost.compare_main,
    "hotpath": gateway_cost.hotpath_main,
    "soak": soak.main,
    "ratio": ratio.main,
    "upgrade": upgrade.main,
    "chaos": chaos.main,
    "strategies": strategies.main,
    "kv-index": kv_index.main,
}

HELP = (
    "benchmarks: `pdgate bench scheduling|gateway|profile|compare|hotpath|soak|ratio|upgrade"
    "|chaos|strategies|kv-index --help`"
)


def configure(p: argparse.ArgumentParser) -> None:
    # Everything after `bench` belongs to the benchmarks' own parser.
    p.add_argument("bench_args", nargs=argparse.REMAINDER)


def main(args_or_argv: argparse.Namespace | Sequence[str] | None = None) -> int:
    """`pdgate bench ...` (a parsed Namespace) or ``python -m pdgate.loadtest.bench ...``."""
    argv = args_or_argv.bench_args if isinstance(args_or_argv, argparse.Namespace) else args_or_argv
    args = _parser().parse_args(argv)
    command = "pdgate bench " + shlex.join(list(argv) if argv is not None else sys.argv[1:])
    return _MAINS[args.bench](args, command)


if __name__ == "__main__":
    raise SystemExit(main())
