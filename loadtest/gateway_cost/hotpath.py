"""``pdgate bench hotpath``: pdgate's own Python per request, without sockets, to a few percent.

`pdgate bench compare` measures gateway builds as deployed, and on a shared two-core machine
its ratios move by about ±0.15 between runs: too coarse to tell whether a change to the hot
path saved 3%. This benchmark takes everything but pdgate's code away: the gateway's ASGI
app (built as ``pdgate gateway`` builds it, settings from the environment as usual) runs in
this process over `MockUpstream` (queue-less prefills and decodes, two of each by default,
in an in-memory registry) and is called directly, as uvicorn would call it, by
`concurrency` loops of streaming completions whose decodes send ``tokens`` one-token events
each, one event per chunk as pdgate's shims do. It reports the process's CPU time per
request (min/median/max over ``--rounds``): the endpoint, queue, forwarder, policies,
dispatcher, relay, metrics and Starlette's request handling, and nothing of uvicorn, aiohttp
or the engines. ``--profile`` adds cProfile's view of pdgate's own functions, ``--whole``
makes the requests non-streaming, ``--instances`` registers more prefills and decodes (the
work per request that grows with the fleet: snapshots, filters, scorers, the sort).

It also reports the objects the cyclic garbage collector freed per request: a request whose
objects refer to each other (a grant that points back at its waiter, say) is freed only by a
collection, which then costs time in proportion to everything young. pdgate's requests leave
none (tests/loadtest/gateway_cost/test_hotpath.py), so any figure above 0 is a new cycle.

Use it to compare commits or settings on one machine, one after the other; use
`pdgate bench compare` to say what a request costs as deployed.
"""

from __future__ import annotations

import asyncio
import cProfile
import gc
import pstats
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import orjson

from pdgate.config import GatewaySettings, RegistrySettings, Role
from pdgate.config.wire import EXT_BATCH_PREFILL, EXT_CONTINUATION, EXT_QUEUELESS, SSE_DONE
from pdgate.gateway.app import GatewayApp, build_gateway_app
from pdgate.gateway.upstream.mock import Call, MockUpstream, Reply
from pdgate.loadtest.gateway_cost._asgi import Lifespan, decode_events, requests
from pdgate.registry import open_registry
from pdgate.registry.base import InstanceRecord, Registry

__all__ = [
    "HotpathPlan",
    "HotpathResult",
    "engine_handler",
    "mock_gateway",
    "request_body",
    "run_hotpath",
]

_MODEL = "sim-llama-3.1-8b"


@dataclass(frozen=True, slots=True)
class HotpathPlan:
    requests: int = 4000  # per round
    concurrency: int = 8
    rounds: int = 5
    tokens: int = 16
    stream: bool = True
    instances: int = 2  # prefills, and as many decodes
    warmup: int = 400
    profile: bool = False
    top: int = 30


@dataclass(frozen=True, slots=True)
class HotpathResult:
    us_per_request: list[float]  # one per round
    requests_per_s: list[float]  # wall clock, this process alone
    garbage_per_request: list[float]  # objects only the cyclic GC freed
    profile: str = ""
    loop: str = "asyncio"  # whose event loop ran it (the caller's choice)

    def report(self, plan: HotpathPlan, command: str) -> str:
        us, rps, junk = self.us_per_request, self.requests_per_s, self.garbage_per_request
        kind = "streaming" if plan.stream else "non-streaming"
        lines = [
            f"`{command}`",
            "",
            f"{plan.rounds} rounds of {plan.requests} {kind} requests, concurrency "
            f"{plan.concurrency}, {plan.tokens} tokens each (after {plan.warmup} warm-up "
            f"requests); pdgate's ASGI app over MockUpstream ({plan.instances} prefills and "
            f"{plan.instances} decodes), no sockets, on {self.loop}'s "
            "event loop" + ("; the figures include cProfile's overhead." if self.profile else "."),
            "",
            "| CPU us per request (min/median/max) | requests/s (median) | cyclic garbage "
            "per request (max) |",
            "|---|---|---|",
            f"| {min(us):.1f}/{statistics.median(us):.1f}/{max(us):.1f} | "
            f"{statistics.median(rps):.0f} | {max(junk):.2f} |",
        ]
        text = "\n".join(lines) + "\n"
        return text + ("\n" + self.profile if self.profile else "")


