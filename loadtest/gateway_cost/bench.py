"""``pdgate bench gateway``: what the gateway itself costs, next to vllm-router and no router.

One run, on one set of null-profile shims (shims.py: engines that answer as fast as
possible, so every millisecond and CPU second left is the front end's or the client's),
with three fronts (load.py): ``direct`` (the client makes the
prefill and decode calls itself: the floor), ``pdgate`` (``pdgate gateway`` in its own
process, finding the shims through a private Redis) and ``vllm_router`` (the ``vllm-router``
binary in its vLLM P/D mode, ``--vllm-pd-disaggregation``, given the same shims). Fronts
take turns (interleaved) so drift in the machine's load hits them alike:

* added TTFT at concurrency 1: TTFT percentiles minus the direct floor's;
* requests/s and SSE events/s at concurrency 32 and 256 (closed loop, 16 tokens each);
* CPU seconds of the front's process per 1,000 requests (concurrency-32 windows);
* memory per open idle stream: each front in turn before decodes that never emit a token
  (a decode step of an hour), RSS growth of its process from 0 to N open streams, over N.

The machine's hard RLIMIT_NOFILE bounds N: each stream holds two sockets in the front.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import resource
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from pdgate.loadtest.gateway_cost.load import Front, open_idle_stream, run_window, send
from pdgate.loadtest.gateway_cost.shims import ShimSpec
from pdgate.loadtest.lib.children import Child, start_all
from pdgate.loadtest.lib.log import Log
from pdgate.loadtest.lib.probes import wait_instances
from pdgate.loadtest.lib.redis import private_redis
from pdgate.loadtest.lib.router import RouterOptions, running_router
from pdgate.loadtest.lib.stats import percentile

__all__ = [
    "QUICK",
    "GatewayPlan",
    "run_gateway_bench",
    "running_fronts",
    "summarize_ttft",
]

FRONTS = ("direct", "pdgate", "vllm_router")
_FD_HEADROOM = 512  # descriptors the gateway needs besides two per stream
_SHIM_MAX_CAPACITY = 4096  # ShimSettings.capacity's bound


@dataclass(frozen=True, slots=True)
class GatewayPlan:
    ttft_requests: int = 300  # per front, at concurrency 1
    concurrencies: tuple[int, ...] = (32, 256)
    rounds: int = 3  # windows per (front, concurrency), fronts rotating
    warmup_s: float = 1.0
    window_s: float = 10.0
    max_tokens: int = 16
    idle_streams: int = 10_000
    idle_batch: int = 100  # streams opened at once
    settle_s: float = 1.0  # wait before reading RSS, for buffers to be allocated and freed
    with_router: bool = True
    # Gateway worker counts to measure, each its own front ("pdgate", "pdgate_w2", ...).
    workers: tuple[int, ...] = (1,)
    # Also a one-worker pdgate without the shims' batch endpoint ("pdgate_plain"): the same
    # shim endpoints vllm-router uses, for a like-for-like comparison.
    plain: bool = True


QUICK = GatewayPlan(
    ttft_requests=40, rounds=1, warmup_s=0.5, window_s=2.5, idle_streams=1000, idle_batch=100
)


def _pdgate_fronts(workers_list: tuple[int, ...], plain: bool) -> list[tuple[str, int, bool]]:
    """(front name, worker processes, batch endpoint on) of each pdgate front."""
    out = [("pdgate" if w == 1 else f"pdgate_w{w}", w, True) for w in workers_list]
    if plain:
        out.append(("pdgate_plain", 1, False))
    return out


def _raise_nofile(want: int) -> int:
    """Raise the soft descriptor limit (inherited by the children) as far as allowed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _gateway_env(key_prefix: str, streams: int) -> dict[str, str]:
    bound = str(max(4096, 2 * streams))
    return {
        "PDGATE_REGISTRY_KEY_PREFIX": key_prefix,
        "PDGATE_GATEWAY_MAX_PENDING": bound,
        "PDGATE_GATEWAY_QUEUE_SIZE": bound,
        "PDGATE_GATEWAY_UPSTREAM_CONNECTIONS": bound,
        "PDGATE_GATEWAY_UPSTREAM_READ_TIMEOUT_S": "7200",  # idle streams are silent
    }


