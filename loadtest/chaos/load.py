"""The chaos benchmark's clients: open-loop streaming requests (Poisson arrivals) behind the
load balancer of the upgrade benchmark (`GatewayPool`), each stream timed event by event.

The retry rule is the upgrade benchmark's (loadtest/lib/pool.py): a request that got
**no response start** (refused or reset before a status line) is sent again to the next
gateway; anything else is final. Unlike `post_stream`, the reader keeps the times of its SSE
events, as the stall of a running stream is what a fault costs a client that already has
its first token: every gap between two consecutive events longer than `GAP_KEEP_S` is kept
(its start and end), and so is the error's code (the JSON body's ``error.code``, else its
``type``; the in-band error chunk's for a stream that broke) and any ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import aiohttp
import orjson

from pdgate.config.aio import finish_or_cancel
from pdgate.loadtest.lib.pool import GatewayPool, PoolLoad
from pdgate.loadtest.scheduling.workload import Workload as Prompts

__all__ = ["DROPPED", "GAP_KEEP_S", "OpenStreamingLoad", "StreamRecord", "read_stream"]

DROPPED = -1  # an arrival the client did not send: its in-flight bound was reached
GAP_KEEP_S = 0.1  # gaps between events shorter than this are ordinary decoding
_DATA = b"data:"
_TOKEN = b'data: {"id"'  # a token event (an in-band error is `data: {"error"`)
_ERROR = b'data: {"error"'
_DONE = b"data: [DONE]"
_JSON = {"content-type": "application/json"}


@dataclass(slots=True)
class StreamRecord:
    issued_s: float  # since the run's origin: first attempt sent (or the arrival, dropped)
    ended_s: float = 0.0
    status: int = 0  # of the last attempt; 0: no response start; DROPPED: never sent
    code: str = ""  # error code (body's error.code or type; in-band error's), "" if none
    message: str = ""  # the error's message, truncated (for diagnosis)
    retry_after: str | None = None  # the last attempt's Retry-After header
    ttft_s: float | None = None  # from the first attempt to the first data event
    events: int = 0
    done: bool = False
    errored: bool = False
    gateway: int = 0  # slot of the last attempt
    reconnects: int = 0
    first_event_s: float | None = None  # since the origin
    last_event_s: float | None = None
    gaps: list[tuple[float, float]] = field(default_factory=list)  # (from, to), since origin

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.done and not self.errored

    @property
    def failed(self) -> bool:
        return not self.completed

    def error_label(self) -> str:
        """What the client saw, for the error column: ``503 gateway_overloaded``, ``0``
        (no response), ``200 <in-band code>`` or ``200 broken`` (no [DONE])."""
        if self.completed:
            return ""
        if self.status == DROPPED:
            return "dropped"
        if self.status == 200 and not self.errored:
            return "200 broken"
        return f"{self.status} {self.code}".strip()


def _error_of(payload: bytes) -> tuple[str, str]:
    """(code, message) of an OpenAI error body (code: its ``code``, else its ``type``)."""
    try:
        body = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return "", ""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return "", ""
    return str(error.get("code") or error.get("type") or ""), str(error.get("message", ""))[:200]


async def read_stream(
    resp: aiohttp.ClientResponse, record: StreamRecord, origin: float, start: float
) -> None:
    """Read an SSE body to its end, filling `record`'s events, gaps, TTFT, done and error."""
    tail = b""
    last: float | None = None
    async for chunk in resp.content.iter_any():
        now = time.monotonic()
        window = tail + chunk
        count = (tail[-4:] + chunk).count(_DATA)  # a "data:" split over two reads counts once
        if record.ttft_s is None and _TOKEN in window:
            record.ttft_s = now - start
            record.first_event_s = now - origin
        if count:
            if last is not None and now - last > GAP_KEEP_S:
                record.gaps.append((last - origin, now - origin))
            last = now
            record.last_event_s = now - origin
            record.events += count
        at = window.find(_ERROR)
        if at >= 0 and not record.errored:
            record.errored = True
            line = window[at + len(b"data: ") :].split(b"\n", 1)[0]
            record.code, record.message = _error_of(line)
        if _DONE in window:
            record.done = True
        tail = window[-(len(_ERROR) + 512) :] if not record.errored else b""


