"""One chaos run: a fleet deployed as separate processes, registry in Redis behind Sentinel,
steady open-loop streaming load through two gateways, then one fault at a time, and last the
overload of one gateway.

A fault's life (times since the run's origin, all kept in `FaultEvent`):

* ``began_s``: the fault is injected (kill -9, SIGSTOP, ...); ``ended_s``: the fault is over
  (the same instant for a kill; SIGCONT for a stop; the sentinels' promotion for the
  primary's kill);
* the fleet is made whole again (a replacement started, the old primary restarted) and
  ``ready_s`` is when every gateway lists every instance ready (the dead ones gone) and says
  its registry and fleet state are healthy;
* the load runs on for `ChaosPlan.observe_s` after the fault's end (and at least
  `ChaosPlan.after_ready_s` after ready); then the arrivals pause (``paused_s``), the open
  streams end, and, no earlier than 5 s after the fault's end, `snapshot` reads what is still
  held (``held``): gateways' open streams, in-flight counts, pending and queued requests;
  shims' used and queued slots, running sequences, held and sending KV; the fleet's live
  slot leases in Redis. With no request open every one of them must be 0, as in the
  baseline snapshot taken the same way before the first fault;
* the arrivals resume (``resumed_s``) and the next fault waits `ChaosPlan.settle_s`.

A gateway's kill also follows the KV the prefills held for it: from the kill, every
`_KV_POLL_S`, each prefill's ``/load`` says whether it holds KV for the killed gateway's
fleet id (``kv_gateways``) and how many calls it refused with 429 so far (``rejected``),
until none holds any (``kv_polls``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pdgate.config.settings import GatewaySettings
from pdgate.loadtest.chaos.load import OpenStreamingLoad, StreamRecord
from pdgate.loadtest.chaos.sentinel import SentinelRedis
from pdgate.loadtest.lib.children import Child
from pdgate.loadtest.lib.deployed import (
    GATEWAY_READY,
    DeployedCluster,
    settings_env,
)
from pdgate.loadtest.lib.log import Log, to_stderr
from pdgate.loadtest.lib.pool import FleetRun, GatewayPool, sim_fleet
from pdgate.loadtest.lib.probes import LOOP_LAG, read_histogram, wait_instances
from pdgate.loadtest.lib.rss import RssSample, RssSampler
from pdgate.loadtest.scheduling.workload import Scenario
from pdgate.loadtest.scheduling.workload import Workload as Prompts
from pdgate.registry._redis_url import open_redis
from pdgate.registry.base import RegistryUnavailable
from pdgate.registry.redis import RedisRegistry

__all__ = [
    "FAULTS",
    "QUICK",
    "ChaosPlan",
    "ChaosResult",
    "FaultEvent",
    "OverloadResult",
    "run_chaos",
]

_MODEL = "sim-llama-3.1-8b"
_PREFIX = "pdgate-bench-chaos"
# Streams a new gateway relays before its overload: more than its decode bound needs (20).
_WARM_STREAMS = 30

FAULTS = (
    "kill-prefill",
    "kill-decode",
    "stop-prefill",
    "stop-decode",
    "kill-gateway",
    "kill-redis-primary",
    "redis-empty",
)
FAULT_TITLES = {
    "kill-prefill": "kill -9 a prefill, start a replacement",
    "kill-decode": "kill -9 a decode mid-stream, start a replacement",
    "stop-prefill": "SIGSTOP a prefill, SIGCONT",
    "stop-decode": "SIGSTOP a decode mid-stream, SIGCONT",
    "kill-gateway": "kill -9 a gateway, restart it",
    "kill-redis-primary": "kill -9 the Redis primary (Sentinel fails over)",
    "redis-empty": "Redis emptied (FLUSHALL + every client cut off)",
}


@dataclass(frozen=True, slots=True)
class ChaosPlan:
    prefills: int = 2
    decodes: int = 2
    gateways: int = 2
    prefill_capacity: int = 4
    decode_capacity: int = 12
    sim_profile: str = "llama-3.1-8b-a100"
    rate_rps: float = 2.0  # Poisson arrivals over both gateways
    prompt_tokens: tuple[int, int] = (128, 256)
    max_tokens: int = 384  # each stream asks for min_tokens..max_tokens: ~2-4 s
    min_tokens: int = 192
    steady_s: float = 15.0  # load before the first fault (the reference)
    stop_s: float = 10.0  # how long a SIGSTOP lasts
    observe_s: float = 12.0  # load after a fault's end before the arrivals pause
    after_ready_s: float = 3.0  # ... and at least this long after the fleet is whole
    hold_check_s: float = 5.0  # the held snapshot is no earlier than this after the fault
    settle_s: float = 4.0  # after the arrivals resume, before the next fault
    faults: tuple[str, ...] = FAULTS
    down_after_ms: int = 1000  # Sentinel: the primary is judged down after this
    overload_factor: float = 10.0  # x the fleet's capacity
    overload_s: float = 20.0
    overload_rps: float | None = None  # default: overload_factor x the measured capacity
    probe_period_s: float = 0.1  # the /health probe of the overloaded gateway
    # More overloads, each of an extra gateway with these settings besides the defaults: a
    # short queue per (model, group) (the default is 1024), drain admission that judges
    # each request on arrival only (no sweep of its queue), and one that keeps no headroom
    # under heavy overload. Empty: only the fleet's gateway, as deployed.
    overload_variants: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = (
        ("queue_size=32", (("queue_size", 32),)),
        ("no drain_sweep", (("drain_sweep", False),)),
        ("drain_headroom=0", (("drain_headroom", 0.0),)),
    )
    seed: int = 0
    register_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        unknown = set(self.faults) - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}; known: {', '.join(FAULTS)}")
        if min(self.prefills, self.decodes) < 2 or self.gateways < 2:
            raise ValueError("two of each server at least: one takes over from the other")

    def scenario(self) -> Scenario:
        lo, hi = self.prompt_tokens
        return Scenario("stream", prefix_tokens=0, body_min=lo, body_max=hi,
                        max_tokens=self.max_tokens, ttft_deadline_s=10.0)  # fmt: skip


QUICK = ChaosPlan(
    rate_rps=2.0, max_tokens=96, min_tokens=48, steady_s=4.0, stop_s=6.0, observe_s=6.0,
    after_ready_s=1.0, settle_s=1.0, overload_s=5.0,
)  # fmt: skip


@dataclass
class FaultEvent:
    fault: str
    target: str  # the server the fault hit
    began_s: float
    ended_s: float
    ready_s: float = 0.0
    paused_s: float = 0.0
    snapshot_s: float = 0.0
    resumed_s: float = 0.0
    held: dict[str, float] = field(default_factory=dict)
    # What the target held at the fault: a gateway's pending requests, a shim's used slots.
    open_at_fault: int | None = None
    note: str = ""
    # A gateway's kill: its fleet id and its replacement's ("" not read), the fleet's lease
    # time, and from the kill each poll of the prefills: (since origin, per prefill whether
    # it held KV for the killed gateway and its 429s so far; None: it did not answer).
    gateway_ids: tuple[str, str] = ("", "")
    lease_s: float = 0.0
    kv_polls: list[tuple[float, list[tuple[bool, int] | None]]] = field(default_factory=list)


@dataclass
class OverloadResult:
    label: str  # which gateway: "defaults" or "queue_size=N"
    capacity_rps: float  # what the fleet sustains (decode slots / mean stream time)
    rate_rps: float  # offered
    began_s: float
    ended_s: float
    records: list[StreamRecord]
    probes: list[tuple[float, float]]  # (since origin, /health latency s); NaN: no answer
    idle_probe_s: float  # the /health latency before the overload (median)
    rss: list[RssSample]
    held: dict[str, float] = field(default_factory=dict)  # after it, once idle
    # The gateway's own pdgate_event_loop_lag_seconds over the overload: (le, count) pairs,
    # cumulative as exposed; empty if its /metrics could not be read.
    loop_lag: list[tuple[float, float]] = field(default_factory=list)


@dataclass
class ChaosResult:
    plan: ChaosPlan
    records: list[StreamRecord]
    faults: list[FaultEvent]
    baseline_held: dict[str, float]
    steady: tuple[float, float]  # the reference window (since origin)
    overloads: list[OverloadResult]
    wall_s: float = 0.0
    load_avg: tuple[float, float] = (0.0, 0.0)
    notes: list[str] = field(default_factory=list)


async def _kill9(child: Child) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)
    await child.stop(timeout_s=5)


def _signal(child: Child, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, sig)


async def _get_json(session: aiohttp.ClientSession, url: str, timeout_s: float = 5.0) -> Any:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        resp.raise_for_status()
        return await resp.json(content_type=None)


# A fault waits (10 s at most) until its target holds this many requests: decodes stream
# for seconds, so one is hit mid-stream; a prefill's work lasts tens of ms, so one is hit
# whenever it holds any.
_MID_STREAM = {"prefill": 1, "decode": 2}

_KV_POLL_S = 0.1  # how often a gateway's kill reads what the prefills hold for it

_GATEWAY_HELD = ("open_streams", "inflight", "pending", "queued")
_SHIM_HELD = ("used", "queued", "running", "waiting", "kv_held", "kv_sending", "retrieving")


async def fleet_leases(redis_url: str, prefix: str = _PREFIX) -> dict[str, float]:
    """Live entries of the fleet's slot-lease and computing sets (registry/fleet.py:
    ``PREFIX:fleet:slots:ID`` and ``PREFIX:fleet:computing:ID``, sorted sets scored by their
    expiry on the Redis clock), summed over the instances."""
    client = open_redis(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
    try:
        seconds, micros = await client.time()
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        out = {"redis_slot_leases": 0.0, "redis_computing": 0.0}
        for kind, key in (("slots", "redis_slot_leases"), ("computing", "redis_computing")):
            async for name in client.scan_iter(match=f"{prefix}:fleet:{kind}:*", count=200):
                out[key] += float(await client.zcount(name, f"({now_ms}", "+inf"))
        return out
    finally:
        await client.aclose()


async def _health(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    """The gateway's /health ({} if it did not answer)."""
    try:
        health = await _get_json(session, url + "/health", 2.0)
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
        return {}
    return health if isinstance(health, dict) else {}


