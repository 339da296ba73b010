"""An open loop: requests arrive at a set rate whether or not earlier ones were answered,
as real traffic does, next to the paper's closed loop (closed_loop.py).

Two arrival processes, both seeded (the same seed and level give the same arrival times):

* ``poisson``: exponential gaps at the level's rate.
* ``bursty``: an interrupted Poisson process (on/off). ON periods (exponential, mean
  `Arrivals.burst_on_s`) send at ``burst_factor`` x the rate; OFF periods (exponential,
  mean ``burst_on_s x (burst_factor - 1)``) send nothing. ON is then ``1 / burst_factor``
  of the time, so the mean rate is the level's rate and the peak is `burst_factor` times it.

The client never waits for an answer before the next arrival, so it bounds itself: at most
`max_in_flight` requests at once (one waiting to retry, with ``--client honour``, counts);
an arrival beyond that is not sent and counts as a failed request (status `DROPPED`), so a
collapsed server cannot make the client grow without bound and the sample stays "every
request that arrived in the window". If the client falls behind its schedule (CPU), late
arrivals are sent at once, so the mean rate holds.

Arrival i goes to gateway i mod N; with tenants, each arrival draws its tenant by weight.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from pdgate.loadtest.lib.stats import DROPPED, RequestResult
from pdgate.loadtest.scheduling._load import LoadGenerator, send_completion
from pdgate.loadtest.scheduling.clients import CLIENTS, send_honouring
from pdgate.loadtest.scheduling.workload import Prompt

__all__ = ["ARRIVALS", "Arrivals", "OpenLoop", "arrival_times"]

ARRIVALS = ("closed", "poisson", "bursty")


@dataclass(frozen=True, slots=True)
class Arrivals:
    """How a level's requests arrive. ``closed``: `ClosedLoop` users; otherwise an open
    loop at the level's rate (experiment.py derives it from the capacity)."""

    kind: str = "closed"
    burst_factor: float = 4.0  # bursty: peak rate / mean rate
    burst_on_s: float = 1.0  # bursty: mean length of an ON period
    # The open loop's in-flight bound: None = `in_flight_bound(users)` for the level's
    # equivalent closed-loop users.
    max_in_flight: int | None = None
    # What a refused request's client does (clients.py: instant, honour, openai); an open
    # loop has no users to give the openai client to.
    client: str = "instant"

    def __post_init__(self) -> None:
        if self.kind not in ARRIVALS:
            raise ValueError(f"unknown arrivals {self.kind!r}; known: {', '.join(ARRIVALS)}")
        if self.burst_factor <= 1 or self.burst_on_s <= 0:
            raise ValueError("burst factor must be > 1 and the ON period > 0")
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        if self.client not in CLIENTS:
            raise ValueError(f"unknown client {self.client!r}; known: {', '.join(CLIENTS)}")
        if self.client == "openai" and self.open:
            raise ValueError("the openai client needs a closed loop's users (--client)")

    @property
    def open(self) -> bool:
        return self.kind != "closed"

    def describe(self) -> str:
        retried = (
            "; a refused request is sent again after the Retry-After it is told (up to 2 times)"
            if self.client == "honour"
            else ""
        )
        if self.kind == "poisson":
            return "open loop, Poisson arrivals" + retried
        if self.kind == "bursty":
            return (
                f"open loop, bursty arrivals (on/off Poisson: {self.burst_factor:g}x the rate "
                f"during ON periods of mean {self.burst_on_s:g} s, silent otherwise)" + retried
            )
        if self.client == "honour":
            return "closed loop, users retry after the Retry-After they are told (up to 2 times)"
        if self.client == "openai":
            return "closed loop, users of the official openai client (its own retries)"
        return "closed loop"

    def in_flight_bound(self, users: float) -> int:
        """The open loop's bound for a level equivalent to `users` closed-loop users: 4x
        what those users would have in flight (one each), at least 16."""
        if self.max_in_flight is not None:
            return self.max_in_flight
        return max(16, math.ceil(4 * users))


def arrival_times(arrivals: Arrivals, rate: float, rng: random.Random) -> Iterator[float]:
    """Arrival instants, seconds from the start, of `arrivals` at mean `rate` per second."""
    if rate <= 0:
        raise ValueError("the arrival rate must be positive")
    t = 0.0
    if arrivals.kind == "poisson":
        while True:
            t += rng.expovariate(rate)
            yield t
    if arrivals.kind != "bursty":
        raise ValueError(f"{arrivals.kind} is not an open-loop arrival process")
    factor, on_s = arrivals.burst_factor, arrivals.burst_on_s
    off_s = on_s * (factor - 1)
    on = rng.random() < 1 / factor  # start in the stationary mix of ON and OFF
    end = t + rng.expovariate(1 / (on_s if on else off_s))
    while True:
        if on:
            nxt = t + rng.expovariate(rate * factor)
            if nxt < end:  # memoryless: a gap cut by the period's end is simply redrawn
                t = nxt
                yield t
                continue
        t, on = end, not on
        end = t + rng.expovariate(1 / (on_s if on else off_s))


@dataclass(eq=False)
class OpenLoop(LoadGenerator):
    arrivals: Arrivals
    rate: float
    max_in_flight: int = field(kw_only=True)
    stream: int = field(default=0, kw_only=True)  # distinct random streams per load level
    dropped: int = field(default=0, init=False)  # every arrival not sent, in the window or not
    _inflight: set[asyncio.Task[None]] = field(default_factory=set, init=False, repr=False)
    _arriving: asyncio.Task[None] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rate <= 0 or self.max_in_flight < 1:
            raise ValueError("the rate and the in-flight bound must be positive")

    def start(self) -> None:
        self._arriving = asyncio.create_task(self._arrive(), name="arrivals")
        self._tasks.add(self._arriving)

    def _halt(self) -> None:
        if self._arriving is not None:
            self._arriving.cancel()

    async def _arrive(self) -> None:
        rng = self.workload.user_rng(self.stream)  # the prompts (and tenants)
        seed = f"{self.workload.seed}/arrivals/{self.stream}"
        times = arrival_times(self.arrivals, self.rate, random.Random(seed))
        began = time.monotonic()
        for i, at in enumerate(times):
            await asyncio.sleep(max(0.0, began + at - time.monotonic()))
            if self._stopping:
                return
            self._issue(i % len(self.completions_urls), self.workload.next_prompt(rng))

    def _issue(self, gateway: int, prompt: Prompt) -> None:
        issued = time.monotonic()
        self.issued += 1
        if len(self._inflight) >= self.max_in_flight:
            self.dropped += 1
            self._record(issued, _dropped(prompt, gateway))
            return
        task = asyncio.create_task(self._send(gateway, prompt, issued))
        self._inflight.add(task)
        self._tasks.add(task)
        task.add_done_callback(self._inflight.discard)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, gateway: int, prompt: Prompt, issued: float) -> None:
        url = self.completions_urls[gateway]
        send = send_honouring if self.arrivals.client == "honour" else send_completion
        result = await send(self.session, url, self.model, prompt, gateway=gateway)
        self._record(issued, result)


def _dropped(prompt: Prompt, gateway: int) -> RequestResult:
    return RequestResult(
        scenario=prompt.scenario.name,
        deadline_s=prompt.scenario.ttft_deadline_s,
        status=DROPPED,
        ttft_s=None,
        e2e_s=0.0,
        completed=False,
        gateway=gateway,
        tenant="" if prompt.tenant is None else prompt.tenant.name,
    )
