"""A closed loop of simulated users: each user sends a request, waits for its end (success or
failure) and at once sends the next, as in P/D-Serve's evaluation ("maintaining the constant
requests, one completed triggers new one added"). The load is the number of users.

The caller opens and closes a measurement window; requests *issued* inside it are the
sample, each followed to its end even after the window closed, so slow and failed requests
are counted as fully as fast ones. With several gateways, user i sends to gateway i mod N
(a load balancer pinning clients), so each gateway's success can be told apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence

import aiohttp
import orjson

from pdgate.loadtest.lib.sse import TTFT_HEADER, post_stream
from pdgate.loadtest.lib.stats import RequestResult
from pdgate.loadtest.scheduling.workload import Prompt, Workload

__all__ = ["ClosedLoop", "send_completion"]


async def send_completion(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    prompt: Prompt,
    *,
    gateway: int = 0,
    slack_s: float = 30.0,
) -> RequestResult:
    """POST one streaming request to `url` (…/v1/completions) and time it.

    The request asks the gateway for the scenario's TTFT deadline; the client itself only
    gives up `slack_s` after it, so every failure is the server's verdict, not a client
    timeout.
    """
    scenario = prompt.scenario
    body = orjson.dumps(
        {
            "model": model,
            "prompt": prompt.text,
            "max_tokens": scenario.max_tokens,
            "temperature": 0,
            "stream": True,
        }
    )
    start = time.monotonic()
    out = await post_stream(
        session,
        url,
        body,
        headers={TTFT_HEADER: str(round(scenario.ttft_deadline_s * 1000))},
        client_timeout=aiohttp.ClientTimeout(total=scenario.ttft_deadline_s + slack_s),
    )
    return RequestResult(
        scenario=scenario.name,
        deadline_s=scenario.ttft_deadline_s,
        status=out.status,
        ttft_s=out.ttft_s,
        e2e_s=out.end - start,
        completed=out.completed,
        gateway=gateway,
    )


class ClosedLoop:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        completions_urls: Sequence[str],
        model: str,
        workload: Workload,
        users: int,
        *,
        user_offset: int = 0,
        ramp_s: float = 0.5,
    ) -> None:
        if users <= 0 or not completions_urls:
            raise ValueError("users and gateway URLs must not be empty")
        self._session = session
        self._urls = list(completions_urls)
        self._model = model
        self._workload = workload
        self._users = users
        self._offset = user_offset  # distinct random streams for each load level
        self._ramp_s = ramp_s
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._window: tuple[float, float] | None = None
        self.results: list[RequestResult] = []
        self.issued = 0  # every request sent, in the window or not

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._user(i), name=f"user-{i}") for i in range(self._users)
        ]

    def open_window(self) -> None:
        self._window = (time.monotonic(), float("inf"))

    def close_window(self) -> float:
        """Stop sampling new requests; returns the window's length in seconds."""
        if self._window is None:
            raise RuntimeError("the window was never opened")
        start = self._window[0]
        self._window = (start, time.monotonic())
        return self._window[1] - start

    async def stop(self, timeout_s: float) -> int:
        """Stop issuing; wait up to `timeout_s` for requests in flight to end. Returns how
        many were still running and had to be cancelled (0 unless something hung)."""
        self._stopping = True
        if not self._tasks:
            return 0
        if timeout_s > 0:
            _, pending = await asyncio.wait(self._tasks, timeout=timeout_s)
        else:  # stop at once (a failed point): cancel whatever still runs
            pending = {t for t in self._tasks if not t.done()}
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return len(pending)

    def _in_window(self, t: float) -> bool:
        return self._window is not None and self._window[0] <= t < self._window[1]

    async def _user(self, index: int) -> None:
        rng = self._workload.user_rng(self._offset + index)
        gateway = index % len(self._urls)
        url = self._urls[gateway]
        # Spread the first requests so the run does not start with one synchronised burst.
        await asyncio.sleep(self._ramp_s * index / self._users)
        while not self._stopping:
            prompt = self._workload.next_prompt(rng)
            issued = time.monotonic()
            self.issued += 1
            result = await send_completion(self._session, url, self._model, prompt, gateway=gateway)
            if self._in_window(issued):
                self.results.append(result)
