"""Generated blocks of the docs: the text between ``<!-- NAME:begin -->`` and
``<!-- NAME:end -->`` is a benchmark's output, the prose around it is kept; and what every
benchmark command does with its result (`save_run`, `publish`, `write_rows`)."""

from __future__ import annotations

import csv
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["publish", "save_run", "update_block", "write_rows"]

_Result = TypeVar("_Result")


def update_block(doc: Path, name: str, block: str, *, append: bool = False) -> bool:
    """Replace block `name` of `doc`. Without its markers: with `append`, add the block at
    the end (creating the file if needed) and return True; otherwise leave the doc as it is
    and return False."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    body = "\n" + block.rstrip("\n") + "\n"
    text = doc.read_text() if doc.exists() else ""
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        if not append:
            return False
        doc.write_text(text + begin + body + end + "\n")
        return True
    doc.write_text(text[: start + len(begin)] + body + text[stop:])
    return True


def save_run(
    out: Path,
    kind: str,
    result: _Result,
    title: str,
    *,
    plot: Callable[[_Result, Path, str], None],
    csv: Callable[[_Result, Path], None] | None = None,
) -> str | None:
    """Write run `kind`'s files into `out` (created): ``<kind>.csv`` with `csv`, and
    ``<kind>.png`` with `plot` (titled `title`); the plot as the docs link it from ``out``
    (``<kind>.png``: the doc, ``out/README.md`` by default, and ``out/<kind>.md`` sit beside
    it), None when it could not be drawn (matplotlib, the loadtest extra, missing: a hint on
    stderr, the numbers are published without their plot)."""
    out.mkdir(parents=True, exist_ok=True)
    if csv is not None:
        csv(result, out / f"{kind}.csv")
    png = out / f"{kind}.png"
    try:
        plot(result, png, title)
    except ImportError:
        print("no plot: matplotlib is missing (pip install -e '.[loadtest]')", file=sys.stderr)
        return None
    return png.name


def publish(block: str, out: Path, kind: str, doc: Path | None, bench: str) -> None:
    """Write the result `block` of run `kind` to ``out/<kind>.md`` and, when `doc` exists, into
    its ``<bench>:<kind>`` markers (a note on stderr when it has none: the doc is left as
    it is)."""
    (out / f"{kind}.md").write_text(block)
    if doc is not None and doc.exists() and not update_block(doc, f"{bench}:{kind}", block):
        print(f"{doc}: no {bench}:{kind} markers; see {out}/{kind}.md", file=sys.stderr)


def write_rows(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """`rows` as CSV: the columns of every row, in the order first seen; floats to 5 places."""
    fields: list[str] = []
    for row in rows:
        fields.extend(k for k in row if k not in fields)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _fmt(v) for k, v in row.items()})


def _fmt(value: Any) -> Any:
    return round(value, 5) if isinstance(value, float) and not math.isnan(value) else value
