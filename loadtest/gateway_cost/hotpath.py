"""``pdgate bench hotpath``: pdgate's own Python per request, without sockets, to a few percent.

`pdgate bench compare` measures gateway builds as deployed, and on a shared two-core machine
its ratios move by about ±0.15 between runs: too coarse to tell whether a change to the hot
path saved 3%. This benchmark takes everything but pdgate's code away: the gateway's ASGI
app (built as ``pdgate gateway`` builds it, settings from the environment as usual) runs in
this process over `MockUpstream` (two queue-less prefills, two decodes, in an in-memory
registry) and is called directly, as uvicorn would call it, by `concurrency` loops of
streaming completions whose decodes send ``tokens`` one-token events each, one event per
chunk as pdgate's shims do. It reports the process's CPU time per request (min/median/max
over ``--rounds``): the endpoint, queue, forwarder, policies, dispatcher, relay, metrics and
Starlette's request handling, and nothing of uvicorn, aiohttp or the engines. ``--profile``
adds cProfile's view of pdgate's own functions, ``--whole`` makes the requests non-streaming.

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
from typing import Any

import orjson

from pdgate.config import GatewaySettings, RegistrySettings, Role
from pdgate.config.wire import EXT_BATCH_PREFILL, EXT_CONTINUATION, EXT_QUEUELESS, SSE_DONE
from pdgate.gateway.app import build_gateway_app
from pdgate.gateway.mock_upstream import Call, MockUpstream, Reply
from pdgate.registry import open_registry
from pdgate.registry.base import InstanceRecord

__all__ = ["HotpathPlan", "HotpathResult", "run_hotpath"]

_MODEL = "sim-llama-3.1-8b"


@dataclass(frozen=True, slots=True)
class HotpathPlan:
    requests: int = 4000  # per round
    concurrency: int = 8
    rounds: int = 5
    tokens: int = 16
    stream: bool = True
    warmup: int = 400
    profile: bool = False
    top: int = 30


@dataclass(frozen=True, slots=True)
class HotpathResult:
    us_per_request: list[float]  # one per round
    requests_per_s: list[float]  # wall clock, this process alone
    garbage_per_request: list[float]  # objects only the cyclic GC freed
    profile: str = ""

    def report(self, plan: HotpathPlan, command: str) -> str:
        us, rps, junk = self.us_per_request, self.requests_per_s, self.garbage_per_request
        kind = "streaming" if plan.stream else "non-streaming"
        lines = [
            f"`{command}`",
            "",
            f"{plan.rounds} rounds of {plan.requests} {kind} requests, concurrency "
            f"{plan.concurrency}, {plan.tokens} tokens each (after {plan.warmup} warm-up "
            "requests); pdgate's ASGI app over MockUpstream, no sockets"
            + ("; the figures include cProfile's overhead." if self.profile else "."),
            "",
            "| CPU us per request (min/median/max) | requests/s (median) | cyclic garbage "
            "per request (max) |",
            "|---|---|---|",
            f"| {min(us):.1f}/{statistics.median(us):.1f}/{max(us):.1f} | "
            f"{statistics.median(rps):.0f} | {max(junk):.2f} |",
        ]
        text = "\n".join(lines) + "\n"
        return text + ("\n" + self.profile if self.profile else "")


def _decode_chunks(tokens: int) -> list[bytes]:
    """A vLLM-shaped stream asked for ``return_token_ids`` (the gateway asks it when migration
    is on), with an id of the decode's own: one token an event, then [DONE]."""
    out = []
    for i in range(tokens):
        event = {
            "id": "cmpl-decode",
            "object": "text_completion",
            "created": 1,
            "model": _MODEL,
            "choices": [
                {
                    "index": 0,
                    "text": " tok",
                    "logprobs": None,
                    "finish_reason": "length" if i == tokens - 1 else None,
                    "stop_reason": None,
                    "token_ids": [100 + i],
                }
            ],
            "usage": None,
        }
        out.append(b"data: " + orjson.dumps(event) + b"\n\n")
    return [*out, SSE_DONE]


