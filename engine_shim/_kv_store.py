"""The prefill's computed KV waiting for a decode to fetch it.

Each entry holds the request's admission slot (P/D-Serve: "a prompt continuously occupies one
slot in prefill if it is waiting for KVCache transfer"). An entry leaves the store exactly
once: taken by the first GET (single consumer), dropped by DELETE, expired after the hold
timeout, or dropped when the gateway it is held for left the fleet. Whoever takes it must
`close()` it, which frees the KV and the slot. The store is bounded by the slots: there can
never be more entries than admitted requests.

`HoldTimes` records, per entry, how long the KV and its slot stayed held after the prefill
finished, by how the hold ended: a slot held long past its request's end is capacity lost
to every client, and the hold timeout hides such leaks instead of showing them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from pdgate.engine_shim._metrics import Histogram
from pdgate.engine_shim._slots import Slot
from pdgate.engine_shim.backend import KvSource

log = logging.getLogger("pdgate.shim.prefill")

# How a hold ends: taken by a completed GET, by a GET whose reader left midway, released
# by DELETE, dropped by the hold timeout, dropped because the gateway it was held for left
# the fleet (_gateway_watch.py), dropped at shutdown.
OUTCOMES = ("fetched", "lost", "released", "expired", "gateway_gone", "shutdown")
HOLD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LONG_HOLD_S = 5.0  # /load's kv_hold_over_5s


class HoldTimes:
    """Seconds from the end of each prefill until its KV and slot were let go."""

    def __init__(self) -> None:
        self.by_outcome = {outcome: Histogram(HOLD_BUCKETS) for outcome in OUTCOMES}
        self.max_s = 0.0  # since start
        self.long = 0  # cumulative: holds over LONG_HOLD_S

    def observe(self, seconds: float, outcome: str) -> None:
        self.by_outcome[outcome].observe(seconds)
        self.max_s = max(self.max_s, seconds)
        if seconds > LONG_HOLD_S:
            self.long += 1


class HeldKv:
    __slots__ = ("_closed", "_held_since", "_holds", "gateway", "kv", "request_id", "slot")

    def __init__(self, request_id: str, kv: KvSource, slot: Slot, gateway: str = "") -> None:
        """`gateway`: the fleet gateway the KV is held for ("": not said)."""
        self.request_id = request_id
        self.kv = kv
        self.slot = slot
        self.gateway = gateway
        self._closed = False
        self._held_since: float | None = None
        self._holds: HoldTimes | None = None

    def hold(self, holds: HoldTimes) -> None:
        """From now on the KV waits for a decode; `close` records for how long."""
        self._held_since = time.monotonic()
        self._holds = holds

    def close(self, outcome: str = "released") -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.kv.release()
        finally:
            self.slot.release()
        if self._holds is not None and self._held_since is not None:
            self._holds.observe(time.monotonic() - self._held_since, outcome)


class RecentAdmissions:
    """What this prefill did with the calls that ended lately (admitted or rejected), by
    their KV id: a gateway that cut a call off unanswered asks with the id's release, which
    may come after the call ended. Bounded by count (oldest first) and by age."""

    def __init__(
        self,
        max_ids: int = 4096,
        ttl_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._outcomes: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._max_ids = max_ids
        self._ttl_s = ttl_s
        self._clock = clock

    def __len__(self) -> int:
        return len(self._outcomes)

    def remember(self, kv_id: str, outcome: str) -> None:
        now = self._clock()
        self._outcomes[kv_id] = (outcome, now)
        self._outcomes.move_to_end(kv_id)
        self._forget_old(now)
        while len(self._outcomes) > self._max_ids:
            self._outcomes.popitem(last=False)

    def get(self, kv_id: str) -> str | None:
        self._forget_old(self._clock())
        item = self._outcomes.get(kv_id)
        return None if item is None else item[0]

    def _forget_old(self, now: float) -> None:
        # Oldest first: insertion order is time order (`remember` moves an id to the end).
        while self._outcomes:
            _, (_, since) = next(iter(self._outcomes.items()))
            if now - since < self._ttl_s:
                break
            self._outcomes.popitem(last=False)


class KvStore:
    def __init__(self, hold_timeout_s: float, max_tombstones: int = 4096) -> None:
        self._hold_timeout_s = hold_timeout_s
        self._entries: dict[str, tuple[HeldKv, asyncio.TimerHandle]] = {}
        # Ids released before their KV existed: a gateway that gave up on a prefill call may
        # DELETE the id it chose before this prefill finished computing it. Bounded (LRU).
        self._tombstones: OrderedDict[str, None] = OrderedDict()
        self._max_tombstones = max_tombstones
        self.expired = 0  # cumulative
        self.gateway_gone = 0  # cumulative: released because their gateway left the fleet
        self.dropped_on_arrival = 0  # cumulative: computed for a caller that already left
        self.holds = HoldTimes()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: HeldKv) -> bool:
        """Hold `entry` until taken; False (and freed at once) if its id was released already."""
        if entry.request_id in self._entries:
            # The prefill shim reserves ids at admission, so this is a bug; hold nothing.
            entry.close()
            raise KeyError(f"duplicate KV request id {entry.request_id}")
        if self._forget_tombstone(entry.request_id):
            self.dropped_on_arrival += 1
            entry.close()
            return False
        timer = asyncio.get_running_loop().call_later(
            self._hold_timeout_s, self._expire, entry.request_id
        )
        self._entries[entry.request_id] = (entry, timer)
        entry.hold(self.holds)
        return True

    def release_unknown(self, request_id: str) -> None:
        """DELETE of an id not (yet) held: remember it in case its KV is still being made,
        or its call is still to be admitted (`withdrawn`)."""
        self._tombstones[request_id] = None
        self._tombstones.move_to_end(request_id)
        while len(self._tombstones) > self._max_tombstones:
            self._tombstones.popitem(last=False)

    def released_early(self, request_id: str) -> bool:
        """Whether a DELETE came for `request_id` before its KV was held."""
        return request_id in self._tombstones

    def withdrawn(self, request_id: str) -> bool:
        """Whether `request_id` was released before its call was admitted or refused (its
        releaser heard "unseen"); forgets it: the call is refused once, uncounted."""
        return self._forget_tombstone(request_id)

    def _forget_tombstone(self, request_id: str) -> bool:
        """Whether a DELETE came for `request_id` before it was held; forgets it if so."""
        if request_id not in self._tombstones:
            return False
        del self._tombstones[request_id]
        return True

    def take(self, request_id: str) -> HeldKv | None:
        """Remove and return the entry; the caller owns (and must close) it."""
        item = self._entries.pop(request_id, None)
        if item is None:
            return None
        entry, timer = item
        timer.cancel()
        return entry

    def gateways(self) -> list[str]:
        """The gateways some KV is held for (those that said which they are)."""
        return sorted({e.gateway for e, _ in self._entries.values() if e.gateway})

    def release_for(self, gateway: str) -> int:
        """Let go of the KV held for `gateway` (it left the fleet: nobody will pull it);
        how many."""
        gone = [rid for rid, (e, _) in self._entries.items() if e.gateway == gateway]
        for request_id in gone:
            entry, timer = self._entries.pop(request_id)
            timer.cancel()
            entry.close("gateway_gone")
        self.gateway_gone += len(gone)
        return len(gone)

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
        item[0].close("expired")

    def close(self) -> None:
        """Drop everything (shutdown)."""
        for entry, timer in self._entries.values():
            timer.cancel()
            entry.close("shutdown")
        self._entries.clear()
