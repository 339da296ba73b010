"""Progress lines: benchmarks print them to stderr, keeping stdout for their one JSON line."""

from __future__ import annotations

import sys
from collections.abc import Callable

__all__ = ["Log", "to_stderr"]

Log = Callable[[str], None]


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
