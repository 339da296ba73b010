"""What this gateway knows about each instance: its open streams, in-flight requests and
recent rejections, combined with registry membership into policy snapshots.

Counts are changed only through `Lease`s, released exactly once whatever path a request
takes; a lease holds its counter object, not an id, so an instance that leaves and rejoins
under the same id starts from zero and old leases cannot drive it negative.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from config import Role
from policies.base import InstanceLoad
from registry.base import InstanceRecord, InstanceState


@dataclass(slots=True)
class _Counters:
    open_streams: int = 0
    inflight: int = 0
    busy_until: float = 0.0  # monotonic; a 429 makes the instance "busy" until then
    accepted: int = 0
    rejected: int = 0
    failed: int = 0


class Lease:
    """One unit of `open_streams` or `inflight` on one instance; `release()` is idempotent."""

    __slots__ = ("_counters", "_kind", "_on_release", "_released", "instance_id")

    def __init__(
        self, instance_id: str, counters: _Counters, kind: str, on_release: Callable[[], None]
    ) -> None:
        self.instance_id = instance_id
        self._counters = counters
        self._kind = kind
        self._on_release = on_release
        self._released = False
        setattr(counters, kind, getattr(counters, kind) + 1)

    @property
    def released(self) -> bool:
        return self._released

    def release(self, *, slot_freed: bool = True) -> None:
        """Give the count back. ``slot_freed=False`` for a request the instance never took
        (rejected, unreachable): its end says nothing about free capacity, and treating it
        as a freed slot would send the next request straight into another 429."""
        if self._released:
            return
        self._released = True
        setattr(self._counters, self._kind, getattr(self._counters, self._kind) - 1)
        if slot_freed:
            # A finished request is the best sign the instance has a free slot again.
            self._counters.busy_until = 0.0
            self._on_release()


@dataclass
class InstanceTracker:
    """Per-instance state, bounded by membership: departed instances are dropped."""

    busy_hold_s: float = 0.5
    _counters: dict[str, _Counters] = field(default_factory=dict)
    _records: Mapping[str, InstanceRecord] = field(default_factory=dict)
    _freed: asyncio.Event = field(default_factory=asyncio.Event)

    def update_membership(
        self, records: Mapping[str, InstanceRecord], departed: set[str] | None = None
    ) -> None:
        """Membership listener: the registry view changed."""
        self._records = dict(records)
        for gone in [i for i in self._counters if i not in self._records]:
            del self._counters[gone]
        self._pulse()  # a new instance is new capacity

    def _for(self, instance_id: str) -> _Counters:
        c = self._counters.get(instance_id)
        if c is None:
            if instance_id not in self._records:
                # Leases on an instance that just left still need an object to count on.
                return _Counters()
            c = self._counters[instance_id] = _Counters()
        return c

    def records(self) -> Mapping[str, InstanceRecord]:
        return self._records

    def loads(self, role: Role, model: str | None, group: str | None = None) -> list[InstanceLoad]:
        """Policy snapshot of ready instances of `role` serving `model` in `group` (None: any)."""
        now = time.monotonic()
        out: list[InstanceLoad] = []
        for rec in self._records.values():
            if rec.role != role or rec.state != InstanceState.READY:
                continue
            if (model is not None and rec.model != model) or (
                group is not None and rec.group != group
            ):
                continue
            c = self._for(rec.id)
            out.append(
                InstanceLoad(
                    id=rec.id,
                    url=rec.url,
                    group=rec.group,
                    capacity=rec.capacity,
                    open_streams=c.open_streams,
                    inflight=c.inflight,
                    busy=c.busy_until > now,
                )
            )
        return out

    def has_room(self, instance_id: str, capacity: int) -> bool:
        """Worth a try: not recently rejected and fewer of our requests than its slots.

        Our own count is a lower bound of its load (other gateways share it); a 429 corrects it.
        """
        c = self._counters.get(instance_id)
        if c is None:
            return instance_id in self._records
        return c.busy_until <= time.monotonic() and c.inflight < capacity

    def groups(self, model: str) -> set[str]:
        return {r.group for r in self._records.values() if r.model == model}

    def models(self) -> list[str]:
        return sorted({r.model for r in self._records.values() if r.state == InstanceState.READY})

    def open_stream(self, instance_id: str) -> Lease:
        return Lease(instance_id, self._for(instance_id), "open_streams", self._pulse)

    def begin(self, instance_id: str) -> Lease:
        c = self._for(instance_id)
        c.accepted += 1
        return Lease(instance_id, c, "inflight", self._pulse)

    def rejected(self, instance_id: str) -> None:
        c = self._for(instance_id)
        c.rejected += 1
        c.busy_until = time.monotonic() + self.busy_hold_s

    def failed(self, instance_id: str) -> None:
        c = self._for(instance_id)
        c.failed += 1
        c.busy_until = time.monotonic() + self.busy_hold_s

    def _pulse(self) -> None:
        # Wake everyone waiting now; later waiters wait for the next release.
        freed, self._freed = self._freed, asyncio.Event()
        freed.set()

    async def wait_freed(self, max_wait_s: float) -> None:
        """Sleep until some in-flight request ends (a slot likely freed), at most `max_wait_s`."""
        if max_wait_s <= 0:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._freed.wait(), max_wait_s)

    def totals(self) -> tuple[int, int]:
        """(open streams, in flight) over all instances; both 0 when nothing leaked."""
        return (
            sum(c.open_streams for c in self._counters.values()),
            sum(c.inflight for c in self._counters.values()),
        )

    def describe(self) -> Iterator[dict[str, object]]:
        """Rows for ``GET /admin/instances``."""
        now = time.monotonic()
        for rec in sorted(self._records.values(), key=lambda r: (r.role, r.id)):
            c = self._for(rec.id)
            yield {
                "id": rec.id,
                "role": rec.role.value,
                "url": rec.url,
                "model": rec.model,
                "group": rec.group,
                "state": rec.state.value,
                "capacity": rec.capacity,
                "open_streams": c.open_streams,
                "inflight": c.inflight,
                "busy": c.busy_until > now,
                "accepted": c.accepted,
                "rejected": c.rejected,
                "failed": c.failed,
                "version": rec.version,
                "started_at": rec.started_at,
            }
