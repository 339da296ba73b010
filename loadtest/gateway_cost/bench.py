"""``pdgate bench gateway``: what the gateway itself costs, next to the Rust routers and none.

One run, on each engine of the plan in turn (shims.py: pdgate's null-profile sim shims, and
stock.py: a plain OpenAI server with vLLM's handshake only; both answer as fast as possible,
so every millisecond and CPU second left is the front end's or the client's), with these
fronts (load.py): ``direct`` (the client makes the prefill and decode calls itself: the
floor), ``pdgate`` (``pdgate gateway`` in its own process, finding shims through a private
Redis or given stock engines by URL; ``pdgate_plain`` without the shims' batch endpoint,
``pdgate_wN`` with N workers, each of these its own fleet) and ``vllm_router`` (the
``vllm-router`` binary in its vLLM P/D mode, ``--vllm-pd-disaggregation``, given the same
engines; ``vllm_router_<policy>`` with another ``--policy``) and ``smg`` (SMG, ``smg launch
--pd-disaggregation --backend vllm``, the same engines, round robin), and with ``--floor``
``python_floor`` (floor.py: pdgate's server and client with none of its gateway). Fronts take turns
(interleaved) so drift in the machine's load hits them alike:

* added TTFT at concurrency 1: TTFT percentiles minus the direct floor's; on stock engines
  also split hop by hop from the engines' timestamps (_timeline.py);
* requests/s and SSE events/s at concurrency 32 and 256 (closed loop, 16 tokens each);
* per window (_meter.py): CPU seconds per 1,000 requests of the front's process, of the load
  client (this process) and of the engines, the client's and the machine's busy cores, and
  requests/s of N workers over one;
* which engine endpoints each front used (stock engines count them);
* memory per open idle stream: each front in turn before decodes that send one token and
  then none for an hour, RSS growth of its process from 0 to N open streams, over N.

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
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import orjson

from pdgate.loadtest.gateway_cost._meter import Tally, WindowMeter, engine_stats, stats_delta
from pdgate.loadtest.gateway_cost._timeline import Probe, read_timeline, segment_medians
from pdgate.loadtest.gateway_cost.load import API_PATHS, Front, open_idle_stream, run_window, send
from pdgate.loadtest.gateway_cost.load import warm as warm_fronts
from pdgate.loadtest.gateway_cost.shims import ShimSpec
from pdgate.loadtest.lib.children import Child, start_all
from pdgate.loadtest.lib.log import Log
from pdgate.loadtest.lib.pinning import Pinning, pinned
from pdgate.loadtest.lib.probes import wait_instances
from pdgate.loadtest.lib.redis import private_redis
from pdgate.loadtest.lib.router import SMG, RouterOptions, running_router
from pdgate.loadtest.lib.stats import percentile

__all__ = [
    "QUICK",
    "GatewayPlan",
    "Setup",
    "router_front",
    "run_gateway_bench",
    "running_fronts",
    "summarize_ttft",
]

FRONTS = ("direct", "pdgate", "vllm_router", "smg")
_FD_HEADROOM = 512  # descriptors a front needs besides those of its streams
# Descriptors an idle stream holds at a front: pdgate and vllm-router two (the client's and
# the decode's connections), SMG three on the stock engines (it keeps the prefill leg's
# connection too; past the limit it answers 503 "no available prefill workers"). Every
# front must have room for the streams measured.
_FDS_PER_STREAM = 3
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
    with_smg: bool = True
    # Gateway worker counts to measure, each its own front ("pdgate", "pdgate_w2", ...).
    workers: tuple[int, ...] = (1,)
    # Also a one-worker pdgate without the shims' batch endpoint ("pdgate_plain"): the same
    # shim endpoints vllm-router uses, for a like-for-like comparison.
    plain: bool = True
    # Also a one-worker pdgate on aiohttp's client ("pdgate_aiohttp", upstream_client =
    # aiohttp) beside the default one on pdgate's own: what the client costs, in one run.
    aiohttp: bool = False
    # Also "python_floor" (floor.py): the server, client and event loop pdgate runs on, with
    # none of pdgate's gateway; what any gateway written this way costs at least.
    floor: bool = False
    # Also "pdgate_<api>" for each API here (chat, responses, messages): the "pdgate" gateway
    # asked through that API instead of completions, on the shim engines (the stock ones
    # serve completions only); what the translation (gateway/translate/) costs.
    apis: tuple[str, ...] = ()
    # The engines every front is measured on, in turn: "shim" (pdgate's sim shims) and
    # "stock" (stock.py, a plain OpenAI server with vLLM's handshake only).
    engines: tuple[str, ...] = ("shim", "stock")
    # Engine time of the fast phase (default none: every millisecond left is the fronts' or
    # the client's). Timers tick in whole milliseconds on uvloop, so an engine that sleeps
    # hides part of a front's sub-millisecond cost (docs/results/performance/README.md).
    prefill_s: float | None = None
    token_s: float | None = None
    # vllm-router --policy of each router front: "vllm_router" is round_robin (the cheapest
    # pick), "vllm_router_<policy>" any other. The router's own default is cache_aware.
    router_policies: tuple[str, ...] = ("round_robin",)
    # Stock engines serve vLLM's tokenizer endpoints (False: 404, like a plain OpenAI server).
    stock_tokenizer: bool = True
    # The fronts on a CPU of their own, the engines, Redis and the load on the others.
    pin: bool = False


QUICK = GatewayPlan(
    ttft_requests=40, rounds=1, warmup_s=0.5, window_s=2.5, idle_streams=1000, idle_batch=100
)


def _pdgate_fronts(
    workers_list: tuple[int, ...], plain: bool, aiohttp: bool = False
) -> list[tuple[str, int, bool, str]]:
    """(front name, worker processes, batch endpoint on, upstream client) of each pdgate
    front."""
    out = [("pdgate" if w == 1 else f"pdgate_w{w}", w, True, "h1") for w in workers_list]
    if plain:
        out.append(("pdgate_plain", 1, False, "h1"))
    if aiohttp:
        out.append(("pdgate_aiohttp", 1, True, "aiohttp"))
    return out


def _raise_nofile(want: int) -> int:
    """Raise the soft descriptor limit (inherited by the children) as far as allowed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def gateway_env(key_prefix: str, streams: int) -> dict[str, str]:
    """What a benchmark's pdgate gateway is started with: bounds past `streams` open ones."""
    bound = str(max(4096, 2 * streams))
    return {
        "PDGATE_REGISTRY_KEY_PREFIX": key_prefix,
        "PDGATE_GATEWAY_MAX_PENDING": bound,
        "PDGATE_GATEWAY_QUEUE_SIZE": bound,
        "PDGATE_GATEWAY_UPSTREAM_CONNECTIONS": bound,
        "PDGATE_GATEWAY_UPSTREAM_READ_TIMEOUT_S": "7200",  # idle streams are silent
        "PDGATE_GATEWAY_DECODE_STALL_TIMEOUT_S": "7200",  # on purpose, after one token
    }