def _handler(tokens: int) -> Callable[[Call], Awaitable[Reply]]:
    chunks = _decode_chunks(tokens)

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


class _Lifespan:
    """The app's ASGI lifespan, driven as uvicorn drives it."""

    def __init__(self, app: Any) -> None:
        self._app = app
        self.state: dict[str, Any] = {}
        self._in: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._out: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def _message(self, kind: str) -> None:
        await self._in.put({"type": f"lifespan.{kind}"})
        reply = await self._out.get()
        if reply["type"] != f"lifespan.{kind}.complete":
            raise RuntimeError(f"lifespan {kind} failed: {reply}")

    async def __aenter__(self) -> dict[str, Any]:
        scope = {"type": "lifespan", "state": self.state, "asgi": {"version": "3.0"}}
        self._task = asyncio.create_task(self._app(scope, self._in.get, self._out.put))
        await self._message("startup")
        return self.state

    async def __aexit__(self, *exc: object) -> None:
        await self._message("shutdown")
        if self._task is not None:
            await self._task


async def _one(app: Any, state: dict[str, Any], body: bytes) -> None:
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "query_string": b"", "root_path": "", "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 40000), "state": state,
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())],
    }  # fmt: skip
    sent = False
    status: list[int] = []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client stays: cancelled when the response ends
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])

    await app(scope, receive, send)
    if status != [200]:
        raise RuntimeError(f"a request failed: {status}")


async def run_hotpath(plan: HotpathPlan) -> HotpathResult:
    registry = open_registry(RegistrySettings())
    for role, extensions in (
        (Role.PREFILL, (EXT_BATCH_PREFILL, EXT_QUEUELESS)),
        (Role.DECODE, (EXT_CONTINUATION,)),
    ):
        for i in range(2):
            name = f"{role.value}{i}"
            record = InstanceRecord(id=name, role=role, url=f"http://{name}", model=_MODEL,
                                    capacity=1024, extensions=extensions)  # fmt: skip
            await registry.put(record, ttl_s=3600)
    upstream = MockUpstream(_handler(plan.tokens), record=False)
    app = build_gateway_app(GatewaySettings.load(), registry, RegistrySettings(), upstream=upstream)
    body = orjson.dumps({"model": _MODEL, "prompt": "hello world " * 8,
                         "max_tokens": plan.tokens, "stream": plan.stream,
                         "temperature": 0})  # fmt: skip

    async def requests(n: int) -> None:
        async def loop(count: int) -> None:
            for _ in range(count):
                await _one(app, state, body)

        share, extra = divmod(n, plan.concurrency)
        await asyncio.gather(*(loop(share + (i < extra)) for i in range(plan.concurrency)))

    us: list[float] = []
    rps: list[float] = []
    junk: list[float] = []
    profiler = cProfile.Profile() if plan.profile else None
    async with _Lifespan(app) as state:
        await requests(plan.warmup)
        for _ in range(plan.rounds):
            gc.collect()
            freed = _collected()
            cpu, wall = time.process_time(), time.perf_counter()
            if profiler is not None:
                profiler.enable()
            await requests(plan.requests)
            if profiler is not None:
                profiler.disable()
            us.append(1e6 * (time.process_time() - cpu) / plan.requests)
            rps.append(plan.requests / (time.perf_counter() - wall))
            gc.collect()  # after the clock: what is left of the round's cycles
            junk.append((_collected() - freed) / plan.requests)
    await registry.aclose()
    text = _profile_text(profiler, plan) if profiler is not None else ""
    return HotpathResult(us, rps, junk, text)


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
            where = marker.strip("/") + "/" + path.rsplit("/", 1)[-1]
            rows.append((own, cumulative, calls, f"{where}:{line} {name}"))
    rows.sort(reverse=True)
    lines = ["cProfile, pdgate's functions (us per request: self, inclusive; calls per request)"]
    lines += [f"{1e6 * o / n:8.1f} {1e6 * c / n:8.1f} {k / n:6.2f}  {where}"
              for o, c, k, where in rows[: plan.top]]  # fmt: skip
    return "\n".join(lines) + "\n"