def _gateway_id(health: dict[str, Any]) -> str:
    """The gateway's id in the fleet, from its /health ("" if it did not say)."""
    return str(health.get("gateway_id", ""))


async def _kv_for(
    session: aiohttp.ClientSession, url: str, gateway_id: str
) -> tuple[bool, int] | None:
    """(whether the prefill at `url` holds KV for `gateway_id`, its 429s so far); None if
    it did not answer."""
    try:
        load = await _get_json(session, url + "/load", 1.0)
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
        return None
    return gateway_id in load.get("kv_gateways", ()), int(load.get("rejected", 0))


async def snapshot(
    session: aiohttp.ClientSession, cluster: DeployedCluster, gateway_urls: list[str]
) -> dict[str, float]:
    """What the fleet holds now, summed per kind of server (NaN: a server did not answer)."""
    out: dict[str, float] = {}
    for url in gateway_urls:
        try:
            health = await _get_json(session, url + "/health")
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            health = {}
        for key in _GATEWAY_HELD:
            value = health.get(key)
            out[f"gw_{key}"] = out.get(f"gw_{key}", 0.0) + (
                float(value) if isinstance(value, int | float) else float("nan")
            )
    for role in ("prefill", "decode"):
        for url in cluster.members(role)[1]:
            try:
                load = await _get_json(session, url + "/load")
            except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
                load = {}
            for key in _SHIM_HELD:
                value = load.get(key, 0)
                out[f"{role}_{key}"] = out.get(f"{role}_{key}", 0.0) + (
                    float(value) if isinstance(value, int | float) else float("nan")
                )
    try:
        out.update(await fleet_leases(cluster.redis_url))
    except Exception:  # a failed read is reported (NaN), not fatal
        out["redis_slot_leases"] = float("nan")
    return out


