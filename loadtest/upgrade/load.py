"""The clients of the rolling-upgrade benchmark: closed-loop users with long streams behind a
load balancer that knows the gateways.

`GatewayPool` is the load balancer's view (a Kubernetes Service's endpoints): one slot per
gateway, its current URL, and whether it is in rotation. User *i* sends to the *i*-th
gateway in rotation (mod their number).

Retries follow one rule, the one a client of an OpenAI-compatible service can apply safely:
a request that got **no response start** (connection refused or reset before a status line,
status 0 in `post_stream`) may be sent again, to the next gateway in rotation; nothing was
generated for it. Anything else is final: a 4xx/5xx status is a failure, and so is a stream
that started and then broke (no ``data: [DONE]``, or an in-band error), since its tokens
cannot be taken back. TTFT counts from the first attempt, so reconnecting shows as a bump.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
import orjson

from pdgate.config.aio import finish_or_cancel
from pdgate.loadtest.lib.sse import post_stream
from pdgate.loadtest.scheduling.workload import Workload as Prompts

__all__ = ["GatewayPool", "Record", "StreamingLoad"]


class GatewayPool:
    def __init__(self, urls: Sequence[str]) -> None:
        if not urls:
            raise ValueError("a pool needs a gateway")
        self.urls = list(urls)  # slot -> current base URL
        self._in = list(range(len(urls)))  # slots in rotation, in order

    @property
    def rotation(self) -> list[int]:
        return list(self._in)

    def pick(self, user: int, attempt: int) -> tuple[int, str]:
        """(slot, URL) for a user's attempt: its own gateway first, then the next ones."""
        live = self._in or list(range(len(self.urls)))  # none in rotation: try them all
        slot = live[(user + attempt) % len(live)]
        return slot, self.urls[slot]

    def remove(self, slot: int) -> None:
        """Out of rotation: new requests go elsewhere; open streams are not touched."""
        if slot in self._in:
            self._in.remove(slot)

    def add(self, slot: int, url: str) -> None:
        self.urls[slot] = url
        if slot not in self._in:
            self._in.append(slot)
            self._in.sort()


@dataclass(frozen=True, slots=True)
class Record:
    user: int
    issued_s: float  # seconds since the run's origin, first attempt sent
    ended_s: float  # response (or failure) over
    gateway: int  # slot of the last attempt
    status: int  # of the last attempt; 0: no response start
    ttft_s: float | None  # from the first attempt
    events: int  # data events before [DONE]
    completed: bool  # 200, data: [DONE], no in-band error
    reconnects: int  # attempts before the last that got no response start

    @property
    def failed(self) -> bool:
        return not self.completed

    def why(self) -> str:
        if self.completed:
            return "ok"
        if self.status == 0:
            return "no response from any gateway"
        if self.status != 200:
            return f"HTTP {self.status}"
        return "stream broken after it started"


class StreamingLoad:
    """``users`` closed-loop users, started over `ramp_s`; each request asks for between
    `min_tokens` and the scenario's max_tokens tokens (uniform; default exactly max_tokens);
    each outcome is kept as a `Record`."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        pool: GatewayPool,
        prompts: Prompts,
        users: int,
        model: str,
        *,
        origin: float,
        max_attempts: int = 6,
        client_timeout_s: float = 180.0,
        ramp_s: float = 2.0,
        min_tokens: int | None = None,
    ) -> None:
        if users < 1 or max_attempts < 1:
            raise ValueError("at least one user and one attempt")
        self._session = session
        self._pool = pool
        self._prompts = prompts
        self._users = users
        self._model = model
        self._origin = origin
        self._max_attempts = max_attempts
        self._timeout = aiohttp.ClientTimeout(total=client_timeout_s)
        self._ramp_s = ramp_s
        self._min_tokens = min_tokens
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self.records: list[Record] = []
        self.in_flight = 0

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._user(i), name=f"user-{i}")
                       for i in range(self._users)]  # fmt: skip

    async def stop(self, timeout_s: float) -> int:
        """Stop issuing, let requests in flight end (at most `timeout_s`); how many had to be
        cancelled."""
        self._stopping = True
        return await finish_or_cancel(self._tasks, timeout_s)

    async def _user(self, index: int) -> None:
        rng = self._prompts.user_rng(index)
        await asyncio.sleep(self._ramp_s * index / self._users)
        while not self._stopping:
            prompt = self._prompts.next_prompt(rng)
            most = prompt.scenario.max_tokens
            # Streams of different lengths, so the users do not move in lockstep.
            tokens = most if self._min_tokens is None else rng.randint(self._min_tokens, most)
            body = orjson.dumps(
                {"model": self._model, "prompt": prompt.text, "max_tokens": tokens,
                 "temperature": 0, "stream": True}
            )  # fmt: skip
            self.in_flight += 1
            try:
                self.records.append(await self._request(index, body))
            finally:
                self.in_flight -= 1

    async def _request(self, user: int, body: bytes) -> Record:
        start = time.monotonic()
        attempt = 0
        while True:
            slot, url = self._pool.pick(user, attempt)
            out = await post_stream(
                self._session, url + "/v1/completions", body,
                client_timeout=self._timeout, start=start,
            )  # fmt: skip
            attempt += 1
            if out.status != 0 or attempt >= self._max_attempts:
                break
            await asyncio.sleep(0.05 * attempt)  # a gateway just went away: try the next
        return Record(
            user=user,
            issued_s=start - self._origin,
            ended_s=out.end - self._origin,
            gateway=slot,
            status=out.status,
            ttft_s=out.ttft_s,
            events=out.events,
            completed=out.completed,
            reconnects=attempt - 1,
        )
