"""The load client of ``pdgate bench gateway``: streaming completions, timed, as cheaply as
possible (the client shares two cores with what it measures).

A *front* is how a request reaches the engines: ``pdgate`` and ``vllm_router`` are one URL;
``direct`` is the floor, the client doing a router's two calls itself (prefill leg with
``max_tokens=1`` and ``kv_transfer_params``, then the decode leg with the prefill's
``kv_transfer_params``, both round-robin), so "added" latency is what a router adds on top
of the two unavoidable calls. Streams are read by the benchmarks' one SSE client
(loadtest/lib/sse.py), which does not parse them: events are counted by their ``data:``
prefix and TTFT is the first token event.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from pdgate.config.wire import prefill_kv_request
from pdgate.loadtest.lib.sse import (
    MESSAGES,
    OPENAI,
    RESPONSES,
    Dialect,
    StreamOutcome,
    post_stream,
)

__all__ = [
    "API_PATHS",
    "Front",
    "Outcome",
    "WindowResult",
    "open_idle_stream",
    "run_window",
    "send",
    "warm",
]

_JSON = {"content-type": "application/json"}


# The path of each API a front may be asked through (gateway/translate/ for the last two).
API_PATHS = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
}
_DIALECTS = {"responses": RESPONSES, "messages": MESSAGES}


@dataclass(slots=True)
class Front:
    name: str
    url: str | None = None  # the API's URL at a router (.../v1/completions); None: direct
    prefills: Sequence[str] = ()
    decodes: Sequence[str] = ()
    turn: itertools.count[int] = field(default_factory=itertools.count)  # round-robin
    api: str = "completions"  # one of API_PATHS (a router front's only)

    def body(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        model = "sim-llama-3.1-8b"
        if self.api == "completions":
            request: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens}
        elif self.api == "responses":
            request = {"model": model, "input": prompt, "max_output_tokens": max_tokens}
        else:
            messages = [{"role": "user", "content": prompt}]
            request = {"model": model, "messages": messages, "max_tokens": max_tokens}
        return {**request, "temperature": 0, "stream": True}

    @property
    def dialect(self) -> Dialect:
        return _DIALECTS.get(self.api, OPENAI)


@dataclass(frozen=True, slots=True)
class Outcome:
    ok: bool
    ttft_s: float | None
    events: int  # SSE data events before [DONE]
    end: float  # time.monotonic() at the end
    start: float = 0.0  # time.monotonic() when the request (its first leg) was sent


def _outcome(out: StreamOutcome, start: float) -> Outcome:
    if not out.completed:
        return Outcome(False, None, 0, out.end, start)
    return Outcome(True, out.ttft_s, out.events, out.end, start)


async def send(
    session: aiohttp.ClientSession, front: Front, prompt: str, max_tokens: int
) -> Outcome:
    body = front.body(prompt, max_tokens)
    start = time.monotonic()
    if front.url is not None:
        stream = post_stream(
            session, front.url, orjson.dumps(body), start=start, dialect=front.dialect
        )
        return _outcome(await stream, start)
    turn = next(front.turn)
    prefill = front.prefills[turn % len(front.prefills)] + "/v1/completions"
    decode = front.decodes[turn % len(front.decodes)] + "/v1/completions"
    leg = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": prefill_kv_request()}
    try:
        async with session.post(prefill, data=orjson.dumps(leg), headers=_JSON) as resp:
            reply = await resp.read()
            if resp.status != 200:
                return Outcome(False, None, 0, time.monotonic(), start)
        params = orjson.loads(reply)["kv_transfer_params"]
    except (aiohttp.ClientError, TimeoutError, OSError, KeyError, orjson.JSONDecodeError):
        return Outcome(False, None, 0, time.monotonic(), start)
    decode_body = orjson.dumps({**body, "kv_transfer_params": params})
    # TTFT counts from the start of the prefill leg, as it does through a router.
    return _outcome(await post_stream(session, decode, decode_body, start=start), start)


async def warm(session: aiohttp.ClientSession, fronts: dict[str, Front]) -> None:
    """Warm every front's connections and code paths; a failed request fails the run."""
    for name, front in fronts.items():
        for i in range(20):
            if not (await send(session, front, f"warm {i}", 4)).ok:
                raise RuntimeError(f"{name}: warm-up request failed")


@dataclass(frozen=True, slots=True)
class WindowResult:
    requests: int  # completed successfully inside the window
    failures: int
    events: int
    window_s: float

    @property
    def rps(self) -> float:
        return self.requests / self.window_s

    @property
    def events_per_s(self) -> float:
        return self.events / self.window_s


async def run_window(
    session: aiohttp.ClientSession,
    front: Front,
    *,
    concurrency: int,
    warmup_s: float,
    window_s: float,
    max_tokens: int,
    on_window_start: Callable[[], None] | None = None,
) -> WindowResult:
    """`concurrency` closed-loop workers for warmup + window; counts what ends in the window.

    `on_window_start` runs when the window opens, to snapshot CPU counters."""
    t0 = time.monotonic()
    opens, closes = t0 + warmup_s, t0 + warmup_s + window_s
    tally = [0, 0, 0]  # ok, failed, events

    async def worker(index: int) -> None:
        n = 0
        while time.monotonic() < closes:
            out = await send(session, front, f"bench worker {index} request {n}", max_tokens)
            n += 1
            if opens <= out.end < closes:
                tally[0 if out.ok else 1] += 1
                tally[2] += out.events if out.ok else 0
            if not out.ok:
                await asyncio.sleep(0.01)  # a failing front must not turn this into a busy loop

    async def opener() -> None:
        await asyncio.sleep(warmup_s)
        if on_window_start is not None:
            on_window_start()

    await asyncio.gather(opener(), *(worker(i) for i in range(concurrency)))
    return WindowResult(tally[0], tally[1], tally[2], window_s)


async def open_idle_stream(
    session: aiohttp.ClientSession, url: str, index: int, opened: asyncio.Event
) -> None:
    """Hold one stream open (its decode emits no token) until cancelled; `opened` is set once
    the response headers came, i.e. the gateway placed it and relays it."""
    body = orjson.dumps(
        {
            "model": "sim-llama-3.1-8b",
            "prompt": f"idle stream {index}",
            "max_tokens": 64,
            "stream": True,
        }
    )
    timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
    try:
        async with session.post(url, data=body, headers=_JSON, timeout=timeout) as resp:
            if resp.status != 200:
                why = (await resp.content.read(300)).decode(errors="replace")
                raise RuntimeError(f"idle stream {index}: HTTP {resp.status}: {why}")
            opened.set()
            async for _ in resp.content.iter_any():
                pass
    finally:
        opened.set()  # also on failure: the opener then finds this task done and says why
