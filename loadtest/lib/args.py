"""Argument types the benchmarks' command lines share."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

__all__ = ["positive_int", "positive_numbers", "some_of"]


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
