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
    def __init__(self, hold_timeout_s: float) -> None:
        self._hold_timeout_s = hold_timeout_s
        self._entries: dict[str, tuple[HeldKv, asyncio.TimerHandle]] = {}
        self.expired = 0  # cumulative

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: HeldKv) -> None:
        if entry.request_id in self._entries:
            raise KeyError(f"duplicate KV request id {entry.request_id}")
        timer = asyncio.get_running_loop().call_later(
            self._hold_timeout_s, self._expire, entry.request_id
        )
        self._entries[entry.request_id] = (entry, timer)

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
