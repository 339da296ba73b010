"""The prefill's computed KV waiting for a decode to fetch it.

Each entry holds the request's admission slot (P/D-Serve: "a prompt continuously occupies one
slot in prefill if it is waiting for KVCache transfer"). An entry leaves the store exactly
once: taken by the first GET (single consumer), dropped by DELETE, or expired after the hold
timeout. Whoever takes it must `close()` it, which frees the KV and the slot. The store is
bounded by the slots: there can never be more entries than admitted requests.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

from engine_shim._slots import Slot
from engine_shim.backend import KvSource

log = logging.getLogger("pdgate.shim.prefill")


class HeldKv:
    __slots__ = ("_closed", "kv", "request_id", "slot")

    def __init__(self, request_id: str, kv: KvSource, slot: Slot) -> None:
        self.request_id = request_id
        self.kv = kv
        self.slot = slot
        self._closed = False

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.kv.release()
            self.slot.release()


class KvStore:
    def __init__(self, hold_timeout_s: float, max_tombstones: int = 4096) -> None:
        self._hold_timeout_s = hold_timeout_s
        self._entries: dict[str, tuple[HeldKv, asyncio.TimerHandle]] = {}
        # Ids released before their KV existed: a gateway that gave up on a prefill call may
        # DELETE the id it chose before this prefill finished computing it. Bounded (LRU).
        self._tombstones: OrderedDict[str, None] = OrderedDict()
        self._max_tombstones = max_tombstones
        self.expired = 0  # cumulative
        self.dropped_on_arrival = 0  # cumulative: computed for a caller that already left

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: HeldKv) -> bool:
        """Hold `entry` until taken; False (and freed at once) if its id was released already."""
        if entry.request_id in self._entries:
            raise KeyError(f"duplicate KV request id {entry.request_id}")
        if self._tombstones.pop(entry.request_id, 0) is None:
            self.dropped_on_arrival += 1
            entry.close()
            return False
        timer = asyncio.get_running_loop().call_later(
            self._hold_timeout_s, self._expire, entry.request_id
        )
        self._entries[entry.request_id] = (entry, timer)
        return True

    def release_unknown(self, request_id: str) -> None:
        """DELETE of an id not (yet) held: remember it in case its KV is still being made."""
        self._tombstones[request_id] = None
        self._tombstones.move_to_end(request_id)
        while len(self._tombstones) > self._max_tombstones:
            self._tombstones.popitem(last=False)

    def take(self, request_id: str) -> HeldKv | None:
        """Remove and return the entry; the caller owns (and must close) it."""
        item = self._entries.pop(request_id, None)
        if item is None:
            return None
        entry, timer = item
        timer.cancel()
        return entry

    def _expire(self, request_id: str) -> None:
        item = self._entries.pop(request_id, None)
        if item is None:
            return
        self.expired += 1
        log.warning(
            "KV of request %s not fetched within %.1f s; dropped and slot freed",
            request_id,
            self._hold_timeout_s,
        )
        item[0].close()

    def close(self) -> None:
        """Drop everything (shutdown)."""
        for entry, timer in self._entries.values():
            timer.cancel()
            entry.close()
        self._entries.clear()
