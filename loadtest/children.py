"""Child processes of ``pdgate bench gateway``: start, wait until ready, read CPU and RSS, stop.

Every front end under test runs in its own process so its CPU time and memory can be read
from ``/proc`` apart from the load client's. Output goes to a temporary file (nobody has to
drain a pipe) in which readiness is looked for; stopping closes stdin (how the shims child
quits), then SIGTERM, then SIGKILL, only ever to this child's own pid.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

__all__ = ["Child", "find_binary", "free_port"]

_CLK_TCK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def find_binary(name: str) -> str | None:
    """An executable installed next to this interpreter (a venv's bin, where pip puts a
    wheel's scripts) or else on PATH."""
    return shutil.which(name, path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")


def free_port() -> int:
    """A port free right now (another process could take it before the child binds it; the
    child then fails to start and says so)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Child:
    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        quits_on_eof: bool = False,  # the child stops when its stdin closes
    ) -> None:
        self.name = name
        self._quits_on_eof = quits_on_eof
        self._argv = list(argv)
        self._env = {**os.environ, **(env or {})}
        self._proc: asyncio.subprocess.Process | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self._proc is not None, f"{self.name} is not running"
        return self._proc.pid

    async def start(self, ready: str, timeout_s: float = 30.0) -> re.Match[str]:
        """Start; return the first match of the `ready` regex in the child's output."""
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed by stop()
        self._proc = await asyncio.create_subprocess_exec(
            *self._argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=self._log,
            stderr=self._log,
            env=self._env,
        )
        pattern = re.compile(ready)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = pattern.search(self.output())
            if match:
                return match
            if self._proc.returncode is not None:
                break
            await asyncio.sleep(0.05)
        tail = "\n".join(self.output().splitlines()[-20:])
        await self.stop()
        raise RuntimeError(f"{self.name} did not start (waited for {ready!r}):\n{tail}")

    def output(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def cpu_s(self) -> float:
        """User + system CPU seconds of the process (all its threads)."""
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime, stime

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE

    async def stop(self, timeout_s: float = 5.0) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            if proc.stdin is not None:
                with contextlib.suppress(OSError, RuntimeError):
                    proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), 2.0 if self._quits_on_eof else 0.0)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                    proc.terminate()
                try:
                    await asyncio.wait_for(proc.wait(), timeout_s)
                except TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                    await proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
