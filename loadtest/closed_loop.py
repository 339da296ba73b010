"""A closed loop of simulated users: each user sends a request, waits for its end (success or
failure) and at once sends the next, as in P/D-Serve's evaluation ("maintaining the constant
requests, one completed triggers new one added"). The load is the number of users.

The caller opens and closes a measurement window; requests *issued* inside it are the
sample, each followed to its end even after the window closed, so slow and failed requests
are counted as fully as fast ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence

import aiohttp

from loadtest.client import send_completion
from loadtest.stats import RequestResult
from loadtest.workload import Workload

__all__ = ["ClosedLoop"]


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
        _, pending = await asyncio.wait(self._tasks, timeout=timeout_s)
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
        urls = self._urls
        sent = index  # round-robin over the gateways, like the load balancer in front of them
        # Spread the first requests so the run does not start with one synchronised burst.
        await asyncio.sleep(self._ramp_s * index / self._users)
        while not self._stopping:
            prompt = self._workload.next_prompt(rng)
            issued = time.monotonic()
            self.issued += 1
            url = urls[sent % len(urls)]
            sent += 1
            result = await send_completion(self._session, url, self._model, prompt)
            if self._in_window(issued):
                self.results.append(result)