@dataclass(slots=True)
class Setup:
    """What `running_fronts` started: the fronts, the processes behind them (pdgate's,
    the routers'), the engines' process, and why any front is missing."""

    fronts: dict[str, Front]
    procs: dict[str, Child]
    engine: Child
    missing: dict[str, str]


def router_front(policy: str) -> str:
    """The front name of a vllm-router with this ``--policy``."""
    return "vllm_router" if policy == "round_robin" else f"vllm_router_{policy}"


def _static_flags(urls: dict[str, list[str]], capacity: dict[str, int]) -> list[str]:
    """pdgate's ``--prefill/--decode`` for servers that do not register (stock engines)."""
    flags: list[str] = []
    for role in ("prefill", "decode"):
        for url in urls[f"{role}s"]:
            flags += [f"--{role}", f"{url} capacity={capacity[role]}"]
    return flags


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
    aiohttp: bool = False,
    router_policies: tuple[str, ...] = ("round_robin",),
    smg: bool = False,
    floor: bool = False,
    apis: tuple[str, ...] = (),
    pinning: Pinning | None = None,
) -> AsyncIterator[Setup]:
    """The spec's engines + pdgate (+ vllm-router, + SMG) in front of them. Shims register in the
    spec's Redis, where pdgate finds them; stock engines are given to pdgate by URL (it still
    uses the Redis for what its workers share)."""
    async with contextlib.AsyncExitStack() as stack:
        engine = Child(
            spec.engine,
            [
                sys.executable,
                "-m",
                "pdgate.loadtest.gateway_cost.shims",
                orjson.dumps(spec.to_json()).decode(),
            ],
            quits_on_eof=True,
        )
        assert spec.registry_url is not None
        stack.push_async_callback(engine.stop)  # stop() is a no-op for one that never started
        stock = spec.engine == "stock"
        # Stock engines print their URLs before any gateway can be told them: start first.
        ready_engine = await engine.start(r'\{"prefills".*\}') if stock else None
        static: list[str] = []
        if ready_engine is not None:
            capacity = {"prefill": spec.prefill_capacity, "decode": spec.decode_capacity}
            static = _static_flags(orjson.loads(ready_engine.group(0)), capacity)
        gateways: dict[str, Child] = {}
        for name, workers, batch, client in _pdgate_fronts(workers_list, plain, aiohttp):
            env = gateway_env(spec.key_prefix, streams)
            env["PDGATE_GATEWAY_PREFILL_BATCH_ENDPOINT"] = "true" if batch else "false"
            env["PDGATE_GATEWAY_UPSTREAM_CLIENT"] = client
            env["PDGATE_GATEWAY_GATEWAY_ID"] = name
            if name != "pdgate":
                # Its own fleet: fronts are measured one at a time, and gateways that share a
                # fleet lease every prefill slot through Redis (a round trip per dispatch), a
                # cost of running several gateways that would hide in every front's figure.
                env["PDGATE_GATEWAY_FLEET"] = "false"
            argv = [sys.executable, "-m", "pdgate.config.cli", "--log-level", "WARNING",
                    "gateway", "--host", "127.0.0.1", "--port", "0", "--registry-url",
                    spec.registry_url, "--workers", str(workers), *static]  # fmt: skip
            gateways[name] = Child(name, pinning.wrap(argv) if pinning else argv, env)
            stack.push_async_callback(gateways[name].stop)
        # All start at once (their imports take a second each); the gateways then wait
        # until the shims have registered.
        gateway_ready = r"pdgate gateway\b.*?(http://[\w.:]+)"
        starts = [(g, gateway_ready) for g in gateways.values()]
        if ready_engine is None:
            starts.insert(0, (engine, r'\{"prefills".*\}'))
        ready = await start_all(starts)
        if ready_engine is None:
            ready_engine, ready = ready[0], ready[1:]
        urls = orjson.loads(ready_engine.group(0))
        fronts = {"direct": Front("direct", prefills=urls["prefills"], decodes=urls["decodes"])}
        for name, match in zip(gateways, ready, strict=True):
            base = match.group(1)
            await wait_instances(session, base, spec.prefills + spec.decodes)
            fronts[name] = Front(name, url=base + "/v1/completions")
        procs = dict(gateways)
        missing: dict[str, str] = {}
        for api in apis:
            name = f"pdgate_{api}"
            if stock:
                missing[name] = "stock engines serve completions only"
                continue
            url = fronts["pdgate"].url
            assert url is not None
            fronts[name] = Front(
                name, url=url.removesuffix("/v1/completions") + API_PATHS[api], api=api
            )
            procs[name] = gateways["pdgate"]  # the same process, measured in its own windows
        routers = [(router_front(p), RouterOptions(policy=p)) for p in router_policies if router]
        if smg:
            routers.append(("smg", RouterOptions(binary=SMG)))
        for name, opts in routers:
            opts = replace(opts, max_concurrent=max(4096, 2 * streams))
            try:
                proc, base_router = await stack.enter_async_context(
                    running_router(
                        session,
                        urls["prefills"],
                        urls["decodes"],
                        opts,
                        pinning.prefix() if pinning else (),
                    )
                )
                fronts[name] = Front(name, url=base_router + "/v1/completions")
                procs[name] = proc
            except RuntimeError as exc:
                missing[name] = str(exc)
        if floor:
            argv = [sys.executable, "-m", "pdgate.loadtest.gateway_cost.floor"]
            argv += [f"--prefill={u}" for u in urls["prefills"]]
            argv += [f"--decode={u}" for u in urls["decodes"]]
            child = Child("python_floor", pinning.wrap(argv) if pinning else argv)
            stack.push_async_callback(child.stop)
            found = await child.start(r"python floor on (http://[\w.:]+)")
            fronts["python_floor"] = Front("python_floor", url=found.group(1) + "/v1/completions")
            procs["python_floor"] = child
        if pinning is not None:
            log(pinning.describe({name: proc.pid for name, proc in procs.items()}))
        if warm:
            await warm_fronts(session, fronts)
        log(
            f"{spec.engine} engines, fronts up: {', '.join(fronts)}"
            + (f"; missing: {missing}" if missing else "")
        )
        yield Setup(fronts, procs, engine, missing)


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


