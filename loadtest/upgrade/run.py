"""A rolling upgrade under load: every prefill, then every decode, then every gateway is
replaced, one at a time, while closed-loop users keep long streams open.

The fleet is deployed as it runs in production (loadtest/lib/deployed.py): each shim and
gateway its own ``pdgate`` process, membership in a private Redis. One restart is:

* **a shim** (prefill or decode): SIGTERM; the shim drains (registry state ``draining``,
  ``/health`` 503, new requests refused, held KV and running streams finished, at most
  ``drain_timeout_s``) and exits by itself; then a new shim of the same role starts (a new
  port, as a new pod gets a new IP) and the restart is over when every gateway lists it
  ``ready``. Replace-then-start, as ``maxUnavailable: 1`` rolls: the fleet runs one instance
  short meanwhile, so the load is sized for that.
* **a gateway**: as the Kubernetes layout does it (deploy/, docs/operations.md): out of the
  load balancer's rotation, then ``gateway_prestop_s`` of grace in which the streams it
  relays go on (the preStop sleep), then SIGTERM (uvicorn closes the listener and gives open
  connections 5 s), then a new gateway starts and joins the rotation once it sees every
  instance. With ``gateway_prestop_s = 0`` it is SIGTERMed while still in rotation, and
  clients learn it is gone from refused connections.

Phases: ``steady`` (before the first restart), one per restarted role, ``after``. A
request's TTFT belongs to the phase it was issued in, a failure to the phase it ended in.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pdgate.loadtest.lib.deployed import DeployedCluster
from pdgate.loadtest.lib.log import Log, to_stderr
from pdgate.loadtest.lib.pool import FleetRun, GatewayPool, sim_fleet
from pdgate.loadtest.lib.probes import wait_instances
from pdgate.loadtest.scheduling.workload import Scenario
from pdgate.loadtest.scheduling.workload import Workload as Prompts
from pdgate.loadtest.upgrade.load import Record, StreamingLoad

__all__ = ["QUICK", "Phase", "Restart", "UpgradePlan", "UpgradeResult", "run_upgrade"]

_MODEL = "sim-llama-3.1-8b"


@dataclass(frozen=True, slots=True)
class UpgradePlan:
    prefills: int = 2
    decodes: int = 2
    gateways: int = 2
    users: int = 24  # concurrent streams, split across the gateways
    prompt_tokens: tuple[int, int] = (128, 256)
    # Each stream asks for max_tokens/2..max_tokens tokens: at the decodes' batch (A100
    # profile) most streams outlast the gateways' 5 s graceful close, so only the preStop
    # grace keeps a gateway's restart from cutting them, and all end within that grace.
    max_tokens: int = 768
    sim_profile: str = "llama-3.1-8b-a100"
    prefill_capacity: int = 4
    # Room for every stream on one decode: while one restarts, the other takes them all.
    decode_capacity: int = 64
    drain_timeout_s: float = 60.0  # the shims' drain bound, beyond the longest stream
    gateway_prestop_s: float = 15.0  # deploy/'s preStop sleep; 0 = SIGTERM in rotation
    steady_s: float = 15.0  # load before the first restart (the TTFT reference)
    settle_s: float = 3.0  # between two restarts
    after_s: float = 10.0
    roles: tuple[str, ...] = ("prefill", "decode", "gateway")
    seed: int = 0
    register_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if min(self.prefills, self.decodes, self.gateways, self.users) < 1:
            raise ValueError("at least one of each server and one user")
        unknown = set(self.roles) - {"prefill", "decode", "gateway"}
        if unknown or not self.roles:
            raise ValueError(f"roles: some of prefill, decode, gateway (not {sorted(unknown)})")

    def count(self, role: str) -> int:
        return {"prefill": self.prefills, "decode": self.decodes, "gateway": self.gateways}[role]

    def scenario(self) -> Scenario:
        lo, hi = self.prompt_tokens
        # A deadline the gateway enforces anyway (its default, 10 s): the client only reads it.
        return Scenario("stream", prefix_tokens=0, body_min=lo, body_max=hi,
                        max_tokens=self.max_tokens, ttft_deadline_s=10.0)  # fmt: skip


QUICK = UpgradePlan(
    prefills=1, decodes=1, gateways=2, users=4, max_tokens=64, steady_s=3.0, settle_s=1.0,
    after_s=2.0, gateway_prestop_s=2.0, drain_timeout_s=20.0,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Restart:
    role: str
    slot: int
    old: str  # server names (deployed.py: role-N)
    new: str
    signalled_s: float  # since the run's origin
    exited_s: float
    started_s: float
    ready_s: float  # every gateway lists it ready (gateways: it sees every instance)
    exit_code: int | None  # 0: stopped by itself (drained); -9: killed
    out_of_rotation_s: float | None = None  # gateways: taken out of the load balancer
    open_at_signal: int | None = None  # gateways: requests it still held at SIGTERM

    @property
    def drain_s(self) -> float:
        return self.exited_s - self.signalled_s

    @property
    def start_s(self) -> float:
        return self.ready_s - self.exited_s

    @property
    def begin_s(self) -> float:
        return self.signalled_s if self.out_of_rotation_s is None else self.out_of_rotation_s

    def as_dict(self) -> dict[str, Any]:
        return {
            "role": self.role, "old": self.old, "new": self.new,
            "begin_s": round(self.begin_s, 3), "signalled_s": round(self.signalled_s, 3),
            "drain_s": round(self.drain_s, 3), "start_s": round(self.start_s, 3),
            "ready_s": round(self.ready_s, 3), "exit_code": self.exit_code,
            "open_at_signal": self.open_at_signal,
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    start_s: float
    end_s: float


@dataclass
class UpgradeResult:
    plan: UpgradePlan
    records: list[Record]
    restarts: list[Restart]
    phases: list[Phase]
    wall_s: float = 0.0
    load_avg: tuple[float, float] = (0.0, 0.0)
    cancelled: int = 0  # requests still running at the end that had to be cancelled
    notes: list[str] = field(default_factory=list)

    def phase_at(self, t: float) -> str:
        for p in self.phases:
            if p.start_s <= t < p.end_s:
                return p.name
        return self.phases[-1].name if self.phases and t >= self.phases[-1].end_s else "steady"


async def _listed_ready(session: aiohttp.ClientSession, gateway: str, url: str) -> bool:
    with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, KeyError, ValueError):
        async with session.get(
            gateway + "/admin/instances", timeout=aiohttp.ClientTimeout(total=5)
        ) as resp:
            rows = (await resp.json())["instances"]
            return any(r["url"] == url and r["state"] == "ready" for r in rows)
    return False


async def wait_listed(
    session: aiohttp.ClientSession, gateways: Sequence[str], url: str, timeout_s: float
) -> None:
    """Until every gateway lists the instance at `url` as ready."""
    deadline = time.monotonic() + timeout_s
    for gateway in gateways:
        while not await _listed_ready(session, gateway, url):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} not listed ready by {gateway} in {timeout_s:g} s")
            await asyncio.sleep(0.05)


async def _pending(session: aiohttp.ClientSession, gateway: str) -> int | None:
    """Requests the gateway holds (waiting or streaming), from its /health."""
    with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, KeyError, ValueError):
        async with session.get(gateway + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
            return int((await r.json())["pending"])
    return None


class _Upgrade(FleetRun[UpgradePlan]):
    async def shim(self, role: str, slot: int) -> Restart:
        cluster, plan = self.cluster, self.plan
        old = cluster.members(role)[0][slot].name
        signalled = self.now()
        code = await cluster.stop_member(role, slot, timeout_s=plan.drain_timeout_s + 10)
        exited = self.now()
        url = await cluster.start_member(role, slot)
        started = self.now()
        await wait_listed(self.session, self.pool.urls, url, plan.register_timeout_s)
        new = cluster.members(role)[0][slot].name
        return Restart(role, slot, old, new, signalled, exited, started, self.now(), code)

    async def gateway(self, slot: int) -> Restart:
        cluster, plan = self.cluster, self.plan
        old = cluster.gateways[slot].name
        url = self.pool.urls[slot]
        out: float | None = None
        if plan.gateway_prestop_s > 0:
            out = self.now()
            self.pool.remove(slot)
            await asyncio.sleep(plan.gateway_prestop_s)
        open_at_signal = await _pending(self.session, url)
        signalled = self.now()
        code = await cluster.stop_member("gateway", slot, timeout_s=30.0)
        exited = self.now()
        new_url = await cluster.start_member("gateway", slot)
        started = self.now()
        await wait_instances(
            self.session, new_url, plan.prefills + plan.decodes, plan.register_timeout_s
        )
        self.pool.add(slot, new_url)
        return Restart("gateway", slot, old, cluster.gateways[slot].name, signalled, exited,
                       started, self.now(), code, out, open_at_signal)  # fmt: skip


async def run_upgrade(plan: UpgradePlan, log: Log = to_stderr) -> UpgradeResult:
    began = time.monotonic()
    load0 = os.getloadavg()[0]
    deployment = sim_fleet(
        plan, _MODEL, "pdgate-bench-upgrade", drain_timeout_s=plan.drain_timeout_s
    )
    prompts = Prompts((plan.scenario(),), seed=plan.seed)
    restarts: list[Restart] = []
    phases: list[Phase] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with (
        DeployedCluster(deployment) as cluster,
        aiohttp.ClientSession(connector=connector) as session,
    ):
        for gateway in cluster.gateway_urls:
            await wait_instances(session, gateway, plan.prefills + plan.decodes)
        pool = GatewayPool(cluster.gateway_urls)
        origin = time.monotonic()
        load = StreamingLoad(
            session, pool, prompts, plan.users, _MODEL, origin=origin,
            ramp_s=min(8.0, plan.steady_s / 2), min_tokens=max(1, plan.max_tokens // 2),
        )  # fmt: skip
        upgrade = _Upgrade(plan, cluster, session, pool, origin, log)
        log(
            f"upgrade: {plan.users} users streaming {plan.max_tokens} tokens each through "
            f"{plan.gateways} gateways; {plan.prefills} prefills, {plan.decodes} decodes"
        )
        load.start()
        cancelled = 0
        after = 0.0
        try:
            await asyncio.sleep(plan.steady_s)
            phases.append(Phase("steady", 0.0, upgrade.now()))
            for role in plan.roles:
                start = upgrade.now()
                for slot in range(plan.count(role)):
                    r = await (
                        upgrade.gateway(slot) if role == "gateway" else upgrade.shim(role, slot)
                    )
                    restarts.append(r)
                    failed = sum(x.failed for x in load.records)
                    log(f"  {r.old} -> {r.new}: drain/close {r.drain_s:.1f} s (exit "
                        f"{r.exit_code}), new one ready after {r.start_s:.1f} s; "
                        f"{len(load.records)} requests done, {failed} failed, "
                        f"{load.in_flight} in flight")  # fmt: skip
                    await asyncio.sleep(plan.settle_s)
                phases.append(Phase(role, start, upgrade.now()))
            after = upgrade.now()
            await asyncio.sleep(plan.after_s)
        finally:
            cancelled = await load.stop(plan.drain_timeout_s + 30)
        phases.append(Phase("after", after, upgrade.now() + 1e-3))
        records = sorted(load.records, key=lambda r: r.issued_s)
    return UpgradeResult(plan, records, restarts, phases, time.monotonic() - began,
                         (load0, os.getloadavg()[0]), cancelled)  # fmt: skip
