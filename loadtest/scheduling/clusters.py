"""The scheduling benchmark's cluster, from the parent's side, in either deployment:

* ``inprocess`` (the default): one child process hosts every shim and the gateway on one
  event loop with the in-memory registry (``python -m pdgate.loadtest.scheduling.cluster``);
  cheap to start, and its event-loop lag is measured from inside; one gateway only;
* ``processes``: as deployed (loadtest/lib/deployed.py): every shim and every gateway its
  own ``pdgate`` process, membership through a private Redis. What the fault and fleet
  measurements see, and the only way gateways of a fleet can each have a core.

Both give the runner the same handle: URLs, readiness and CPU readings. The servers get the
same settings either way (modes.py: `shim_fields`, `gateway_fields`).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass

import aiohttp
import orjson

from pdgate.loadtest.lib.children import Child
from pdgate.loadtest.lib.deployed import DeployedCluster, Deployment
from pdgate.loadtest.lib.probes import (
    LOOP_LAG,
    bucket_quantile,
    read_histogram,
    wait_instances,
)
from pdgate.loadtest.scheduling.modes import (
    ClusterSpec,
    Mode,
    gateway_fields,
    shim_fields,
    shim_role,
)

__all__ = [
    "DEPLOYS",
    "INPROCESS_FLEET",
    "Cluster",
    "ClusterUrls",
    "InProcessCluster",
    "ProcessCluster",
    "open_cluster",
]

DEPLOYS = ("inprocess", "processes")

INPROCESS_FLEET = (
    "the in-process cluster runs one gateway: gateways on one event loop would share one "
    "in-memory registry and fleet view, which is not a fleet; use --deploy processes for "
    "several gateways (each its own process on a shared Redis)"
)


@dataclass(frozen=True, slots=True)
class ClusterUrls:
    gateways: list[str]
    prefills: list[str]
    decodes: list[str]


class Cluster:
    """A running cluster: ``async with open_cluster(spec, mode, deploy) as cluster``."""

    deploy = ""

    def __init__(self, spec: ClusterSpec, mode: Mode) -> None:
        self.spec = spec
        self.mode = mode
        self._urls: ClusterUrls | None = None

    @property
    def urls(self) -> ClusterUrls:
        assert self._urls is not None, "the cluster is not running"
        return self._urls

    async def wait_ready(self, session: aiohttp.ClientSession, timeout_s: float = 30.0) -> None:
        """Until every gateway sees every instance ready (membership is eventually consistent)."""
        want = self.spec.prefills + self.spec.decodes
        deadline = time.monotonic() + timeout_s  # one bound for all gateways together
        for gateway in self.urls.gateways:
            await wait_instances(session, gateway, want, max(0.0, deadline - time.monotonic()))

    async def stats(self) -> dict[str, float]:
        """``cpu_s`` (the cluster's CPU seconds so far), ``gateway_cpu_s`` (the gateways' part,
        NaN where they share a process with the shims), ``wall_s`` (a monotonic clock) and
        ``lag_*`` (event-loop lag since the previous call, ms: in-process, the p50, p99 and
        max of the cluster process's loop; as processes, the worst gateway's p99)."""
        raise NotImplementedError

    async def __aenter__(self) -> Cluster:
        raise NotImplementedError

    async def aclose(self) -> None:
        """Stop every server of the cluster."""
        raise NotImplementedError

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class InProcessCluster(Cluster):
    deploy = "inprocess"

    def __init__(self, spec: ClusterSpec, mode: Mode) -> None:
        if spec.gateways != 1:
            raise ValueError(INPROCESS_FLEET)
        super().__init__(spec, mode)
        argv = [sys.executable, "-m", "pdgate.loadtest.scheduling.cluster",
                orjson.dumps(spec.to_json()).decode(),
                orjson.dumps(mode.to_json()).decode()]  # fmt: skip
        # It answers `stats` lines on stdout and stops at the end of its stdin.
        self._child = Child(f"cluster ({mode.name})", argv, quits_on_eof=True, replies=True)

    async def __aenter__(self) -> InProcessCluster:
        match = await self._child.start(r"^\{", timeout_s=60.0)
        data = orjson.loads(match.string)
        self._urls = ClusterUrls(data["gateways"], data["prefills"], data["decodes"])
        return self

    async def stats(self) -> dict[str, float]:
        data: dict[str, float] = orjson.loads(await self._child.ask(b"stats"))
        return {"gateway_cpu_s": math.nan, **data}

    async def aclose(self) -> None:
        await self._child.stop()


class ProcessCluster(Cluster):
    deploy = "processes"

    def __init__(self, spec: ClusterSpec, mode: Mode, *, log_level: str = "WARNING") -> None:
        super().__init__(spec, mode)
        self._deployed = DeployedCluster(
            Deployment(
                prefills=spec.prefills,
                decodes=spec.decodes,
                gateways=spec.gateways,
                prefill_settings=shim_fields(spec, mode, "prefill"),
                decode_settings=shim_fields(spec, mode, "decode"),
                gateway_settings=gateway_fields(spec, mode),
                prefill_role=shim_role(mode, "prefill"),
                decode_role=shim_role(mode, "decode"),
                key_prefix=f"pdgate-bench-{mode.name}",
                log_level=log_level,
            )
        )

        self._session: aiohttp.ClientSession | None = None
        self._lag_seen: dict[str, dict[float, float]] = {}  # per gateway: its last histogram

    @property
    def deployed(self) -> DeployedCluster:
        return self._deployed

    async def __aenter__(self) -> ProcessCluster:
        d = await self._deployed.__aenter__()
        self._urls = ClusterUrls(d.gateway_urls, d.prefill_urls, d.decode_urls)
        return self

    async def stats(self) -> dict[str, float]:
        self._deployed.check_alive()
        gateways = sum(c.cpu_s() for c in self._deployed.gateways)
        shims = sum(c.cpu_s() for c in (*self._deployed.prefills, *self._deployed.decodes))
        wall = time.monotonic()
        lags = await self._loop_lag_p99_s()
        known = [lag for lag in lags if not math.isnan(lag)]
        each = (
            {f"lag_p99_ms_gw{i}": 1000 * lag for i, lag in enumerate(lags)} if len(lags) > 1 else {}
        )
        return {"cpu_s": gateways + shims, "gateway_cpu_s": gateways, "wall_s": wall,
                "lag_p99_ms": 1000 * max(known) if known else math.nan, **each}  # fmt: skip

    async def _loop_lag_p99_s(self) -> list[float]:
        """Each gateway's event-loop lag p99 since the previous call, from its own histogram
        (the bound of the bucket that holds it; NaN: nothing observed)."""
        if self._session is None:
            self._session = aiohttp.ClientSession()
        out = []
        for url in self.urls.gateways:
            now = await read_histogram(self._session, url, LOOP_LAG)
            before = self._lag_seen.get(url, {})
            self._lag_seen[url] = now
            out.append(
                bucket_quantile([(le, n - before.get(le, 0.0)) for le, n in now.items()], 0.99)
            )
        return out

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
        await self._deployed.aclose()


def open_cluster(spec: ClusterSpec, mode: Mode, deploy: str) -> Cluster:
    if deploy == "inprocess":
        return InProcessCluster(spec, mode)
    if deploy == "processes":
        return ProcessCluster(spec, mode)
    raise ValueError(f"unknown deployment {deploy!r}; known: {', '.join(DEPLOYS)}")