class OpenStreamingLoad(PoolLoad):
    """Poisson arrivals at `rate_rps` (seeded), arrival i to gateway i mod N (its retries to
    the next ones); at most `max_in_flight` open, beyond that an arrival is `DROPPED`.
    `pause` stops the arrivals (requests open go on), `resume` starts them again."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        pool: GatewayPool,
        prompts: Prompts,
        rate_rps: float,
        model: str,
        *,
        origin: float,
        seed: int = 0,
        min_tokens: int | None = None,
        max_in_flight: int = 512,
        max_attempts: int = 6,
        client_timeout_s: float = 120.0,
    ) -> None:
        if rate_rps <= 0:
            raise ValueError("the rate must be positive")
        timeout = aiohttp.ClientTimeout(total=client_timeout_s, sock_read=60.0)
        super().__init__(
            session, pool, prompts, model, origin=origin, max_attempts=max_attempts,
            timeout=timeout, min_tokens=min_tokens,
        )  # fmt: skip
        self.rate_rps = rate_rps
        self._rng = random.Random(seed)
        self._prompt_rng = prompts.user_rng(seed)
        self._max_in_flight = max_in_flight
        self._arrivals: asyncio.Task[None] | None = None
        self._requests: set[asyncio.Task[None]] = set()
        self._running = asyncio.Event()
        self._count = 0
        self.records: list[StreamRecord] = []

    @property
    def issued(self) -> int:
        return self._count

    def start(self) -> None:
        self._running.set()
        self._arrivals = asyncio.create_task(self._arrive(), name="arrivals")

    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Until no request is open (after `pause`); False if `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        while self.in_flight:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def stop(self, timeout_s: float) -> int:
        """Stop the arrivals, let open requests end (at most `timeout_s`); how many had to be
        cancelled."""
        self._stopping = True
        self._running.set()  # a paused arrival loop wakes up to see it is stopping
        if self._arrivals is not None:
            self._arrivals.cancel()
            await asyncio.gather(self._arrivals, return_exceptions=True)
        return await finish_or_cancel(list(self._requests), timeout_s)

    async def _arrive(self) -> None:
        next_at = time.monotonic()
        while not self._stopping:
            if not self._running.is_set():
                await self._running.wait()
                next_at = time.monotonic()
            next_at += self._rng.expovariate(self.rate_rps)
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            if self._stopping or not self._running.is_set():
                continue
            index = self._count
            self._count += 1
            if self.in_flight >= self._max_in_flight:
                now = time.monotonic() - self._origin
                self.records.append(StreamRecord(issued_s=now, ended_s=now, status=DROPPED))
                continue
            task = asyncio.create_task(self._one(index))
            self._requests.add(task)
            task.add_done_callback(self._requests.discard)

    def _next_body(self) -> bytes:
        prompt = self._prompts.next_prompt(self._prompt_rng)
        most = prompt.scenario.max_tokens
        low = most if self._min_tokens is None else self._min_tokens
        return self._body(prompt.text, self._prompt_rng.randint(min(low, most), most))

    async def _one(self, index: int) -> None:
        self.in_flight += 1
        try:
            self.records.append(await self._request(index, self._next_body()))
        finally:
            self.in_flight -= 1

    async def _request(self, index: int, body: bytes) -> StreamRecord:
        start = time.monotonic()
        record = StreamRecord(issued_s=start - self._origin)

        async def attempt(slot: int, url: str) -> int:
            record.gateway = slot
            await self._attempt(url, body, record, start)
            return record.status

        record.reconnects = await self._send(index, attempt) - 1
        record.ended_s = time.monotonic() - self._origin
        return record

    async def _attempt(self, url: str, body: bytes, record: StreamRecord, start: float) -> None:
        record.status = 0
        try:
            async with self._session.post(
                url, data=body, headers=_JSON, timeout=self._timeout
            ) as resp:
                record.status = resp.status
                record.retry_after = resp.headers.get("Retry-After")
                if resp.status != 200:
                    record.code, record.message = _error_of(await resp.read())
                else:
                    await read_stream(resp, record, self._origin, start)
        except (aiohttp.ClientError, TimeoutError, OSError):
            pass
