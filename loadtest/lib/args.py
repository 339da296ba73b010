"""Argument types the benchmarks' command lines share."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

__all__ = ["positive_int", "positive_numbers", "some_of", "with_args"]

_Plan = TypeVar("_Plan")


def positive_int(text: str) -> int:
    """A whole number of at least 1 (argparse's error otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def some_of(known: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    """The type of a comma-separated list of names, each one of `known`."""

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(n.strip() for n in text.split(",") if n.strip())
        if not names or any(n not in known for n in names):
            raise argparse.ArgumentTypeError(f"expected some of {', '.join(known)}")
        return names

    return parse


def positive_numbers(text: str) -> tuple[float, ...]:
    """A comma-separated list of numbers above 0."""
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError("expected positive numbers, comma-separated")
    return values


def with_args(plan: _Plan, args: argparse.Namespace, **given: Any) -> _Plan:
    """`plan` (a dataclass instance) with each field the command line gave by the same name
    (an option left at None keeps the plan's value), and `given` on top."""
    names = {f.name for f in dataclasses.fields(plan)}  # type: ignore[arg-type]
    found = {k: v for k, v in vars(args).items() if k in names and v is not None}
    return dataclasses.replace(plan, **{**found, **given})  # type: ignore[type-var]
