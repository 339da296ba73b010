"""The benchmarks' one handle on a child process: start, wait until ready, talk, measure, stop.

Every process a benchmark starts (shims, gateways, whole clusters, Redis, vllm-router,
py-spy) goes through `Child`, so every one of them is stopped on every path:

* each child leads its own process group (``start_new_session``), and stopping signals the
  whole group, so whatever the child started itself goes too; a Ctrl-C on the terminal
  reaches only the benchmark, which then stops its children in order;
* each child asks the kernel for SIGTERM when the benchmark dies (``PR_SET_PDEATHSIG``), so
  a benchmark killed with SIGKILL leaves no stray servers behind;
* `run_main` turns SIGTERM and SIGHUP into a cancellation of the benchmark's main task, so
  its ``finally`` blocks (which stop the children) run as they do for Ctrl-C.

Output goes to a temporary file (nobody has to drain a pipe), where readiness is looked
for; with ``replies=True`` stdout is a pipe instead and carries a line protocol (`ask`).
Stopping closes stdin (how the line-protocol children quit), then sends SIGTERM, then
SIGKILL, only ever to this child's own process group.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import fcntl
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Self, TypeVar

from pdgate.loadtest.lib import procfs

__all__ = ["Child", "Children", "find_binary", "free_port", "run_main", "start_all"]

T = TypeVar("T")

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_TAIL_BYTES = 64 * 1024  # of the output, shown when a child fails


def find_binary(name: str, *extra_dirs: str) -> str | None:
    """An executable installed next to this interpreter (a venv's bin, where pip puts a
    wheel's scripts), else on PATH, else in one of `extra_dirs`."""
    path = os.pathsep.join(
        [str(Path(sys.executable).parent), os.environ.get("PATH", ""), *extra_dirs]
    )
    return shutil.which(name, path=path)


def free_port() -> int:
    """A port free right now (another process could take it before the child binds it; the
    child then fails to start and says so)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _prctl() -> Callable[[int, int], int] | None:
    """libc's prctl, looked up before any fork (the child must not load libraries)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn: Callable[[int, int], int] = libc.prctl
    return fn


_PRCTL = _prctl()


def _dies_with(parent: int) -> Callable[[], None] | None:
    """A preexec hook: SIGTERM to the child when `parent` dies (and exit at once if it is
    already gone, which the kernel would otherwise never signal)."""
    prctl = _PRCTL
    if prctl is None:
        return None

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(1)

    return hook


class Child:
    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        quits_on_eof: bool = False,  # the child stops by itself when its stdin closes
        replies: bool = False,  # stdout is a line protocol (start matches it; `ask` reads it)
        eof_wait_s: float = 10.0,  # how long a quits_on_eof child may take to stop
    ) -> None:
        self.name = name
        self._argv = list(argv)
        self._env = {**os.environ, **(env or {})}
        self._quits_on_eof = quits_on_eof
        self._replies = replies
        self._eof_wait_s = eof_wait_s
        self._proc: asyncio.subprocess.Process | None = None
        self._log: IO[bytes] | None = None
        self.returncode: int | None = None

    @property
    def pid(self) -> int:
        assert self._proc is not None, f"{self.name} is not running"
        return self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def start(self, ready: str, timeout_s: float = 30.0) -> re.Match[str]:
        """Start; return the first match of the `ready` regex in the child's output (in its
        stdout lines with ``replies``)."""
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed by stop()
        # The child writes through the same open file as our reads seek in: without
        # O_APPEND its writes would land wherever our last read left the shared offset,
        # overwriting earlier output (a ready line could lose its first bytes).
        fd = self._log.fileno()
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
        self._proc = await asyncio.create_subprocess_exec(
            *self._argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE if self._replies else self._log,
            stderr=self._log,
            env=self._env,
            start_new_session=True,
            preexec_fn=_dies_with(os.getpid()),
        )
        pattern = re.compile(ready)
        try:
            if self._replies:
                return await asyncio.wait_for(self._ready_line(pattern), timeout_s)
            return await self._ready_output(pattern, timeout_s)
        except (TimeoutError, EOFError, RuntimeError) as exc:
            tail = self.output_tail()
            await self.stop(timeout_s=1.0)
            raise RuntimeError(
                f"{self.name} did not start (waited for {ready!r}):\n{tail}"
            ) from exc

    async def _ready_output(self, pattern: re.Pattern[str], timeout_s: float) -> re.Match[str]:
        proc = self._proc  # kept: a concurrent stop() clears self._proc
        assert proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = pattern.search(self._read_log())
            if match:
                return match
            if proc.returncode is not None:
                raise RuntimeError(f"{self.name} exited with {proc.returncode}")
            await asyncio.sleep(0.05)
        raise TimeoutError

    async def _ready_line(self, pattern: re.Pattern[str]) -> re.Match[str]:
        while True:
            line = (await self.readline()).decode(errors="replace")
            match = pattern.search(line)
            if match:
                return match

    async def readline(self) -> bytes:
        """The next line of a ``replies`` child's stdout (EOFError once it exited)."""
        assert self._proc is not None and self._proc.stdout is not None
        line = await self._proc.stdout.readline()
        if not line:
            raise EOFError(f"{self.name} exited")
        return line

    async def ask(self, line: bytes, timeout_s: float = 10.0) -> bytes:
        """Write one line to the child's stdin, return its one-line answer."""
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(line.rstrip(b"\n") + b"\n")
        await self._proc.stdin.drain()
        return await asyncio.wait_for(self.readline(), timeout_s)

    def _read_log(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def output_tail(self, lines: int = 20) -> str:
        """The last lines the child wrote (stdout too unless ``replies``), kept until stop."""
        if self._log is None:
            return ""
        size = self._log.seek(0, os.SEEK_END)
        self._log.seek(max(0, size - _TAIL_BYTES))
        text = self._log.read().decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def cpu_s(self) -> float:
        """User + system CPU seconds of the process (all its threads) and of its live
        children (the workers of a supervisor)."""
        return procfs.tree_cpu_s(self.pid)

    def rss_bytes(self) -> int:
        return procfs.rss_bytes(self.pid)

    def open_fds(self) -> int:
        return procfs.open_fds(self.pid)

    async def wait(self, timeout_s: float | None = None) -> int:
        """Until the child exits by itself; its exit status."""
        assert self._proc is not None, f"{self.name} was not started"
        code = await asyncio.wait_for(self._proc.wait(), timeout_s)
        self.returncode = code
        return code

    def _signal_group(self, sig: signal.Signals) -> None:
        assert self._proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the child and everything in its process group; idempotent, and a no-op for
        one that never started."""
        proc = self._proc
        if proc is not None:
            try:
                await self._stop(proc, timeout_s)
            finally:
                # Its group's stragglers (the leader is gone; anything it left behind is not).
                self._signal_group(signal.SIGKILL)
                self._proc = None
                self.returncode = proc.returncode
        if self._log is not None:
            self._log.close()
            self._log = None

    async def _stop(self, proc: asyncio.subprocess.Process, timeout_s: float) -> None:
        if proc.returncode is None and proc.stdin is not None:
            with contextlib.suppress(OSError, RuntimeError):
                proc.stdin.close()
        if proc.returncode is None and self._quits_on_eof:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), self._eof_wait_s)
        if proc.returncode is None:
            self._signal_group(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), timeout_s)
            except TimeoutError:
                self._signal_group(signal.SIGKILL)
                await proc.wait()


async def start_all(
    starts: Sequence[tuple[Child, str]], timeout_s: float = 30.0
) -> list[re.Match[str]]:
    """Start several children at once (their imports overlap); their ready matches, in order.
    The first failure cancels the other starts and is raised; stopping the children (those
    that did start) is the caller's, as for one."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(child.start(ready, timeout_s)) for child, ready in starts]
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [t.result() for t in tasks]


def run_main(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` where SIGTERM and SIGHUP cancel `main` like Ctrl-C does, so its
    children are stopped on the way out; the process then exits with 128 + the signal."""
    caught: list[int] = []

    async def guarded() -> T:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGHUP)

        def cancel(sig: int) -> None:
            caught.append(sig)
            task.cancel()

        for sig in signals:
            loop.add_signal_handler(sig, cancel, sig)
        try:
            return await main
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)

    try:
        return asyncio.run(guarded())
    except asyncio.CancelledError:
        if caught:
            raise SystemExit(128 + caught[0]) from None
        raise


class Children:
    """``async with`` a group of child processes: `_start` starts them all, or `aclose`
    stops those that did start and the error goes on; leaving the block calls `aclose`."""

    async def _start(self) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        try:
            await self._start()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