async def _fleet_whole(
    session: aiohttp.ClientSession, gateways: list[str], shims: set[str], registry: RedisRegistry
) -> bool:
    """Every shim is registered in Redis (after Redis lost its data, the gateways' last view
    alone would look whole), and every gateway lists exactly `shims` ready, calls its
    registry and fleet healthy and sees every other gateway in the fleet."""
    try:
        registered = {r.url for r in await registry.snapshot()}
    except RegistryUnavailable:
        return False
    if registered != shims:
        return False
    for gateway in gateways:
        try:
            rows = (await _get_json(session, gateway + "/admin/instances", 2.0))["instances"]
            health = await _get_json(session, gateway + "/health", 2.0)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError, TypeError):
            return False
        ready = {r["url"] for r in rows if r.get("state") == "ready"}
        if ready != shims or health.get("registry") != "ok":
            return False
        fleet = health.get("fleet") or {}
        if fleet.get("degraded") or fleet.get("gateways") != len(gateways):
            return False
    return True


class _Chaos(FleetRun[ChaosPlan]):
    def __init__(
        self,
        plan: ChaosPlan,
        redis: SentinelRedis,
        cluster: DeployedCluster,
        session: aiohttp.ClientSession,
        pool: GatewayPool,
        load: OpenStreamingLoad,
        origin: float,
        log: Log,
    ) -> None:
        super().__init__(plan, cluster, session, pool, origin, log)
        self.redis = redis
        self.load = load
        self.registry = RedisRegistry(redis.url, key_prefix=_PREFIX)
        self.background: asyncio.Task[None] | None = None  # repairs awaited before the check

    def shim_urls(self) -> set[str]:
        return {*self.cluster.prefill_urls, *self.cluster.decode_urls}

    async def wait_whole(self, timeout_s: float | None = None) -> float:
        deadline = time.monotonic() + (timeout_s or self.plan.register_timeout_s)
        while not await _fleet_whole(self.session, self.pool.urls, self.shim_urls(), self.registry):
            self.cluster.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError("the fleet did not become whole again")
            await asyncio.sleep(0.1)
        return self.now()

    async def busiest(self, role: str, want: int = 0, timeout_s: float = 10.0) -> tuple[int, int]:
        """(index, used slots) of the `role` server with the most used slots, once one has
        at least `want` (a decode mid-stream), or the busiest after `timeout_s`."""
        urls = self.cluster.members(role)[1]
        deadline = time.monotonic() + timeout_s
        while True:
            used = []
            for url in urls:
                try:
                    load = await _get_json(self.session, url + "/load")
                    used.append(int(load.get("used", 0)))
                except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
                    used.append(-1)
            best = max(range(len(urls)), key=lambda i: used[i])
            if used[best] >= want or time.monotonic() > deadline:
                return best, used[best]
            await asyncio.sleep(0.02)

    async def watch_kv(self, gateway_id: str, event: FaultEvent) -> None:
        """Every `_KV_POLL_S` each prefill's hold for `gateway_id` and its 429s, into
        `event.kv_polls`, until no prefill holds any (or `observe_s` passed)."""
        end = time.monotonic() + self.plan.observe_s
        while time.monotonic() < end:
            at = self.now()
            reads = (_kv_for(self.session, u, gateway_id) for u in self.cluster.prefill_urls)
            polls = list(await asyncio.gather(*reads))
            event.kv_polls.append((at, polls))
            if all(p is not None and not p[0] for p in polls):
                return
            await asyncio.sleep(max(0.0, _KV_POLL_S - (self.now() - at)))

    async def quiesce(self, not_before_s: float) -> tuple[float, float, dict[str, float]]:
        """Pause the arrivals, let the open requests end, read what is held; resume."""
        if self.background is not None:
            await self.background
            self.background = None
        paused = self.now()
        self.load.pause()
        if not await self.load.wait_idle(90.0):
            self.log(f"  {self.load.in_flight} requests still open after 90 s")
        await asyncio.sleep(max(0.0, not_before_s - self.now()))
        await asyncio.sleep(0.5)  # the last release's round trip to Redis
        taken = self.now()
        held = await snapshot(self.session, self.cluster, self.pool.urls)
        self.load.resume()
        return paused, taken, held

    async def inject(self, fault: str, event: FaultEvent) -> None:
        """Inject `fault`, make the fleet whole again; fills began/ended/target/note."""
        cluster = self.cluster
        if fault in ("kill-prefill", "kill-decode"):
            role = fault.removeprefix("kill-")
            index, event.open_at_fault = await self.busiest(role, _MID_STREAM[role])
            child = cluster.members(role)[0][index]
            event.target = child.name
            event.began_s = event.ended_s = self.now()
            await _kill9(child)
            await cluster.start_member(role, index)
        elif fault in ("stop-prefill", "stop-decode"):
            role = fault.removeprefix("stop-")
            index, event.open_at_fault = await self.busiest(role, _MID_STREAM[role])
            child = cluster.members(role)[0][index]
            event.target = child.name
            event.began_s = self.now()
            _signal(child, signal.SIGSTOP)
            try:
                await asyncio.sleep(self.plan.stop_s)
            finally:
                _signal(child, signal.SIGCONT)
            event.ended_s = self.now()
        elif fault == "kill-gateway":
            index = len(cluster.gateways) - 1
            child = cluster.gateways[index]
            event.target = child.name
            health = await _health(self.session, self.pool.urls[index])
            if "pending" in health:
                event.open_at_fault = int(health["pending"])
            killed = _gateway_id(health)  # its fleet id
            event.lease_s = GatewaySettings(**cluster.deployment.gateway_settings).fleet_ttl_s
            event.began_s = event.ended_s = self.now()
            if killed:  # its first poll comes once the signal is sent
                self.background = asyncio.create_task(self.watch_kv(killed, event))
            await _kill9(child)
            # The load balancer keeps the dead address until the new one is up: its
            # clients are refused and retry on the other gateway.
            url = await cluster.start_member("gateway", index)
            await wait_instances(
                self.session, url, len(self.shim_urls()), self.plan.register_timeout_s
            )
            self.pool.add(index, url)
            event.gateway_ids = (killed, _gateway_id(await _health(self.session, url)))
        elif fault == "kill-redis-primary":
            event.target = f"redis :{self.redis.primary_port}"
            event.began_s = self.now()
            took = await self.redis.kill_primary()
            event.ended_s = self.now()

            async def rejoin() -> None:
                rejoined = await self.redis.restart_old_primary()
                event.note = (
                    f"promoted {took:.1f} s after the kill; the old primary, restarted empty "
                    f"at once, rejoined as a replica {rejoined:.1f} s later"
                )

            self.background = asyncio.create_task(rejoin())
        elif fault == "redis-empty":
            event.target = f"redis :{self.redis.primary_port}"
            event.began_s = event.ended_s = self.now()
            await self.redis.wipe()
        else:  # pragma: no cover - the plan checked the names
            raise ValueError(fault)

    async def fault(self, fault: str) -> FaultEvent:
        plan = self.plan
        event = FaultEvent(fault, "", 0.0, 0.0)
        await self.inject(fault, event)
        event.ready_s = await self.wait_whole()
        until = max(event.ended_s + plan.observe_s, event.ready_s + plan.after_ready_s)
        await asyncio.sleep(max(0.0, until - self.now()))
        event.paused_s, event.snapshot_s, event.held = await self.quiesce(
            event.ended_s + plan.hold_check_s
        )
        event.resumed_s = self.now()
        return event


