"""The one child-process handle: every child (and whatever it started) stopped on every path,
with real processes and real signals."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from pdgate.loadtest.lib.children import Child, start_all
from tests.loadtest._procs import is_gone, marked, wait_gone

_SLEEPER = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(300)"]


async def test_stop_ends_the_child_and_what_it_started(monkeypatch: pytest.MonkeyPatch) -> None:
    with marked(monkeypatch):
        # A shell that starts a grandchild and waits: the grandchild is in the child's group.
        child = Child("shell", ["sh", "-c", "sleep 300 & echo grandchild $!; wait"])
        match = await child.start(r"grandchild (\d+)")
        grandchild = int(match.group(1))
        assert not is_gone(child.pid) and not is_gone(grandchild)
        pid = child.pid
        await child.stop(timeout_s=2)
        assert wait_gone([pid, grandchild]) == []
        await child.stop()  # idempotent


async def test_a_child_that_ignores_sigterm_is_killed(monkeypatch: pytest.MonkeyPatch) -> None:
    stubborn = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('up', flush=True); time.sleep(300)"
    )
    with marked(monkeypatch):
        child = Child("stubborn", [sys.executable, "-c", stubborn])
        await child.start("up")
        pid = child.pid
        await child.stop(timeout_s=0.3)
        assert child.returncode == -signal.SIGKILL
        assert wait_gone([pid]) == []


async def test_a_failed_start_says_why_and_leaves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    with marked(monkeypatch):
        child = Child("broken", [sys.executable, "-c", "import sys; sys.exit('no port for you')"])
        with pytest.raises(RuntimeError, match="no port for you"):
            await child.start("never printed", timeout_s=10)
        silent = Child("silent", _SLEEPER)
        with pytest.raises(RuntimeError, match="did not start"):
            await silent.start("never printed", timeout_s=0.5)


async def test_start_all_cancels_the_others_on_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    with marked(monkeypatch):
        ok = Child("ok", _SLEEPER)
        broken = Child("broken", [sys.executable, "-c", "raise SystemExit(3)"])
        try:
            with pytest.raises(RuntimeError, match="broken"):
                await start_all([(ok, "never printed"), (broken, "never printed")], timeout_s=20)
        finally:
            await asyncio.gather(ok.stop(), broken.stop())


async def test_line_protocol() -> None:
    answer = (
        "import sys\n"
        "print('ready', flush=True)\n"
        "for line in sys.stdin:\n"
        "    print('you said ' + line.strip(), flush=True)\n"
    )
    child = Child("echo", [sys.executable, "-c", answer], quits_on_eof=True, replies=True)
    await child.start("^ready")
    try:
        assert await child.ask(b"stats") == b"you said stats\n"
        assert await child.ask(b"again\n") == b"you said again\n"
    finally:
        await child.stop()
    assert child.returncode == 0  # it quit by itself at the end of its input


_PARENT = textwrap.dedent(
    """
    import asyncio, sys
    from pdgate.loadtest.lib.children import Child, run_main

    async def main() -> None:
        child = Child("sleeper", {sleeper!r})
        try:
            await child.start("up")
            print(child.pid, flush=True)
            await asyncio.sleep(300)
        finally:
            await child.stop()

    run_main(main())
    """
)


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _parent() -> tuple[subprocess.Popen[str], int]:
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT.format(sleeper=_SLEEPER)],
        stdout=subprocess.PIPE,
        text=True,
        # As from a terminal: a suite started in the background (`make test &`) inherits an
        # ignored SIGINT, and an ignored Ctrl-C would make the SIGINT case hang.
        preexec_fn=_sigint_default,
    )
    assert parent.stdout is not None
    line = parent.stdout.readline()
    assert line.strip().isdigit(), line
    return parent, int(line)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signalled_benchmark_stops_its_children(
    monkeypatch: pytest.MonkeyPatch, sig: signal.Signals
) -> None:
    """SIGTERM (or Ctrl-C) to a benchmark runs its clean-up, which stops its children."""
    with marked(monkeypatch):
        parent, child = _parent()
        try:
            parent.send_signal(sig)
            code = parent.wait(timeout=15)
        finally:
            parent.kill()
            parent.wait()
        if sig is signal.SIGTERM:
            assert code == 128 + signal.SIGTERM
        assert wait_gone([child]) == []


def test_a_killed_benchmark_leaves_no_children(monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGKILL runs no clean-up at all: the kernel tells the child (PR_SET_PDEATHSIG)."""
    with marked(monkeypatch):
        parent, child = _parent()
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=5)
        assert wait_gone([child]) == []
