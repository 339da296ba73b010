"""What the experiment benchmarks' command lines share (``pdgate bench scheduling``,
``strategies``, ``ratio``, ``upgrade``, ``chaos``): their output options, plan fields given
as options, and the run's tail (the plan checked before any server starts, the run, its
files, one JSON line on stdout)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Coroutine, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import orjson

from pdgate.loadtest.lib.args import positive_int
from pdgate.loadtest.lib.children import run_main

__all__ = ["add_fields", "add_outputs", "add_runs", "kind_of", "run_experiment_command"]

_Plan = TypeVar("_Plan")
_Result = TypeVar("_Result")


def add_outputs(p: argparse.ArgumentParser, topic: str) -> None:
    """``--out``, ``--doc``, ``--no-doc``, ``--kind`` for results in docs/results/`topic`/."""
    folder = Path("docs/results") / topic
    p.add_argument("--out", type=Path, default=folder, help="output folder")
    p.add_argument("--doc", type=Path, default=folder / "README.md")
    p.add_argument("--no-doc", action="store_true", help="do not update the doc's block")
    p.add_argument("--kind", help="name of the outputs and the doc block; default quick or full")


def add_runs(p: argparse.ArgumentParser, *, per: str, warmup: str, measure: str) -> None:
    """``--seed``, ``--seeds`` (runs per `per`), ``--warmup-s`` and ``--measure-s``."""
    p.add_argument("--seed", type=int, default=0, help="the first seed")
    p.add_argument("--seeds", type=positive_int, help=f"runs per {per}, seeds SEED.. (default 3)")
    p.add_argument("--warmup-s", type=float, help=warmup)
    p.add_argument("--measure-s", type=float, help=measure)


def add_fields(
    p: argparse.ArgumentParser, whole: Iterable[str] = (), numbers: Iterable[str] = ()
) -> None:
    """An option per plan field (``max_tokens`` -> ``--max-tokens``), default None: the
    plan's own (`with_args` in args.py takes those given)."""
    for kind, names in ((int, whole), (float, numbers)):
        for name in names:
            p.add_argument(f"--{name.replace('_', '-')}", type=kind)


def kind_of(args: argparse.Namespace) -> str:
    """The outputs' name: ``--kind``, else quick or full."""
    return str(args.kind or ("quick" if args.quick else "full"))


def run_experiment_command(
    bench: str,
    args: argparse.Namespace,
    command: str,
    plan_of: Callable[[argparse.Namespace], _Plan],
    run: Callable[[_Plan], Coroutine[Any, Any, _Result]],
    write: Callable[[_Result, str, Path, Path | None, str], None],
    summary: Callable[[_Result], Mapping[str, Any]],
) -> int:
    """`pdgate bench BENCH`'s main: a plan the options make invalid is a usage error (2)
    before any server starts; then the run, its outputs, and its JSON line."""
    try:
        plan = plan_of(args)
    except ValueError as exc:
        print(f"pdgate bench {bench}: {exc}", file=sys.stderr)
        return 2
    result = run_main(run(plan))
    write(result, kind_of(args), args.out, None if args.no_doc else args.doc, command)
    print(orjson.dumps(summary(result)).decode(), flush=True)
    return 0