async def _probe(session: aiohttp.ClientSession, url: str) -> float:
    start = time.monotonic()
    try:
        async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
            await r.read()
    except (aiohttp.ClientError, OSError, TimeoutError):
        return float("nan")
    return time.monotonic() - start


async def _loop_lag(session: aiohttp.ClientSession, url: str) -> dict[float, float]:
    """The gateway's event-loop lag histogram now (empty if its /metrics could not be read)."""
    try:
        return await read_histogram(session, url, LOOP_LAG)
    except (aiohttp.ClientError, OSError, TimeoutError):
        return {}


async def _overload(
    chaos: _Chaos,
    prompts: Prompts,
    capacity_rps: float,
    log: Log,
    gateway: str,
    child: Child,
    label: str,
) -> OverloadResult:
    """One gateway under `overload_factor` x the fleet's capacity, open loop, for
    `overload_s`: its answers (how fast it sheds, with which status and Retry-After), its
    event-loop lag (its own histogram, and its /health latency every `probe_period_s` from
    outside) and its RSS."""
    plan, session = chaos.plan, chaos.session
    idle = [await _probe(session, gateway) for _ in range(20)]
    idle_probe = sorted(idle)[len(idle) // 2]
    rate = plan.overload_rps or plan.overload_factor * capacity_rps
    # A connector of its own: the overload's thousands of connections do not queue the
    # probe's behind them.
    probes: list[tuple[float, float]] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as own:
        load = _one_gateway_load(chaos, own, gateway, prompts, rate, seed=1000)
        rss = RssSampler(child.pid, 0.5, lambda: load.issued)
        log(f"overload: {rate:.1f} req/s into one gateway ({label}; {plan.overload_factor:g}x "
            f"{capacity_rps:.2f} req/s) for {plan.overload_s:g} s")  # fmt: skip
        lag_before = await _loop_lag(session, gateway)
        began = chaos.now()
        rss.start()
        load.start()
        end = time.monotonic() + plan.overload_s
        async with aiohttp.ClientSession() as probe:
            while time.monotonic() < end:
                at = chaos.now()
                probes.append((at, await _probe(probe, gateway)))
                await asyncio.sleep(max(0.0, plan.probe_period_s - (chaos.now() - at)))
            ended = chaos.now()
            lag_after = await _loop_lag(session, gateway)
            load.pause()
            # The backlog drains; the probe goes on, so the series shows the way down.
            drain_end = time.monotonic() + 60.0
            while load.in_flight and time.monotonic() < drain_end:
                at = chaos.now()
                probes.append((at, await _probe(probe, gateway)))
                await asyncio.sleep(max(0.0, plan.probe_period_s - (chaos.now() - at)))
        await load.stop(5.0)
        await asyncio.sleep(1.0)
        rss.take()
        await rss.stop()
    odd = [r for r in load.records if r.status not in (200, 429, 503) and r.failed]
    if odd:
        log(f"  {len(odd)} answers besides 429/503: "
            f"{sorted({(r.error_label(), r.message) for r in odd})}; the gateway's last "
            f"lines:\n{child.output_tail(30)}")  # fmt: skip
    held = await snapshot(session, chaos.cluster, [gateway])
    lag = [(le, n - lag_before.get(le, 0.0)) for le, n in sorted(lag_after.items())]
    return OverloadResult(label, capacity_rps, rate, began, ended, load.records, probes, idle_probe,
                          rss.samples, held, lag)  # fmt: skip


def _one_gateway_load(
    chaos: _Chaos,
    session: aiohttp.ClientSession,
    gateway: str,
    prompts: Prompts,
    rate: float,
    *,
    seed: int,
) -> OpenStreamingLoad:
    """Open-loop streams into `gateway` alone at `rate`, each tried once (a shed is an
    answer here, not a reason to resend), seeded `seed` past the plan's."""
    plan = chaos.plan
    return OpenStreamingLoad(
        session, GatewayPool([gateway]), prompts, rate, _MODEL, origin=chaos.origin,
        seed=plan.seed + seed, min_tokens=plan.min_tokens, max_in_flight=4096, max_attempts=1,
    )  # fmt: skip


async def _warm(chaos: _Chaos, prompts: Prompts, capacity_rps: float, gateway: str) -> None:
    """Streams through a new gateway, below capacity, until it has relayed some
    `_WARM_STREAMS`: what its decode bound learns from (the fleet's gateway learned it in
    the steady load), so that its overload compares with the fleet's gateway's."""
    rate = 0.8 * capacity_rps
    load = _one_gateway_load(chaos, chaos.session, gateway, prompts, rate, seed=2000)
    load.start()
    await asyncio.sleep(_WARM_STREAMS / rate)
    await load.stop(60.0)  # the streams end: their hold times are what it learns


async def _extra_gateway(
    cluster: DeployedCluster, settings: Mapping[str, Any]
) -> tuple[Child, str]:
    """A gateway beside the fleet's, with the fleet's settings and `settings` over them, on
    the same registry; (its process, its URL). The caller stops it."""
    d = cluster.deployment
    local = {"host": "127.0.0.1", "port": 0}
    env = settings_env("gateway", {**d.gateway_settings, **local, **settings})
    child = cluster.child("gateway-overload", "gateway", env)
    try:
        url = (await child.start(GATEWAY_READY, 60.0)).group(1)
    except BaseException:
        await child.stop()
        raise
    return child, url


def capacity_of(plan: ChaosPlan, records: list[StreamRecord]) -> float:
    """Streams per second the fleet's decode slots sustain at the steady streams' mean
    duration (every decode slot busy, back to back)."""
    durations = [r.ended_s - r.issued_s for r in records if r.completed]
    mean = sum(durations) / len(durations) if durations else 1.0
    return plan.decodes * plan.decode_capacity / mean


async def run_chaos(plan: ChaosPlan, log: Log = to_stderr) -> ChaosResult:
    began = time.monotonic()
    load0 = os.getloadavg()[0]
    deployment = sim_fleet(plan, _MODEL, _PREFIX)
    prompts = Prompts((plan.scenario(),), seed=plan.seed)
    faults: list[FaultEvent] = []
    overloads: list[OverloadResult] = []
    async with (
        SentinelRedis(down_after_ms=plan.down_after_ms) as redis,
        DeployedCluster(deployment, redis.url) as cluster,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session,
    ):
        pool = GatewayPool(cluster.gateway_urls)
        origin = time.monotonic()
        load = OpenStreamingLoad(
            session, pool, prompts, plan.rate_rps, _MODEL, origin=origin, seed=plan.seed,
            min_tokens=plan.min_tokens,
        )  # fmt: skip
        chaos = _Chaos(plan, redis, cluster, session, pool, load, origin, log)
        try:
            await chaos.wait_whole()
            log(f"chaos: {plan.rate_rps:g} req/s (Poisson) of {plan.min_tokens}-{plan.max_tokens}"
                f"-token streams through {plan.gateways} gateways; {plan.prefills} prefills, "
                f"{plan.decodes} decodes; registry {redis.url}")  # fmt: skip
            load.start()
            try:
                await asyncio.sleep(plan.steady_s)
                steady = (0.0, chaos.now())
                _, _, baseline = await chaos.quiesce(0.0)
                failed = sum(r.failed for r in load.records)
                log(f"  steady: {len(load.records)} requests, {failed} failed")
                await asyncio.sleep(plan.settle_s)
                for fault in plan.faults:
                    event = await chaos.fault(fault)
                    faults.append(event)
                    bad = [
                        r
                        for r in load.records
                        if r.failed and r.ended_s >= event.began_s and r.issued_s < event.paused_s
                    ]
                    failed = len(bad)
                    for r in bad:
                        log(f"    failed: {r.error_label()} at {r.ended_s - event.began_s:+.2f} s "
                            f"(gateway {r.gateway}): {r.message}")  # fmt: skip
                    held = {k: v for k, v in event.held.items() if v}
                    log(f"  {fault} ({event.target}): whole after "
                        f"{event.ready_s - event.began_s:.1f} s; {failed} failed; "
                        f"held after: {held or 'nothing'} {event.note}")  # fmt: skip
                    await asyncio.sleep(plan.settle_s)
            finally:
                await load.stop(30.0)
            records = sorted(load.records, key=lambda r: r.issued_s)
            steady_records = [r for r in records if r.issued_s < steady[1]]
            if plan.overload_s > 0:
                capacity = capacity_of(plan, steady_records)
                gateway, child = chaos.pool.urls[0], cluster.gateways[0]
                overloads.append(
                    await _overload(chaos, prompts, capacity, log, gateway, child, "defaults")
                )
                for label, settings in plan.overload_variants:
                    child, gateway = await _extra_gateway(cluster, dict(settings))
                    try:
                        await wait_instances(session, gateway, len(chaos.shim_urls()))
                        await _warm(chaos, prompts, capacity, gateway)
                        overloads.append(
                            await _overload(chaos, prompts, capacity, log, gateway, child, label)
                        )
                    finally:
                        await child.stop()
        finally:
            if chaos.background is not None:
                chaos.background.cancel()
                await asyncio.gather(chaos.background, return_exceptions=True)
            await chaos.registry.aclose()
    return ChaosResult(plan, records, faults, baseline, steady, overloads,
                       time.monotonic() - began, (load0, os.getloadavg()[0]))  # fmt: skip