async def _ttft_probes(
    plan: GatewayPlan, session: aiohttp.ClientSession, fronts: dict[str, Front]
) -> list[Probe]:
    """Concurrency 1, fronts taking turns request by request; each probe's prompt is its
    own (same length for every front), so the engines' timeline can tell them apart."""
    names = list(fronts)
    probes: list[Probe] = []
    for i in range(plan.ttft_requests):
        for name in _rotated(names, i):
            prompt = f"ttft probe {i}.{names.index(name)}"
            out = await send(session, fronts[name], prompt, 4)
            if out.ok and out.ttft_s is not None:
                probes.append(Probe(name, prompt, out.start, out.ttft_s))
    return probes


def _in_rounds(probes: list[Probe], rounds: int) -> list[list[Probe]]:
    """The probes (in the order sent, fronts taking turns) cut into `rounds` consecutive
    parts: each part measures every front over the same stretch of time."""
    n = len(probes)
    return [probes[k * n // rounds : (k + 1) * n // rounds] for k in range(rounds)]


def _ttft_figures(probes: list[Probe], names: list[str]) -> dict[str, Any]:
    ttfts: dict[str, list[float]] = {n: [] for n in names}
    for probe in probes:
        ttfts[probe.front].append(probe.ttft_s)
    return summarize_ttft(ttfts)


async def _ttft_segments(
    session: aiohttp.ClientSession, urls: list[str], probes: list[Probe]
) -> dict[str, Any]:
    """TTFT split hop by hop (stock engines only), and each hop's excess over direct's."""
    parts = segment_medians(probes, await read_timeline(session, urls))
    floor = parts.get("direct", {})
    added = {
        front: {k: v - floor.get(k, math.nan) for k, v in row.items()}
        for front, row in parts.items()
        if front != "direct"
    }
    return {"ttft_segments_ms": parts, "added_ttft_segments_ms": added}


def _window_figures(result: dict[str, Any], c: int, tallies: dict[str, Tally], first: bool) -> None:
    """The concurrency-`c` keys of `result` from its windows' tallies."""
    figures = {n: t.figures() for n, t in tallies.items()}
    keys = {k for f in figures.values() for k in f}
    for key in sorted(keys):
        row = {n: f[key] for n, f in figures.items() if key in f}
        result[f"{key}_c{c}"] = row
        if first and key == "cpu_s_per_1k":
            result["cpu_s_per_1k"] = row  # the first concurrency's, as before
    result[f"failures_c{c}"] = {n: t.failures for n, t in tallies.items()}
    one = result[f"rps_c{c}"].get("pdgate")
    ratios = {
        n: v / one
        for n, v in result[f"rps_c{c}"].items()
        if n.startswith("pdgate_w") and one and not math.isnan(one)
    }
    if ratios:
        result[f"workers_rps_ratio_c{c}"] = ratios


@dataclass(frozen=True, slots=True)
class _Run:
    """What every phase of one run shares."""

    session: aiohttp.ClientSession
    redis_url: str
    log: Log
    pinning: Pinning | None


async def _fast_phase(plan: GatewayPlan, run: _Run, engine: str) -> dict[str, Any]:
    session, redis_url, log, pinning = run.session, run.redis_url, run.log, run.pinning
    spec = ShimSpec(registry_url=redis_url, prefill_capacity=1024, decode_capacity=1024,
                    key_prefix=f"pdgate-bench-fast-{engine}", engine=engine,
                    prefill_s=plan.prefill_s, decode_step_s=plan.token_s,
                    tokenizer=plan.stock_tokenizer)  # fmt: skip
    # Against stock engines pdgate has no batch endpoint to use: pdgate_plain would be pdgate.
    plain = plan.plain and engine == "shim"
    stack = running_fronts(
        session, spec, 256, plan.with_router, log, workers_list=plan.workers, plain=plain,
        aiohttp=plan.aiohttp, router_policies=plan.router_policies, smg=plan.with_smg,
        floor=plan.floor, apis=plan.apis, pinning=pinning,
    )  # fmt: skip
    async with stack as setup, aiohttp.ClientSession() as stats_session:
        fronts, procs = setup.fronts, setup.procs
        names = list(fronts)
        probes = await _ttft_probes(plan, session, fronts)
        result: dict[str, Any] = _ttft_figures(probes, names)
        result["rounds_ttft"] = [
            _ttft_figures(part, names) for part in _in_rounds(probes, plan.rounds)
        ]
        log(f"{engine}: TTFT c=1: {result['ttft_p50_ms']} (p50 ms)")
        engine_urls = [*fronts["direct"].prefills, *fronts["direct"].decodes]
        stock = engine == "stock"
        if stock:
            result.update(await _ttft_segments(stats_session, engine_urls, probes))
            log(f"{engine}: TTFT parts: {result['added_ttft_segments_ms']} (added p50 ms)")
        seen: dict[str, dict[str, Any]] = {}  # stock engines' requests per front
        for i, c in enumerate(plan.concurrencies):
            rounds: list[dict[str, Tally]] = []
            for r in range(plan.rounds):
                rounds.append({n: Tally() for n in names})
                for name in _rotated(names, r):
                    meter = WindowMeter(procs.get(name), setup.engine)
                    before = await engine_stats(stats_session, engine_urls) if stock else None
                    window = await run_window(
                        session, fronts[name], concurrency=c, warmup_s=plan.warmup_s,
                        window_s=plan.window_s, max_tokens=plan.max_tokens,
                        on_window_start=meter.start,
                    )  # fmt: skip
                    t = rounds[r][name]
                    meter.add_to(t)
                    t.requests += window.requests
                    t.failures += window.failures
                    t.events += window.events
                    t.window_s += window.window_s
                    if before is not None:
                        after = await engine_stats(stats_session, engine_urls)
                        _add_seen(seen.setdefault(name, {}), stats_delta(before, after))
            tallies = {n: Tally.total(one[n] for one in rounds) for n in names}
            _window_figures(result, c, tallies, first=i == 0)
            result[f"rounds_c{c}"] = [{n: t.figures() for n, t in one.items()} for one in rounds]
            log(f"{engine}: c={c}: rps {result[f'rps_c{c}']}")
        if stock:
            result["engine_requests"] = {n: s["paths"] for n, s in seen.items()}
            result["engine_connections"] = {n: s["connections"] for n, s in seen.items()}
        result["missing"] = setup.missing
        return result


def _add_seen(total: dict[str, Any], delta: dict[str, Any]) -> None:
    paths = total.setdefault("paths", {})
    for path, n in delta["paths"].items():
        paths[path] = paths.get(path, 0) + n
    total["connections"] = total.get("connections", 0) + delta["connections"]


async def _idle_rss(
    plan: GatewayPlan, session: aiohttp.ClientSession, url: str, proc: Child, streams: int
) -> tuple[dict[int, int], int]:
    """Open `streams` idle streams through one front; its RSS at 0, about half and all open,
    and the descriptors it opened for them. The streams are closed again before returning."""
    await asyncio.sleep(plan.settle_s)
    rss = {0: proc.rss_bytes()}
    fds = proc.open_fds()
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
        fds = proc.open_fds() - fds
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return rss, fds


async def _settled(engine: Child, fds: int, log: Log, timeout_s: float = 90.0) -> None:
    """Until the engines hold about `fds` descriptors again. The fronts take turns on the
    same engines, whose descriptors are bounded: a front's pooled keep-alive connections
    (one per prefill call in flight at its peak) stay open for its keep-alive time after
    its streams closed, and would leave the next front's streams without room."""
    deadline = time.monotonic() + timeout_s
    while (held := engine.open_fds()) > fds + 64:
        if time.monotonic() > deadline:
            log(f"idle: the engines still hold {held} descriptors (had {fds})")
            return
        await asyncio.sleep(1.0)


async def _idle_phase(plan: GatewayPlan, run: _Run, engine: str) -> dict[str, Any]:
    session, redis_url, log, pinning = run.session, run.redis_url, run.log, run.pinning
    limit = _raise_nofile(_FDS_PER_STREAM * plan.idle_streams + _FD_HEADROOM)
    streams = min(plan.idle_streams, (limit - _FD_HEADROOM) // _FDS_PER_STREAM)
    # Fronts take turns, and a front may free its decode slots a little after its streams
    # close: room for both fronts' streams at once.
    decodes = math.ceil(2 * streams / (_SHIM_MAX_CAPACITY - 96))
    spec = ShimSpec(
        registry_url=redis_url,
        # A decode step of an hour: the streams stay open and silent (stock engines send
        # the first token at once, shims not even that).
        decode_step_s=3600.0,
        decodes=decodes,
        prefill_capacity=1024,
        decode_capacity=min(_SHIM_MAX_CAPACITY, math.ceil(2 * streams / decodes) + 64),
        key_prefix="pdgate-bench-idle",
        engine=engine,
    )
    kib: dict[str, float] = {}
    fds_per_stream: dict[str, float] = {}
    rss_mib: dict[str, dict[str, float]] = {}
    async with running_fronts(
        session, spec, streams, plan.with_router, log, warm=False, smg=plan.with_smg,
        floor=plan.floor, pinning=pinning,
    ) as setup:  # fmt: skip
        missing = setup.missing
        engine_fds = setup.engine.open_fds()
        for name, proc in setup.procs.items():
            await _settled(setup.engine, engine_fds, log)
            url = setup.fronts[name].url
            assert url is not None
            try:
                rss, fds = await _idle_rss(plan, session, url, proc, streams)
            except (RuntimeError, TimeoutError) as exc:
                missing[f"{name}_idle"] = repr(exc)[:300]
                continue
            kib[name] = (rss[streams] - rss[0]) / 1024 / streams
            fds_per_stream[name] = fds / streams
            rss_mib[name] = {str(k): v / 2**20 for k, v in rss.items()}
            mib = f"{rss[0] >> 20} -> {rss[streams] >> 20} MiB"
            log(f"idle: {streams} streams via {name}, RSS {mib}")
    return {
        "kib_per_idle_stream": kib.get("pdgate", math.nan),
        "kib_per_idle_stream_by_front": kib,
        "idle_streams": streams,
        "idle_rss_mib": rss_mib,
        "fds_per_idle_stream_by_front": fds_per_stream,
        "idle_missing": missing,
        "idle_engine": engine,
        "nofile_limit": limit,
    }


async def run_gateway_bench(plan: GatewayPlan, log: Log) -> dict[str, Any]:
    _raise_nofile(_FDS_PER_STREAM * plan.idle_streams + _FD_HEADROOM)
    started = time.monotonic()
    with pinned(plan.pin) as pinning:
        result = await _both_phases(plan, log, pinning)
    result["wall_s"] = time.monotonic() - started
    result["load_avg_1m_after"] = os.getloadavg()[0]
    result["pinned"] = plan.pin
    return result


async def _both_phases(plan: GatewayPlan, log: Log, pinning: Pinning | None) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=120)
    async with (
        private_redis() as redis_url,
        aiohttp.ClientSession(connector=connector, timeout=timeout) as session,
    ):
        run = _Run(session, redis_url, log, pinning)
        by_engine = {engine: await _fast_phase(plan, run, engine) for engine in plan.engines}
        # The first engine's figures stay at the top level, where they always were.
        result: dict[str, Any] = {**by_engine[plan.engines[0]], "engine": plan.engines[0]}
        result["by_engine"] = by_engine
        if plan.idle_streams > 0:
            # On stock engines when they are measured: their decodes send the first token at
            # once and then nothing, and a gateway may hold its response until a first token.
            idle = "stock" if "stock" in plan.engines else plan.engines[0]
            result.update(await _idle_phase(plan, run, idle))
    return result
