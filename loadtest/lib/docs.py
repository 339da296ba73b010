"""Generated blocks of the docs: the text between ``<!-- NAME:begin -->`` and
``<!-- NAME:end -->`` is a benchmark's output, the prose around it is kept."""

from __future__ import annotations

from pathlib import Path

__all__ = ["update_block"]


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
