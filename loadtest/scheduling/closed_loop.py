"""A closed loop of simulated users: each user sends a request, waits for its end (success or
failure) and at once sends the next, as in P/D-Serve's evaluation ("maintaining the constant
requests, one completed triggers new one added"). The load is the number of users.

With `retry_after`, a user whose request was refused with a ``Retry-After`` waits that long
(at most `RETRY_AFTER_MAX_S`) before its next request, as the official openai client does
before it retries; otherwise it sends the next one at once.

The caller opens and closes a measurement window (_load.py). With several gateways, user i
sends to gateway i mod N (a load balancer pinning clients), so each gateway's success can be
told apart. With tenants, user i sends for tenant ``workload.tenant_for(i // N)`` throughout,
so every gateway gets the same tenant mix.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from pdgate.loadtest.scheduling._load import LoadGenerator, send_completion

__all__ = ["RETRY_AFTER_MAX_S", "ClosedLoop", "send_completion"]

# The openai client honours a Retry-After of up to a minute.
RETRY_AFTER_MAX_S = 60.0


@dataclass(eq=False)
class ClosedLoop(LoadGenerator):
    users: int
    user_offset: int = field(default=0, kw_only=True)  # distinct random streams per load level
    ramp_s: float = field(default=0.5, kw_only=True)
    retry_after: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.users <= 0:
            raise ValueError("users must not be empty")

    def start(self) -> None:
        self._tasks = {
            asyncio.create_task(self._user(i), name=f"user-{i}") for i in range(self.users)
        }

    async def _user(self, index: int) -> None:
        rng = self.workload.user_rng(self.user_offset + index)
        gateway = index % len(self.completions_urls)
        url = self.completions_urls[gateway]
        tenant = self.workload.tenant_for(index // len(self.completions_urls))
        # Spread the first requests so the run does not start with one synchronised burst.
        await asyncio.sleep(self.ramp_s * index / self.users)
        while not self._stopping:
            prompt = self.workload.next_prompt(rng, tenant)
            issued = time.monotonic()
            self.issued += 1
            result = await send_completion(self.session, url, self.model, prompt, gateway=gateway)
            if self._in_window(issued):
                self.results.append(result)
            if self.retry_after and result.retry_after_s is not None:
                await asyncio.sleep(min(result.retry_after_s, RETRY_AFTER_MAX_S))
