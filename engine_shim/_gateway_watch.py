"""A prefill lets go of the KV it holds for a gateway that left the fleet.

A gateway of a shared fleet names itself on each prefill call (``x-pdgate-gateway``). Its
slot leases in the fleet's Redis expire a few seconds after it dies (kill -9); the KV it
was given stays held here until the hold timeout (tens of seconds), nobody will pull it, and
meanwhile the fleet sees the slot free and sends calls this prefill must refuse with 429.
So, every `interval_s` while KV is held for named gateways, the prefill asks the fleet
which of them are live, and releases what it holds for one found gone on two checks in a
row (one miss may be a gateway's late renewal). With Redis unreachable it decides nothing:
the hold timeout still bounds every hold.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Protocol

from pdgate.config.aio import cancel_and_wait
from pdgate.engine_shim._kv_store import KvStore
from pdgate.registry.base import RegistryUnavailable

__all__ = ["GatewayWatch", "Liveness", "StaticLiveness"]

log = logging.getLogger("pdgate.shim.prefill")


class Liveness(Protocol):
    """Which gateways are live members of the fleet (registry/fleet.py `FleetMembers`)."""

    async def live(self, gateway_ids: Sequence[str]) -> set[str]: ...

    async def aclose(self) -> None: ...


class StaticLiveness:
    """In memory: the gateways in `live` are live (tests, and a shim without Redis)."""

    def __init__(self, live: set[str] | None = None) -> None:
        self.gateways = set(live or ())

    async def live(self, gateway_ids: Sequence[str]) -> set[str]:
        return self.gateways.intersection(gateway_ids)

    async def aclose(self) -> None:
        return None


class GatewayWatch:
    def __init__(self, store: KvStore, liveness: Liveness, *, interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self._store = store
        self._liveness = liveness
        self._interval_s = interval_s
        self._missed: set[str] = set()  # gone at the last check: released if gone again
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="kv-gateway-watch")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None
        await self._liveness.aclose()

    async def check(self) -> int:
        """One check; how many KV holds were let go."""
        held = self._store.gateways()
        if not held:
            self._missed.clear()
            return 0
        try:
            live = await self._liveness.live(held)
        except RegistryUnavailable as exc:
            log.debug("fleet liveness unknown (%s): holding on", exc)
            return 0
        gone = set(held) - live
        released = 0
        for gateway in sorted(gone & self._missed):
            n = self._store.release_for(gateway)
            released += n
            log.warning("gateway %s left the fleet: released the %d KV held for it", gateway, n)
        self._missed = gone - self._missed
        return released

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.check()
            except Exception:
                log.exception("checking the fleet's gateways failed")
