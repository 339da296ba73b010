"""Streaming clients behind a load balancer that knows the gateways: what the upgrade and
chaos benchmarks' loads share.

`GatewayPool` is the load balancer's view (a Kubernetes Service's endpoints): one slot per
gateway, its current URL, and whether it is in rotation. Client *i* sends to the *i*-th
gateway in rotation (mod their number).

Retries follow one rule, the one a client of an OpenAI-compatible service can apply safely:
a request that got **no response start** (connection refused or reset before a status line,
status 0) may be sent again, to the next gateway in rotation; nothing was generated for it.
Anything else is final: a 4xx/5xx status is a failure, and so is a stream that started and
then broke (no ``data: [DONE]``, or an in-band error), since its tokens cannot be taken
back. TTFT counts from the first attempt, so reconnecting shows as a bump.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import aiohttp
import orjson

from pdgate.loadtest.lib.deployed import DeployedCluster, Deployment
from pdgate.loadtest.lib.log import Log

if TYPE_CHECKING:
    from pdgate.loadtest.scheduling.workload import Workload as Prompts

__all__ = ["FleetRun", "FleetShape", "GatewayPool", "PoolLoad", "sim_fleet"]

_Plan = TypeVar("_Plan")


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


class PoolLoad:
    """Streaming completions of the workload's prompts through a `GatewayPool`, each sent
    again while no response has started (at most `max_attempts` tries); `in_flight` is how
    many are open. Subclasses decide when requests start and what they keep."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        pool: GatewayPool,
        prompts: Prompts,
        model: str,
        *,
        origin: float,
        max_attempts: int,
        timeout: aiohttp.ClientTimeout,
        min_tokens: int | None,
    ) -> None:
        self._session = session
        self._pool = pool
        self._prompts = prompts
        self._model = model
        self._origin = origin
        self._max_attempts = max_attempts
        self._timeout = timeout
        self._min_tokens = min_tokens
        self._stopping = False
        self.in_flight = 0

    def _body(self, prompt: str, tokens: int) -> bytes:
        return orjson.dumps(
            {"model": self._model, "prompt": prompt, "max_tokens": tokens,
             "temperature": 0, "stream": True}
        )  # fmt: skip

    async def _send(self, index: int, attempt: Callable[[int, str], Awaitable[int]]) -> int:
        """``attempt(slot, completions URL)`` on client `index`'s gateway, then on the next
        ones while it returns status 0 (no response start); how many attempts were made."""
        tries = 0
        while True:
            slot, url = self._pool.pick(index, tries)
            status = await attempt(slot, url + "/v1/completions")
            tries += 1
            if status != 0 or tries >= self._max_attempts:
                return tries
            await asyncio.sleep(0.05 * tries)  # a gateway just went away: try the next


class FleetShape(Protocol):
    """The servers of a fleet deployed for a pool's load (the upgrade and chaos plans)."""

    @property
    def prefills(self) -> int: ...
    @property
    def decodes(self) -> int: ...
    @property
    def gateways(self) -> int: ...
    @property
    def sim_profile(self) -> str: ...
    @property
    def prefill_capacity(self) -> int: ...
    @property
    def decode_capacity(self) -> int: ...


def sim_fleet(shape: FleetShape, model: str, key_prefix: str, **shim: Any) -> Deployment:
    """`shape`'s sim shims (no prefix cache, KV transfers next to free, `shim`'s settings on
    top) and gateways on least_sse: a fleet whose faults, not its engines, the run is about."""
    common = {"model": model, "sim_profile": shape.sim_profile, "sim_prefix_cache_blocks": 0,
              "sim_kv_wire_fraction": 1 / 131072, **shim}  # fmt: skip
    return Deployment(
        prefills=shape.prefills,
        decodes=shape.decodes,
        gateways=shape.gateways,
        prefill_settings={**common, "capacity": shape.prefill_capacity},
        decode_settings={**common, "capacity": shape.decode_capacity},
        gateway_settings={"prefill_policy": "least_sse"},
        key_prefix=key_prefix,
    )


class FleetRun(Generic[_Plan]):
    """A run of `plan` on a deployed fleet behind a `GatewayPool`: its servers, client
    session and clock (seconds since `origin`), and where progress goes."""

    def __init__(
        self,
        plan: _Plan,
        cluster: DeployedCluster,
        session: aiohttp.ClientSession,
        pool: GatewayPool,
        origin: float,
        log: Log,
    ) -> None:
        self.plan = plan
        self.cluster = cluster
        self.session = session
        self.pool = pool
        self.origin = origin
        self.log = log

    def now(self) -> float:
        return time.monotonic() - self.origin
