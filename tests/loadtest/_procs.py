"""Finding processes a test started, to prove none outlives it; running a benchmark so.

Every child of a benchmark inherits the environment, so a test sets a unique variable and
looks for any process that still carries it: that finds grandchildren and orphans too,
which a parent-pid check would miss, and never another test's processes.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pdgate.loadtest.lib.redis import INSTALL_HINT, redis_binary

MARK = "PDGATE_LOADTEST_TEST_MARK"


def carrying(value: str) -> list[int]:
    """Pids of live (not zombie) processes whose environment has MARK=value, this one aside."""
    needle = f"{MARK}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if needle in (entry / "environ").read_bytes().split(b"\0") and not is_gone(
                int(entry.name)
            ):
                found.append(int(entry.name))
    return found


def is_gone(pid: int) -> bool:
    """No such process, or a zombie (dead, waiting to be reaped by whoever adopted it)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return any(
        line.split()[1:2] == ["Z"] for line in status.splitlines() if line.startswith("State:")
    )


def wait_gone(pids: list[int], timeout_s: float = 5.0) -> list[int]:
    """The pids still alive after `timeout_s` (signals take a moment to land)."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in pids if not is_gone(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


@contextlib.contextmanager
def marked(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Mark every process started inside the block; on exit, assert none is left."""
    value = uuid.uuid4().hex
    monkeypatch.setenv(MARK, value)
    yield value
    monkeypatch.delenv(MARK)
    left = wait_gone(carrying(value))
    assert not left, f"processes left running: {left}"


def needs_redis() -> None:
    """Fail (not skip) without ``redis-server``: `make test` installs it, so its absence is
    a broken setup."""
    if redis_binary() is None:
        pytest.fail(INSTALL_HINT)


# ``pdgate bench ARGS`` in this process; the lines it printed on stdout (fixture `run_bench`,
# tests/loadtest/conftest.py).
RunBench = Callable[[list[str]], list[str]]
