"""``pdgate bench upgrade``: a rolling upgrade of the whole fleet under streaming load.

Every prefill, then every decode, then every gateway is replaced one at a time (SIGTERM,
drain, exit, a new process, registered) while closed-loop users keep long streams open
through 2 gateways. A client may resend a request to another gateway only if it got no
response start; a stream that broke counts as failed. Progress goes to stderr; stdout gets
one JSON line (failures in all and per phase, reconnects, TTFT p50/p99 per phase and their
ratio to the steady phase's, each restart's drain and start times). Files: ``OUT/KIND.csv``
(every request), ``OUT/KIND.png`` (the timeline), ``OUT/KIND.md`` and, unless ``--no-doc``,
the ``upgrade:KIND`` block of the doc (KIND = quick or full, or ``--kind``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import orjson

from pdgate.loadtest.lib.args import with_args
from pdgate.loadtest.lib.children import run_main
from pdgate.loadtest.lib.docs import publish, save_run
from pdgate.loadtest.lib.suite import add_fields, add_outputs, kind_of

__all__ = ["HELP", "configure", "main"]

HELP = "restart every shim and gateway one by one under streaming load: failures, TTFT bump"

_NUMBERS = ("prefills", "decodes", "gateways", "users", "max_tokens", "seed")
_SECONDS = ("drain_timeout_s", "gateway_prestop_s", "steady_s", "settle_s", "after_s")


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="1 prefill, 1 decode, short streams")
    add_outputs(p, "upgrade")
    add_fields(p, _NUMBERS, _SECONDS)
    p.add_argument("--roles", help="what to restart, in order (default prefill,decode,gateway)")


def main(args: argparse.Namespace, command: str) -> int:
    from pdgate.loadtest.upgrade.report import (
        markdown,
        summary_json,
        write_csv,
        write_plot,
    )
    from pdgate.loadtest.upgrade.run import QUICK, UpgradePlan, run_upgrade

    plan = QUICK if args.quick else UpgradePlan()
    roles = tuple(r.strip() for r in args.roles.split(",") if r.strip()) if args.roles else ()
    plan = with_args(plan, args, roles=roles or plan.roles)
    kind = kind_of(args)
    result = run_main(run_upgrade(plan))
    out: Path = args.out
    title = f"pdgate bench upgrade ({kind})"
    plot = save_run(out, kind, result, title, csv=write_csv, plot=write_plot)
    doc: Path | None = None if args.no_doc else args.doc
    publish(markdown(result, command, plot), out, kind, doc, "upgrade")
    print(orjson.dumps(summary_json(result)).decode(), flush=True)
    return 0
