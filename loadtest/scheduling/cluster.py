"""The in-process cluster (``--deploy inprocess``), run as its own process:
``python -m pdgate.loadtest.scheduling.cluster SPEC_JSON MODE_JSON``.

A separate process so the load generator never steals the cluster's event loop (on two
cores that would distort every latency). Like ``pdgate up`` it hosts the gateways and every
shim on one event loop with the in-memory registry, but prefills and decodes get their own
settings (slot counts differ) and the prefills' prefix cache is sized
(``sim_prefix_cache_blocks``). ``--deploy processes`` (clusters.py) runs the same settings
as separate ``pdgate`` processes instead.

One gateway only: gateways on one loop would share the in-memory registry and the fleet
state of one process, which is not how a fleet's gateways share it (through Redis, each
with its own view): ``--deploy processes`` measures a fleet.

Protocol on stdin/stdout, one JSON line each way: the child prints
``{"gateway": url, "prefills": [...], "decodes": [...]}`` once serving; each ``stats`` line
read from stdin is answered with the CPU seconds used and the event-loop lag seen since the
previous one; ``quit`` or end of input stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson

from pdgate.config import GatewaySettings, RegistrySettings, Role, ShimSettings
from pdgate.config.server import bind_socket, bound_port, run, serving
from pdgate.engine_shim.app import build_shim_app
from pdgate.gateway.app import build_gateway_app
from pdgate.gateway.observe.loop_lag import LoopLagMonitor
from pdgate.loadtest.lib.procfs import own_cpu_s
from pdgate.loadtest.scheduling.clusters import INPROCESS_FLEET
from pdgate.loadtest.scheduling.modes import (
    ClusterSpec,
    Mode,
    gateway_fields,
    shim_fields,
    shim_role,
)
from pdgate.registry import open_registry

__all__ = ["LoopLag", "serve_cluster"]

_HOST = "127.0.0.1"


class LoopLag:
    """How late the event loop wakes a 10 ms sleeper (the gateway's own `LoopLagMonitor`,
    kept as samples for exact percentiles): a CPU-saturation signal that, unlike CPU time,
    also shows a loop blocked by one long callback."""

    def __init__(self, period_s: float = 0.01) -> None:
        self._samples: list[float] = []
        self._monitor = LoopLagMonitor(self._add, period_s)

    def start(self) -> None:
        self._monitor.start()

    async def stop(self) -> None:
        await self._monitor.stop()

    def _add(self, lag_s: float) -> None:
        if len(self._samples) < 100_000:  # bounded between two reads
            self._samples.append(lag_s)

    def take(self) -> dict[str, float]:
        """Lag percentiles (ms) since the previous call."""
        samples, self._samples = sorted(self._samples), []
        if not samples:
            return {"lag_p50_ms": 0.0, "lag_p99_ms": 0.0, "lag_max_ms": 0.0}

        def at(q: float) -> float:
            return 1000 * samples[min(len(samples) - 1, int(q * len(samples)))]

        return {"lag_p50_ms": at(0.5), "lag_p99_ms": at(0.99), "lag_max_ms": 1000 * samples[-1]}


@contextlib.asynccontextmanager
async def serve_cluster(spec: ClusterSpec, mode: Mode) -> AsyncIterator[dict[str, Any]]:
    """Start the shims and the gateway; yield their URLs; stop everything on exit."""
    if spec.gateways != 1:
        raise ValueError(INPROCESS_FLEET)
    registry_settings = RegistrySettings()
    gateway = GatewaySettings(host=_HOST, port=0, **gateway_fields(spec, mode))
    async with contextlib.AsyncExitStack() as stack:
        registry = open_registry(registry_settings)
        stack.push_async_callback(registry.aclose)
        urls: dict[Role, list[str]] = {Role.PREFILL: [], Role.DECODE: []}
        for role, count in ((Role.PREFILL, spec.prefills), (Role.DECODE, spec.decodes)):
            for _ in range(count):
                sock = bind_socket(_HOST, 0)
                fields = shim_fields(spec, mode, role.value)
                settings = ShimSettings(
                    host=_HOST,
                    port=bound_port(sock),
                    role=Role(shim_role(mode, role.value)),
                    drain_timeout_s=0,
                    **fields,
                )
                app = build_shim_app(settings, registry, registry_settings)
                await stack.enter_async_context(serving(app, sock))
                urls[role].append(f"http://{_HOST}:{settings.port}")
        sock = bind_socket(_HOST, 0)
        await stack.enter_async_context(
            serving(build_gateway_app(gateway, registry, registry_settings), sock)
        )
        yield {
            "gateways": [f"http://{_HOST}:{bound_port(sock)}"],
            "prefills": urls[Role.PREFILL],
            "decodes": urls[Role.DECODE],
        }


async def _main(spec: ClusterSpec, mode: Mode) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    lag = LoopLag()
    async with serve_cluster(spec, mode) as urls:
        lag.start()
        print(orjson.dumps(urls).decode(), flush=True)
        while True:
            line = (await reader.readline()).strip()
            if line == b"stats":
                stats = {"cpu_s": own_cpu_s(), "wall_s": time.monotonic(), **lag.take()}
                print(orjson.dumps(stats).decode(), flush=True)
            elif line in (b"quit", b""):
                break
        await lag.stop()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(
            "usage: python -m pdgate.loadtest.scheduling.cluster SPEC_JSON MODE_JSON",
            file=sys.stderr,
        )
        return 2
    spec = ClusterSpec.from_json(orjson.loads(argv[0]))
    mode = Mode.from_json(orjson.loads(argv[1]))
    run(_main(spec, mode))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
