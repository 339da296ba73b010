"""``pdgate bench stages``: where a lone request's time goes, step by step, in process.

The same setup as `pdgate bench hotpath` (the gateway's ASGI app built as ``pdgate gateway``
builds it, over `MockUpstream`: two queue-less prefills and two decodes in an in-memory
registry, called as uvicorn calls it), but one request at a time (concurrency 1), each
stamped with the time it reaches each step of its life: a few of the gateway's methods are
wrapped, for this measurement only, so that their first call in a request records the
clock. The wrappers cost about a microsecond in all. No sockets: what it shows is pdgate's
own Python on the path to the prefill, which a deployed gateway pays at c=1 on top of the
server's and the client's work (docs/results/performance/README.md, "A lone request, step
by step").

    pdgate bench stages [--rounds 3] [--requests 3000]

The wrappers stay on the classes for the rest of the process: run it in a process of its
own (the CLI is one). It prints a markdown table: each step's microseconds (the median over
a round's requests; min / median / max of those over the rounds).
"""

from __future__ import annotations

import functools
import itertools
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import uvloop

import pdgate.gateway.api.completions as completions
import pdgate.gateway.placement.dispatch as dispatch
import pdgate.gateway.placement.forwarder as forwarder
import pdgate.gateway.placement.prefill_call as prefill_call
import pdgate.gateway.stream.out as out
import pdgate.gateway.stream.relay as relay
from pdgate.gateway.upstream.mock import Call, Reply
from pdgate.loadtest.gateway_cost._asgi import Lifespan, request
from pdgate.loadtest.gateway_cost.hotpath import engine_handler, mock_gateway, request_body

__all__ = ["STEPS", "measure", "run", "table"]

TOKENS = 4
STAMPS: dict[str, float] = {}

# (label, what happens from the previous stamp to this one), in the order a request meets them.
STEPS = [
    ("arrived", ""),
    ("read", "the server's call to the endpoint: key check, header map, request id"),
    ("parsed", "the body read within its bounds and timeout"),
    ("described", "schema validation, model, group, tenancy, deadline"),
    ("relaying", "span, disconnect watcher, the relay and its task"),
    ("dispatched", "the dispatcher's entry"),
    ("queued", "retry budget, aggregated and local-prefill checks, the prefill body"),
    ("woken", "start guard, drain admission, queue push, batch forming, wake"),
    ("turn", "the forwarder's task starts"),
    ("candidates", "early drop, decode back-pressure, the prefills' loads"),
    ("reserving", "policy ranking, run size, the fleet's slot leases"),
    ("reserved", "the counts: slot, open stream, computing, work; KV id"),
    ("attempting", "the attempt's task starts"),
    ("prefill_call", "the prefill call: timeout, headers, the client's entry"),
    ("decode_call", "the prefill's answer: settle, grant, decode ranking and open"),
    ("first_event", "the decode's first event read and parsed, up to the response's start"),
    ("ended", f"the other {TOKENS - 1} events, [DONE], release and records"),
]


def _stamp_async(cls: Any, name: str, label: str) -> None:
    original = getattr(cls, name)

    @functools.wraps(original)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        STAMPS.setdefault(label, time.perf_counter())
        return await original(*args, **kwargs)

    setattr(cls, name, wrapper)


def _stamp_sync(cls: Any, name: str, label: str, *, after: bool = False) -> None:
    original: Callable[..., Any] = getattr(cls, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not after:
            STAMPS.setdefault(label, time.perf_counter())
        result = original(*args, **kwargs)
        if after:
            STAMPS.setdefault(label, time.perf_counter())
        return result

    setattr(cls, name, wrapper)


def _instrument() -> None:
    endpoint, fwd = completions.CompletionsEndpoint, forwarder.PrefillForwarder
    _stamp_async(endpoint, "read", "read")
    _stamp_sync(endpoint, "_parse", "parsed")
    _stamp_sync(endpoint, "_request_info", "described", after=True)
    _stamp_async(relay.Relay, "run", "relaying")
    _stamp_async(dispatch.Dispatcher, "prefill", "dispatched")
    _stamp_async(fwd, "acquire", "queued")
    _stamp_sync(fwd, "_wake", "woken", after=True)
    _stamp_async(fwd, "_run", "turn")
    _stamp_sync(fwd, "_candidates", "candidates", after=True)
    _stamp_sync(fwd, "_reserve", "reserving")
    _stamp_sync(fwd, "_reserve", "reserved", after=True)
    _stamp_async(prefill_call.PrefillCalls, "_attempt", "attempting")
    _stamp_async(out.StreamOut, "raw", "first_event")  # the response's start


def _handler() -> Callable[[Call], Awaitable[Reply]]:
    answer = engine_handler(TOKENS)

    async def handler(call: Call) -> Reply:
        STAMPS.setdefault(f"{call.leg}_call", time.perf_counter())
        return await answer(call)

    return handler


async def _one(app: Any, state: dict[str, Any], body: bytes) -> None:
    STAMPS.clear()
    STAMPS["arrived"] = time.perf_counter()
    await request(app, state, body)
    STAMPS["ended"] = time.perf_counter()


async def measure(rounds: int, requests: int, warmup: int) -> list[dict[str, float]]:
    """Per round, each step's median microseconds."""
    _instrument()
    app, registry = await mock_gateway(2, _handler())
    body = request_body(TOKENS)
    labels = [label for label, _ in STEPS]
    out: list[dict[str, float]] = []
    async with Lifespan(app) as state:
        for _ in range(warmup):
            await _one(app, state, body)
        for _ in range(rounds):
            steps: dict[str, list[float]] = {label: [] for label in labels[1:]}
            for _ in range(requests):
                await _one(app, state, body)
                missing = [label for label in labels if label not in STAMPS]
                if missing:
                    raise RuntimeError(f"a request skipped steps {missing}: the path changed")
                for before, after in itertools.pairwise(labels):
                    steps[after].append(STAMPS[after] - STAMPS[before])
            out.append({k: 1e6 * statistics.median(v) for k, v in steps.items()})
    await registry.aclose()
    return out


def table(rounds: list[dict[str, float]]) -> str:
    lines = ["| step | from the previous step | us (min / median / max) |", "|---|---|--:|"]

    def spread(values: list[float]) -> str:
        return f"{min(values):.1f} / {statistics.median(values):.1f} / {max(values):.1f}"

    for label, what in STEPS[1:]:
        lines.append(f"| {label} | {what} | {spread([r[label] for r in rounds])} |")
    labels = [label for label, _ in STEPS[1:]]
    before = labels[: labels.index("prefill_call") + 1]
    to_prefill = [sum(r[label] for label in before) for r in rounds]
    lines.append(f"| **to the prefill call** | | {spread(to_prefill)} |")
    whole = [sum(r.values()) for r in rounds]
    lines.append(f"| **whole request** | | {spread(whole)} |")
    return "\n".join(lines)


def run(rounds: int, requests: int, warmup: int) -> str:
    """The report: the interpreter, then the table (wraps the gateway's classes for good)."""
    measured = uvloop.run(measure(rounds, requests, warmup))
    head = f"Python {sys.version.split()[0]}, uvloop, {rounds} rounds of {requests}"
    return head + "\n" + table(measured) + "\n"