def engine_handler(tokens: int) -> Callable[[Call], Awaitable[Reply]]:
    """The mock engines' answers: a prefill's handshake reply, a decode's stream of `tokens`
    one-token events (one a chunk)."""
    chunks = [*decode_events(tokens, _MODEL), SSE_DONE]

    async def handler(call: Call) -> Reply:
        if call.leg == "prefill":
            params = {"do_remote_prefill": True, "remote_host": "h", "remote_port": 1,
                      "remote_request_id": call.kv_id or "kv"}  # fmt: skip
            return Reply(
                json={
                    "choices": [{"text": "x", "token_ids": [1]}],
                    "kv_transfer_params": params,
                    "usage": {"prompt_tokens": 24},
                }
            )
        return Reply(chunks=chunks)

    return handler


async def mock_gateway(
    instances: int, handler: Callable[[Call], Awaitable[Reply]]
) -> tuple[GatewayApp, Registry]:
    """The gateway's app as ``pdgate gateway`` builds it (settings from the environment), over
    `MockUpstream` answering with `handler`, `instances` queue-less prefills and as many decodes
    in an in-memory registry (the caller closes it)."""
    registry = open_registry(RegistrySettings())
    for role, extensions in (
        (Role.PREFILL, (EXT_BATCH_PREFILL, EXT_QUEUELESS)),
        (Role.DECODE, (EXT_CONTINUATION,)),
    ):
        for i in range(instances):
            name = f"{role.value}{i}"
            record = InstanceRecord(id=name, role=role, url=f"http://{name}", model=_MODEL,
                                    capacity=1024, extensions=extensions)  # fmt: skip
            await registry.put(record, ttl_s=3600)
    upstream = MockUpstream(handler, record=False)
    app = build_gateway_app(GatewaySettings.load(), registry, RegistrySettings(), upstream=upstream)
    return app, registry


def request_body(tokens: int, *, stream: bool = True) -> bytes:
    """The benchmark's completion request: a short prompt, `tokens` tokens."""
    return orjson.dumps({"model": _MODEL, "prompt": "hello world " * 8, "max_tokens": tokens,
                         "stream": stream, "temperature": 0})  # fmt: skip


async def run_hotpath(plan: HotpathPlan) -> HotpathResult:
    app, registry = await mock_gateway(plan.instances, engine_handler(plan.tokens))
    body = request_body(plan.tokens, stream=plan.stream)

    us: list[float] = []
    rps: list[float] = []
    junk: list[float] = []
    profiler = cProfile.Profile() if plan.profile else None
    async with Lifespan(app) as state:
        await requests(app, state, body, plan.warmup, plan.concurrency)
        for _ in range(plan.rounds):
            gc.collect()
            freed = _collected()
            cpu, wall = time.process_time(), time.perf_counter()
            if profiler is not None:
                profiler.enable()
            await requests(app, state, body, plan.requests, plan.concurrency)
            if profiler is not None:
                profiler.disable()
            us.append(1e6 * (time.process_time() - cpu) / plan.requests)
            rps.append(plan.requests / (time.perf_counter() - wall))
            gc.collect()  # after the clock: what is left of the round's cycles
            junk.append((_collected() - freed) / plan.requests)
    await registry.aclose()
    text = _profile_text(profiler, plan) if profiler is not None else ""
    loop = type(asyncio.get_running_loop()).__module__.split(".")[0]
    return HotpathResult(us, rps, junk, text, loop="uvloop" if loop == "uvloop" else "asyncio")


def _collected() -> int:
    return sum(generation["collected"] for generation in gc.get_stats())


def _profile_text(profiler: cProfile.Profile, plan: HotpathPlan) -> str:
    """pdgate's own functions by self time, per request (cProfile's overhead included)."""
    stats = pstats.Stats(profiler)
    n = plan.requests * plan.rounds
    rows = []
    for (path, line, name), (_, calls, own, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        marker = next((m for m in ("/gateway/", "/policies/", "/registry/", "/config/")
                       if m in path and "site-packages" not in path), None)  # fmt: skip
        if marker is not None:
            # The path from the package folder on: gateway/stream/relay.py, not relay.py.
            where = marker.strip("/") + "/" + path.rsplit(marker, 1)[-1]
            rows.append((own, cumulative, calls, f"{where}:{line} {name}"))
    rows.sort(reverse=True)
    lines = ["cProfile, pdgate's functions (us per request: self, inclusive; calls per request)"]
    lines += [f"{1e6 * o / n:8.1f} {1e6 * c / n:8.1f} {k / n:6.2f}  {where}"
              for o, c, k, where in rows[: plan.top]]  # fmt: skip
    return "\n".join(lines) + "\n"
