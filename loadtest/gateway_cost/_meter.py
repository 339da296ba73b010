"""What one measurement window cost, and who paid: the front's process, the load client (this
process), the engines' process and the machine as a whole.

The load client is one Python process on one event loop, so it can never use more than one
core: ``client_cores`` near 1 means the client, not the front, set the pace of that window.
``host_busy_cores`` is every process on the machine, the measured ones and any other job, so
a window where it reaches the core count was bound by the machine.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import aiohttp

from pdgate.loadtest.lib import procfs
from pdgate.loadtest.lib.children import Child

__all__ = ["Tally", "WindowMeter", "engine_stats", "stats_delta"]


@dataclass(slots=True)
class Tally:
    """Sums over the windows of one (front, concurrency)."""

    requests: int = 0
    failures: int = 0
    events: int = 0
    window_s: float = 0.0  # the nominal windows, what requests/s is over
    elapsed_s: float = 0.0  # from each window's start to its last request's end
    front_cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    engine_cpu_s: float = 0.0
    host_busy_s: float = 0.0
    has_front: bool = False

    @classmethod
    def total(cls, tallies: Iterable[Tally]) -> Tally:
        """The sums over several tallies' windows (a concurrency's rounds)."""
        out = cls()
        for t in tallies:
            for f in fields(cls):
                if f.name != "has_front":
                    setattr(out, f.name, getattr(out, f.name) + getattr(t, f.name))
            out.has_front = out.has_front or t.has_front
        return out

    def per_1k(self, cpu_s: float) -> float:
        return 1000 * cpu_s / self.requests if self.requests else math.nan

    def cores(self, cpu_s: float) -> float:
        return cpu_s / self.elapsed_s if self.elapsed_s > 0 else math.nan

    def figures(self) -> dict[str, float]:
        """The window set's figures, by the suffix-less key they are reported under."""
        out = {
            "rps": self.requests / self.window_s if self.window_s else math.nan,
            "events_per_s": self.events / self.window_s if self.window_s else math.nan,
            "client_cpu_s_per_1k": self.per_1k(self.client_cpu_s),
            "client_cores": self.cores(self.client_cpu_s),
            "engine_cpu_s_per_1k": self.per_1k(self.engine_cpu_s),
            "host_busy_cores": self.cores(self.host_busy_s),
        }
        if self.has_front:
            out["cpu_s_per_1k"] = self.per_1k(self.front_cpu_s)
        return out


@dataclass(slots=True)
class WindowMeter:
    """CPU counters at a window's start (`start`, called when the window opens) and the
    differences at its end (`add_to`)."""

    front: Child | None
    engine: Child
    _marks: list[float] = field(default_factory=list)

    def _read(self) -> list[float]:
        front = self.front.cpu_s() if self.front is not None else 0.0
        now = time.monotonic()
        return [now, front, procfs.own_cpu_s(), self.engine.cpu_s(), procfs.host_busy_s()]

    def start(self) -> None:
        self._marks = self._read()

    def add_to(self, tally: Tally) -> None:
        """Add this window's CPU to `tally`. The window closes when the last request in
        flight ends, a little after its nominal length: its CPU is counted to then, with
        the requests that ended inside it (a slight over-count, the same for every front)."""
        if not self._marks:
            return  # the window never opened
        ends = self._read()
        now, front, client, engine, host = (b - a for a, b in zip(self._marks, ends, strict=True))
        tally.elapsed_s += now
        tally.front_cpu_s += front
        tally.client_cpu_s += client
        tally.engine_cpu_s += engine
        tally.host_busy_s += host
        tally.has_front = self.front is not None


async def engine_stats(session: aiohttp.ClientSession, urls: Sequence[str]) -> dict[str, Any]:
    """The stock engines' ``/_stats``, summed: requests per path and distinct connections."""

    async def one(url: str) -> dict[str, Any]:
        async with session.get(url + "/_stats", timeout=aiohttp.ClientTimeout(total=10)) as r:
            r.raise_for_status()
            body: dict[str, Any] = await r.json()
            return body

    paths: dict[str, int] = {}
    connections = 0
    for stats in await asyncio.gather(*(one(u) for u in urls)):
        for path, n in stats["paths"].items():
            paths[path] = paths.get(path, 0) + n
        connections += stats["connections"]
    return {"paths": paths, "connections": connections}


def stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the engines saw between two `engine_stats` snapshots (the snapshots' own
    ``GET /_stats`` requests left out)."""
    paths = {
        p: n - before["paths"].get(p, 0)
        for p, n in after["paths"].items()
        if p != "GET /_stats" and n != before["paths"].get(p, 0)
    }
    return {"paths": paths, "connections": after["connections"] - before["connections"]}