@contextlib.asynccontextmanager
async def running_fronts(
    session: aiohttp.ClientSession,
    spec: ShimSpec,
    streams: int,
    router: bool,
    log: Log,
    *,
    warm: bool = True,
    workers_list: tuple[int, ...] = (1,),
    plain: bool = False,
) -> AsyncIterator[tuple[dict[str, Front], dict[str, Child], dict[str, str]]]:
    """Shims + pdgate (+ vllm-router); yields the fronts, their processes and why any front
    is missing."""
    async with contextlib.AsyncExitStack() as stack:
        shims = Child(
            "shims",
            [
                sys.executable,
                "-m",
                "pdgate.loadtest.gateway_cost.shims",
                orjson.dumps(spec.to_json()).decode(),
            ],
            quits_on_eof=True,
        )
        assert spec.registry_url is not None
        gateways: dict[str, Child] = {}
        for name, workers, batch in _pdgate_fronts(workers_list, plain):
            env = _gateway_env(spec.key_prefix, streams)
            env["PDGATE_GATEWAY_PREFILL_BATCH_ENDPOINT"] = "true" if batch else "false"
            env["PDGATE_GATEWAY_GATEWAY_ID"] = name
            gateways[name] = Child(
                name,
                [sys.executable, "-m", "pdgate.config.cli", "--log-level", "WARNING", "gateway",
                 "--host", "127.0.0.1", "--port", "0", "--registry-url", spec.registry_url,
                 "--workers", str(workers)],
                env,
            )  # fmt: skip
        stack.push_async_callback(shims.stop)  # stop() is a no-op for one that never started
        for gateway in gateways.values():
            stack.push_async_callback(gateway.stop)
        # All start at once (their imports take a second each); the gateways then wait
        # until the shims have registered.
        ready = await start_all(
            [
                (shims, r'\{"prefills".*\}'),
                *((g, r"pdgate gateway\b.*?(http://[\w.:]+)") for g in gateways.values()),
            ]
        )
        urls = orjson.loads(ready[0].group(0))
        fronts = {"direct": Front("direct", prefills=urls["prefills"], decodes=urls["decodes"])}
        for name, match in zip(gateways, ready[1:], strict=True):
            base = match.group(1)
            await wait_instances(session, base, spec.prefills + spec.decodes)
            fronts[name] = Front(name, url=base + "/v1/completions")
        procs = dict(gateways)
        missing: dict[str, str] = {}
        if router:
            opts = RouterOptions(policy="round_robin", max_concurrent=max(4096, 2 * streams))
            try:
                proc, base_router = await stack.enter_async_context(
                    running_router(session, urls["prefills"], urls["decodes"], opts)
                )
                fronts["vllm_router"] = Front("vllm_router", url=base_router + "/v1/completions")
                procs["vllm_router"] = proc
            except RuntimeError as exc:
                missing["vllm_router"] = str(exc)
        for name, front in fronts.items() if warm else ():  # warm connections and code paths
            for i in range(20):
                if not (await send(session, front, f"warm {i}", 4)).ok:
                    raise RuntimeError(f"{name}: warm-up request failed")
        log(f"fronts up: {', '.join(fronts)}" + (f"; missing: {missing}" if missing else ""))
        yield fronts, procs, missing


