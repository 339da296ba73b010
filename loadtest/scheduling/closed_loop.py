"""A closed loop of simulated users: each user sends a request, waits for its end (success or
failure) and at once sends the next, as in P/D-Serve's evaluation ("maintaining the constant
requests, one completed triggers new one added"). The load is the number of users.

What a refused user does is its `client` (clients.py): sends its next request at once
(``instant``), waits the Retry-After and tries the same request again (``honour``), or
leaves it to the official openai client's own retry policy (``openai``).

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
from pdgate.loadtest.scheduling.clients import CLIENTS, OpenAIUser, send_honouring

__all__ = ["ClosedLoop", "send_completion"]


@dataclass(eq=False)
class ClosedLoop(LoadGenerator):
    users: int
    user_offset: int = field(default=0, kw_only=True)  # distinct random streams per load level
    ramp_s: float = field(default=0.5, kw_only=True)
    client: str = field(default="instant", kw_only=True)  # clients.CLIENTS

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.users <= 0:
            raise ValueError("users must not be empty")
        if self.client not in CLIENTS:
            raise ValueError(f"unknown client {self.client!r}; known: {', '.join(CLIENTS)}")

    def start(self) -> None:
        self._tasks = {
            asyncio.create_task(self._user(i), name=f"user-{i}") for i in range(self.users)
        }

    async def _user(self, index: int) -> None:
        rng = self.workload.user_rng(self.user_offset + index)
        gateway = index % len(self.completions_urls)
        url = self.completions_urls[gateway]
        tenant = self.workload.tenant_for(index // len(self.completions_urls))
        official = OpenAIUser(url, self.model) if self.client == "openai" else None
        try:
            # Spread the first requests so the run does not start with one synchronised burst.
            await asyncio.sleep(self.ramp_s * index / self.users)
            while not self._stopping:
                prompt = self.workload.next_prompt(rng, tenant)
                issued = time.monotonic()
                self.issued += 1
                if official is not None and prompt.api != "messages":
                    result = await official.send(prompt, gateway=gateway)
                elif self.client != "instant":
                    result = await send_honouring(
                        self.session, url, self.model, prompt, gateway=gateway
                    )
                else:
                    result = await send_completion(
                        self.session, url, self.model, prompt, gateway=gateway
                    )
                self._record(issued, result)
        finally:
            if official is not None:
                await official.aclose()
