"""The clients of the rolling-upgrade benchmark: closed-loop users with long streams behind a
load balancer that knows the gateways (`GatewayPool`; its retry rule: loadtest/lib/pool.py).
User *i* sends to the *i*-th gateway in rotation (mod their number).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp

from pdgate.config.aio import finish_or_cancel
from pdgate.loadtest.lib.pool import GatewayPool, PoolLoad
from pdgate.loadtest.lib.sse import StreamOutcome, post_stream
from pdgate.loadtest.scheduling.workload import Workload as Prompts

__all__ = ["Record", "StreamingLoad"]


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


class StreamingLoad(PoolLoad):
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
        timeout = aiohttp.ClientTimeout(total=client_timeout_s)
        super().__init__(
            session, pool, prompts, model, origin=origin, max_attempts=max_attempts,
            timeout=timeout, min_tokens=min_tokens,
        )  # fmt: skip
        self._users = users
        self._ramp_s = ramp_s
        self._tasks: list[asyncio.Task[None]] = []
        self.records: list[Record] = []

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
            body = self._body(prompt.text, tokens)
            self.in_flight += 1
            try:
                self.records.append(await self._request(index, body))
            finally:
                self.in_flight -= 1

    async def _request(self, user: int, body: bytes) -> Record:
        start = time.monotonic()
        last: list[tuple[int, StreamOutcome]] = []

        async def attempt(slot: int, url: str) -> int:
            out = await post_stream(
                self._session, url, body, client_timeout=self._timeout, start=start
            )
            last[:] = [(slot, out)]
            return out.status

        tries = await self._send(user, attempt)
        slot, out = last[0]
        return Record(
            user=user,
            issued_s=start - self._origin,
            ended_s=out.end - self._origin,
            gateway=slot,
            status=out.status,
            ttft_s=out.ttft_s,
            events=out.events,
            completed=out.completed,
            reconnects=tries - 1,
        )
