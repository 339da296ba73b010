"""A closed loop of simulated users: each user sends a request, waits for its end (success or
failure) and at once sends the next, as in P/D-Serve's evaluation ("maintaining the constant
requests, one completed triggers new one added"). The load is the number of users.

The caller opens and closes a measurement window (_load.py). With several gateways, user i
sends to gateway i mod N (a load balancer pinning clients), so each gateway's success can be
told apart. With tenants, user i sends for tenant ``workload.tenant_for(i // N)`` throughout,
so every gateway gets the same tenant mix.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import aiohttp

from pdgate.loadtest.scheduling._load import LoadGenerator, send_completion
from pdgate.loadtest.scheduling.workload import Workload

__all__ = ["ClosedLoop", "send_completion"]


class ClosedLoop(LoadGenerator):
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
        if users <= 0:
            raise ValueError("users must not be empty")
        super().__init__(session, completions_urls, model, workload)
        self._users = users
        self._offset = user_offset  # distinct random streams for each load level
        self._ramp_s = ramp_s

    def start(self) -> None:
        self._tasks = {
            asyncio.create_task(self._user(i), name=f"user-{i}") for i in range(self._users)
        }

    async def _user(self, index: int) -> None:
        rng = self._workload.user_rng(self._offset + index)
        gateway = index % len(self._urls)
        url = self._urls[gateway]
        tenant = self._workload.tenant_for(index // len(self._urls))
        # Spread the first requests so the run does not start with one synchronised burst.
        await asyncio.sleep(self._ramp_s * index / self._users)
        while not self._stopping:
            prompt = self._workload.next_prompt(rng, tenant)
            issued = time.monotonic()
            self.issued += 1
            result = await send_completion(self._session, url, self._model, prompt, gateway=gateway)
            if self._in_window(issued):
                self.results.append(result)