def summarize_ttft(ttfts: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """p50/p99 TTFT (ms) per front and the added p50/p99 over the direct floor."""
    out: dict[str, dict[str, float]] = {"ttft_p50_ms": {}, "ttft_p99_ms": {}}
    for name, values in ttfts.items():
        out["ttft_p50_ms"][name] = 1000 * percentile(values, 50)
        out["ttft_p99_ms"][name] = 1000 * percentile(values, 99)
    for q in ("p50", "p99"):
        floor = out[f"ttft_{q}_ms"].get("direct", math.nan)
        out[f"added_ttft_{q}_ms"] = {
            n: v - floor for n, v in out[f"ttft_{q}_ms"].items() if n != "direct"
        }
    return out


def _rotated(names: list[str], k: int) -> list[str]:
    k %= len(names)
    return names[k:] + names[:k]


async def _fast_phase(
    plan: GatewayPlan, session: aiohttp.ClientSession, redis_url: str, log: Log
) -> dict[str, Any]:
    spec = ShimSpec(registry_url=redis_url, prefill_capacity=1024, decode_capacity=1024,
                    key_prefix="pdgate-bench-fast")  # fmt: skip
    stack = running_fronts(
        session, spec, 256, plan.with_router, log, workers_list=plan.workers, plain=plan.plain
    )
    async with stack as (fronts, procs, missing):
        names = list(fronts)
        ttfts: dict[str, list[float]] = {n: [] for n in names}
        for i in range(plan.ttft_requests):
            for name in _rotated(names, i):
                out = await send(session, fronts[name], f"ttft probe {i}", 4)
                if out.ok and out.ttft_s is not None:
                    ttfts[name].append(out.ttft_s)
        result: dict[str, Any] = summarize_ttft(ttfts)
        log(f"TTFT c=1: {result['ttft_p50_ms']} (p50 ms)")
        cpu: dict[str, list[float]] = {n: [0.0, 0.0] for n in procs}  # cpu s, requests
        for c in plan.concurrencies:
            tallies = {n: [0, 0, 0, 0.0] for n in names}  # ok, failed, events, seconds
            for r in range(plan.rounds):
                for name in _rotated(names, r):
                    proc = procs.get(name)
                    mark: list[float] = []
                    snap = None if proc is None else (lambda p=proc, m=mark: m.append(p.cpu_s()))
                    window = await run_window(
                        session, fronts[name], concurrency=c, warmup_s=plan.warmup_s,
                        window_s=plan.window_s, max_tokens=plan.max_tokens, on_window_start=snap,
                    )  # fmt: skip
                    if proc is not None and c == plan.concurrencies[0] and mark:
                        # The window closes when the last worker returns: a little after
                        # window_s, so this slightly over-counts CPU (conservatively).
                        cpu[name][0] += proc.cpu_s() - mark[0]
                        cpu[name][1] += window.requests
                    t = tallies[name]
                    t[0] += window.requests
                    t[1] += window.failures
                    t[2] += window.events
                    t[3] += window.window_s
            result[f"rps_c{c}"] = {n: t[0] / t[3] for n, t in tallies.items()}
            result[f"events_per_s_c{c}"] = {n: t[2] / t[3] for n, t in tallies.items()}
            result[f"failures_c{c}"] = {n: int(t[1]) for n, t in tallies.items()}
            log(f"c={c}: rps {result[f'rps_c{c}']}")
        result["cpu_s_per_1k"] = {
            n: 1000 * s / reqs if reqs else math.nan for n, (s, reqs) in cpu.items()
        }
        result["missing"] = missing
        return result


async def _idle_rss(
    plan: GatewayPlan, session: aiohttp.ClientSession, url: str, proc: Child, streams: int
) -> dict[int, int]:
    """Open `streams` idle streams through one front; its RSS at 0, about half and all open.
    The streams are closed again before returning."""
    await asyncio.sleep(plan.settle_s)
    rss = {0: proc.rss_bytes()}
    tasks: list[asyncio.Task[None]] = []
    try:
        for start in range(0, streams, plan.idle_batch):
            events = []
            for i in range(start, min(streams, start + plan.idle_batch)):
                opened = asyncio.Event()
                events.append(opened)
                tasks.append(asyncio.create_task(open_idle_stream(session, url, i, opened)))
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
            failed = [t for t in tasks if t.done()]
            if failed:
                raise RuntimeError(f"idle stream failed: {failed[0].exception()!r}")
            if len(rss) == 1 and len(tasks) >= streams // 2:  # the halfway sample
                await asyncio.sleep(plan.settle_s)
                rss[len(tasks)] = proc.rss_bytes()
        await asyncio.sleep(plan.settle_s)
        rss[len(tasks)] = proc.rss_bytes()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return rss


async def _idle_phase(
    plan: GatewayPlan, session: aiohttp.ClientSession, redis_url: str, log: Log
) -> dict[str, Any]:
    limit = _raise_nofile(2 * plan.idle_streams + _FD_HEADROOM)
    streams = min(plan.idle_streams, (limit - _FD_HEADROOM) // 2)
    # Fronts take turns, and a front may free its decode slots a little after its streams
    # close: room for both fronts' streams at once.
    decodes = math.ceil(2 * streams / (_SHIM_MAX_CAPACITY - 96))
    spec = ShimSpec(
        registry_url=redis_url,
        decode_step_s=3600.0,  # no token for an hour: the streams stay open and silent
        decodes=decodes,
        prefill_capacity=1024,
        decode_capacity=min(_SHIM_MAX_CAPACITY, math.ceil(2 * streams / decodes) + 64),
        key_prefix="pdgate-bench-idle",
    )
    kib: dict[str, float] = {}
    rss_mib: dict[str, dict[str, float]] = {}
    async with running_fronts(session, spec, streams, plan.with_router, log, warm=False) as (
        fronts,
        procs,
        missing,
    ):
        for name, proc in procs.items():
            url = fronts[name].url
            assert url is not None
            try:
                rss = await _idle_rss(plan, session, url, proc, streams)
            except (RuntimeError, TimeoutError) as exc:
                missing[f"{name}_idle"] = repr(exc)[:300]
                continue
            kib[name] = (rss[streams] - rss[0]) / 1024 / streams
            rss_mib[name] = {str(k): v / 2**20 for k, v in rss.items()}
            mib = f"{rss[0] >> 20} -> {rss[streams] >> 20} MiB"
            log(f"idle: {streams} streams via {name}, RSS {mib}")
    return {
        "kib_per_idle_stream": kib.get("pdgate", math.nan),
        "kib_per_idle_stream_by_front": kib,
        "idle_streams": streams,
        "idle_rss_mib": rss_mib,
        "idle_missing": missing,
        "nofile_limit": limit,
    }


async def run_gateway_bench(plan: GatewayPlan, log: Log) -> dict[str, Any]:
    _raise_nofile(2 * plan.idle_streams + _FD_HEADROOM)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=120)
    started = time.monotonic()
    async with (
        private_redis() as redis_url,
        aiohttp.ClientSession(connector=connector, timeout=timeout) as session,
    ):
        result = await _fast_phase(plan, session, redis_url, log)
        if plan.idle_streams > 0:
            result.update(await _idle_phase(plan, session, redis_url, log))
    result["wall_s"] = time.monotonic() - started
    result["load_avg_1m_after"] = os.getloadavg()[0]
    return result
