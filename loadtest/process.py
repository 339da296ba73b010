"""The parent's handle on a cluster child process (loadtest/cluster.py).

The child's stderr goes to a temporary file, not a pipe nobody drains, and its last lines
are shown when it fails to start. Stopping asks politely (``quit``), then terminates and
finally kills only that child, by its own pid.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import IO, Any

import aiohttp
import orjson

from loadtest.modes import ClusterSpec, Mode
from loadtest.probes import wait_instances

__all__ = ["ClusterProcess", "ClusterUrls"]


@dataclass(frozen=True, slots=True)
class ClusterUrls:
    gateways: list[str]
    prefills: list[str]
    decodes: list[str]


class ClusterProcess:
    def __init__(self, spec: ClusterSpec, mode: Mode) -> None:
        self.spec = spec
        self.mode = mode
        self._proc: asyncio.subprocess.Process | None = None
        self._log: IO[bytes] | None = None
        self.urls: ClusterUrls | None = None

    async def __aenter__(self) -> ClusterProcess:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
        self.close()

    async def start(self, timeout_s: float = 60.0) -> ClusterUrls:
        # Kept open after the child exits (log_tail), closed by close().
        self._log = tempfile.TemporaryFile()  # noqa: SIM115
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "loadtest.cluster",
            orjson.dumps(self.spec.to_json()).decode(),
            self.mode.name,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=self._log,
        )
        try:
            line = await asyncio.wait_for(self._readline(), timeout_s)
            data = orjson.loads(line)
        except (TimeoutError, orjson.JSONDecodeError, EOFError) as exc:
            await self.stop(timeout_s=1.0)
            tail = self.log_tail()
            raise RuntimeError(f"cluster ({self.mode.name}) did not start:\n{tail}") from exc
        self.urls = ClusterUrls(data["gateways"], data["prefills"], data["decodes"])
        return self.urls

    async def _readline(self) -> bytes:
        assert self._proc is not None and self._proc.stdout is not None
        line = await self._proc.stdout.readline()
        if not line:
            raise EOFError("the cluster process exited")
        return line

    async def wait_ready(self, session: aiohttp.ClientSession, timeout_s: float = 30.0) -> None:
        """Until every gateway sees every instance ready (membership is eventually consistent)."""
        assert self.urls is not None
        want = self.spec.prefills + self.spec.decodes
        deadline = time.monotonic() + timeout_s  # one bound for all gateways together
        for gateway in self.urls.gateways:
            await wait_instances(session, gateway, want, max(0.0, deadline - time.monotonic()))

    async def stats(self) -> dict[str, Any]:
        """CPU seconds and event-loop lag of the child (lag: since the previous call)."""
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(b"stats\n")
        await self._proc.stdin.drain()
        data: dict[str, Any] = orjson.loads(await asyncio.wait_for(self._readline(), 10))
        return data

    async def stop(self, timeout_s: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            if proc.stdin is not None:
                with contextlib.suppress(OSError, RuntimeError):
                    proc.stdin.write(b"quit\n")
                    proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), timeout_s)
            except TimeoutError:
                proc.terminate()
                try:
                    await asyncio.wait_for(proc.wait(), 5)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()

    def log_tail(self, lines: int = 20) -> str:
        """The end of the child's stderr (kept after it stopped, until `close`)."""
        if self._log is None:
            return ""
        self._log.seek(0)
        text = self._log.read().decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
