"""The gateway's side of fleet-shared load (registry/fleet.py): slot leases, sync, wake-ups.

`Fleet` wraps a `FleetStore`. Forwarders ask it for prefill slot leases before each call
(`acquire`, which with the `idle` rule also checks that the prefill computes nothing for
any gateway). A lease counts as computing until the prefill answers (`SlotLease.computed`)
and is given back with the request's in-flight count (`SlotLease.release`); both are
coalesced: all of one event-loop iteration go to Redis in one call each. Three background
tasks keep the rest up to date: a sync every `sync_interval_s` (this gateway's counts,
queue heads and new prefill-time samples out; the fleet's sums and the other gateways'
samples in), lease renewal (every third of the lease TTL), and a subscription that wakes
the forwarders whenever another gateway frees a slot or a prefill stops computing.

When Redis cannot be reached the fleet degrades to this gateway's own view (it keeps
serving: leases are then counted locally, against each instance's whole capacity) and
recovers by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pdgate.config.aio import ExponentialBackoff, cancel_and_wait
from pdgate.gateway.instances.tracker import InstanceTracker
from pdgate.policies.base import InstanceLoad
from pdgate.registry.base import RegistryUnavailable
from pdgate.registry.fleet import Candidate, FleetStore, Freed, HeldLeases, LocalFleet

__all__ = ["Fleet", "FleetEstimates", "SlotLease", "Slots"]

log = logging.getLogger("pdgate.fleet")

_OPS = ("acquire", "computed", "release", "sync", "renew")


class SlotLease:
    """One prefill slot held fleet-wide, counted as computing until `computed()` (the
    prefill answered) and held until `release()`; both idempotent."""

    __slots__ = ("_computing", "_fleet", "_released", "instance_id", "lease_id", "local")

    def __init__(self, fleet: Fleet, instance_id: str, lease_id: str, *, local: bool) -> None:
        self._fleet = fleet
        self.instance_id = instance_id
        self.lease_id = lease_id
        # Counted by this gateway alone (degraded, or alone in the fleet): Redis
        # has not heard of it until a sync with other gateways hands it over.
        self.local = local
        self._released = False
        self._computing = True

    def computed(self) -> None:
        if self._computing and not self._released:
            self._computing = False
            self._fleet._computed(self)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._computing = False  # the release takes it out of the computing set too
            self._fleet._give_back(self)


class FleetEstimates(Protocol):
    """Where the prefill-time samples the fleet shares come from and go to (the dispatcher's
    forwarders, by queue): each gateway sends its new samples with its sync and merges the
    other gateways', so every gateway's early drop and batch sizing learn from every call
    the fleet makes, not from a 1/N share of them."""

    def outgoing(self) -> dict[str, str]:
        """Queue -> this gateway's samples since the last call, packed (none: left out)."""
        ...

    def incoming(self, queue: str, packed: Sequence[str], *, fresh: bool = True) -> None:
        """The other gateways' samples for `queue`, as they packed them; `fresh`: sent since
        this gateway's last sync (not the history its first sync reads)."""
        ...


@dataclass(frozen=True, slots=True)
class Slots:
    """An acquire's answer: leases on `instance`, or none (`yielded`: a more urgent request
    elsewhere in the fleet has the first try at a slot that just freed)."""

    instance: InstanceLoad | None
    leases: tuple[SlotLease, ...] = ()
    yielded: bool = False
    # When (monotonic) the most urgent request queued at another gateway is due (None: no
    # other gateway waits): a batch takes only requests due before it, so the fleet's
    # deadline order holds within batches too.
    others_due: float | None = None


class Fleet:
    def __init__(
        self,
        store: FleetStore,
        tracker: InstanceTracker,
        *,
        sync_interval_s: float = 0.1,
        ttl_s: float = 2.0,
        window_s: float = 0.02,
        heads: Callable[[], dict[str, float | None]] = dict,
        estimates: FleetEstimates | None = None,
    ) -> None:
        self.store = store
        self._tracker = tracker
        self._sync_interval_s = sync_interval_s
        self._ttl_s = ttl_s
        self.window_s = window_s
        self._heads = heads
        self._estimates = estimates
        # The first sync reads the samples stream from its start: history, not news.
        self._caught_up = False
        self._live: dict[str, dict[str, SlotLease]] = {}  # instance -> lease id -> lease
        self._to_release: list[SlotLease] = []
        self._to_mark: list[SlotLease] = []  # answered: no longer computing
        self._flush_scheduled = False
        # Freed-slot messages still to come back to us for our own releases (Redis publishes
        # one per instance per release call, to every gateway, us included): instance ->
        # count. Bounded by the instances; cleared by every sync, which recounts.
        self._own_freed: dict[str, int] = {}
        # Without Redis the store is the local count (with --workers, the node's shared slot
        # table); with Redis, this is the degraded mode's own counting.
        self._local = store if isinstance(store, LocalFleet) else LocalFleet(store.gateway_id)
        self._local_seq = itertools.count()
        self._degraded = False
        self._tasks: list[asyncio.Task[None]] = []
        self._flushes: set[asyncio.Task[None]] = set()
        self.gateways = 1  # live gateways in the fleet, as last synced
        # Calls to the shared store by operation, and their seconds (pdgate_fleet_calls_*):
        # what the fleet costs in Redis round trips, per request and over time.
        self.calls: dict[str, int] = dict.fromkeys(_OPS, 0)
        self.call_seconds: dict[str, float] = dict.fromkeys(_OPS, 0.0)

    def _count(self, op: str, started: float) -> None:
        self.calls[op] += 1
        self.call_seconds[op] += time.perf_counter() - started

    @property
    def shared(self) -> bool:
        return self.store.shared

    @property
    def degraded(self) -> bool:
        return self._degraded

    @property
    def gateway_id(self) -> str:
        return self.store.gateway_id

    def serve_queues(
        self,
        heads: Callable[[], dict[str, float | None]],
        estimates: FleetEstimates | None = None,
    ) -> None:
        """What the gateway's queues share with the fleet at each sync: their heads (the
        deadline order) and their prefill-time samples."""
        self._heads = heads
        self._estimates = estimates

    async def start(self) -> None:
        if self.store.shared:
            self._tasks = [
                asyncio.create_task(self._sync_loop(), name="fleet:sync"),
                asyncio.create_task(self._renew_loop(), name="fleet:renew"),
                asyncio.create_task(self._freed_loop(), name="fleet:freed"),
            ]
        elif isinstance(self.store, LocalFleet) and self.store.shares_slots:
            # Workers without Redis: another worker's freed slot wakes our forwarders.
            self._tasks = [asyncio.create_task(self._freed_loop(), name="fleet:freed")]

    async def aclose(self) -> None:
        tasks, self._tasks = self._tasks, []
        await cancel_and_wait(tasks)
        await self._flush()
        if self._flushes:
            await asyncio.wait(set(self._flushes), timeout=2.0)
        await self.store.aclose()

    # -- leases ----------------------------------------------------------------------------

    async def acquire(
        self,
        queue: str,
        ranked: Sequence[InstanceLoad],
        want: int,
        *,
        head_in_ms: float | None,
        next_head_in_ms: float | None,
        idle: bool = False,
    ) -> Slots:
        """Up to `want` slots on the first of `ranked` with room, fleet-wide (`idle`: and
        computing nothing for any gateway, checked in the same atomic step)."""
        if not ranked or want <= 0:
            return Slots(None)
        candidates = [Candidate(c.id, c.capacity) for c in ranked]
        local = self._degraded or not self.store.shared or self.gateways <= 1
        try:
            if local:
                grant = await self._local.acquire(
                    queue, candidates, want, head_in_ms=None, next_head_in_ms=None
                )
            else:
                started = time.perf_counter()
                grant = await self.store.acquire(
                    queue,
                    candidates,
                    want,
                    head_in_ms=head_in_ms,
                    next_head_in_ms=next_head_in_ms,
                    idle=idle,
                )
                self._count("acquire", started)
        except RegistryUnavailable as exc:
            self._degrade(exc)
            return await self.acquire(
                queue,
                ranked,
                want,
                head_in_ms=head_in_ms,
                next_head_in_ms=next_head_in_ms,
                idle=idle,
            )
        if not local:
            # The new leases are ours but not yet in the tracker's own count: not "others".
            granted = len(grant.lease_ids)
            mine = self._unflushed_marks()
            self._tracker.note_slots(
                {i: n - (granted if i == grant.instance_id else 0) for i, n in grant.used.items()},
                {
                    i: n - (granted if i == grant.instance_id else 0) - mine.get(i, 0)
                    for i, n in grant.computing.items()
                },
            )
        if grant.instance_id is None:
            return Slots(None, yielded=grant.yielded)
        instance = next(c for c in ranked if c.id == grant.instance_id)
        leases = tuple(
            SlotLease(self, grant.instance_id, lid, local=local) for lid in grant.lease_ids
        )
        held = self._live.setdefault(grant.instance_id, {})
        for lease in leases:
            held[lease.lease_id] = lease
        others = grant.others_head_ms
        due = None if others is None else time.monotonic() + others / 1000
        return Slots(instance, leases, others_due=due)

    def _unflushed_marks(self) -> dict[str, int]:
        """Per instance, our answered leases Redis still counts as computing."""
        marks: dict[str, int] = {}
        for lease in self._to_mark:
            marks[lease.instance_id] = marks.get(lease.instance_id, 0) + 1
        return marks

    def _computed(self, lease: SlotLease) -> None:
        if lease.local or not self.store.shared:
            return  # counted by this gateway's tracker alone
        self._to_mark.append(lease)
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            # Coalesced: every mark and release of this loop iteration goes in one call each.
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._start_flush)

    def _give_back(self, lease: SlotLease) -> None:
        held = self._live.get(lease.instance_id)
        if held is not None:
            held.pop(lease.lease_id, None)
            if not held:
                del self._live[lease.instance_id]
        if lease.local or not self.store.shared:
            # A local lease (no Redis, or granted while Redis was away) lives here only.
            self._local_release(lease)
            return
        self._to_release.append(lease)
        self._schedule_flush()

    def _local_release(self, lease: SlotLease) -> None:
        self._local.release_now([(lease.instance_id, lease.lease_id)])

    def _start_flush(self) -> None:
        self._flush_scheduled = False
        task = asyncio.ensure_future(self._flush())
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def _flush(self) -> None:
        marks, self._to_mark = self._to_mark, []
        # A lease given back in the same iteration leaves the computing set with its release.
        marks = [x for x in marks if not x._released]
        if marks:
            try:
                started = time.perf_counter()
                await self.store.computed([(x.instance_id, x.lease_id) for x in marks])
                self._count("computed", started)
            except RegistryUnavailable as exc:
                # Their computing marks expire with the leases' TTL, or go with the release.
                self._degrade(exc)
        batch, self._to_release = self._to_release, []
        if not batch:
            return
        for instance_id in {x.instance_id for x in batch}:
            self._own_freed[instance_id] = self._own_freed.get(instance_id, 0) + 1
        try:
            started = time.perf_counter()
            await self.store.release([(x.instance_id, x.lease_id) for x in batch])
            self._count("release", started)
        except RegistryUnavailable as exc:
            # They expire on their own within the lease TTL.
            self._degrade(exc)

    # -- background ------------------------------------------------------------------------

    def _degrade(self, exc: BaseException) -> None:
        if not self._degraded:
            log.warning("fleet state unreachable (%s): serving from this gateway's own counts", exc)
        self._degraded = True

    def _recover(self) -> None:
        if self._degraded:
            log.info("fleet state reachable again")
        self._degraded = False

    async def _sync_loop(self) -> None:
        backoff = ExponentialBackoff(self._sync_interval_s, max(1.0, self._sync_interval_s))
        failures = 0
        while True:
            await asyncio.sleep(backoff.delay(failures - 1) if failures else self._sync_interval_s)
            try:
                await self.sync_once()
            except RegistryUnavailable as exc:
                failures += 1
                self._degrade(exc)
                continue
            except Exception:
                # A bug here must not end the fleet's syncs for good (the others would count
                # this gateway gone and its leases with it): log it and try again.
                log.exception("fleet sync failed")
                failures += 1
                continue
            failures = 0

    async def sync_once(self) -> None:
        streams, tokens = self._tracker.own_counts()
        instances = list(self._tracker.records())
        heads = self._heads()
        samples = self._estimates.outgoing() if self._estimates is not None else None
        started = time.perf_counter()
        view = await self.store.sync(
            streams, tokens, heads, instances, samples, self._held_leases()
        )
        self._count("sync", started)
        self._recover()
        if self._estimates is not None:
            for queue, theirs in view.samples.items():
                self._estimates.incoming(queue, theirs, fresh=self._caught_up)
            self._caught_up = True
        self._own_freed.clear()  # the counts below are fresh
        self.gateways = view.gateways
        if self.gateways > 1:
            self._share_own_counts()
        # Subtract exactly what is ours: the rest is the other gateways' share. Our leases
        # still in Redis include those given back but not yet flushed.
        flushing: dict[str, int] = {}
        for lease in self._to_release:
            flushing[lease.instance_id] = flushing.get(lease.instance_id, 0) + 1
        # Leases counted here only (degraded, or alone in the fleet) are not in
        # Redis's sums.
        leased = {i: sum(not x.local for x in held.values()) for i, held in self._live.items()}
        computing = self._unflushed_marks()
        for i, held in self._live.items():
            computing[i] = computing.get(i, 0) + sum(
                x._computing and not x.local for x in held.values()
            )
        self._tracker.set_others(
            {i: n - streams.get(i, 0) for i, n in view.streams.items()},
            {i: n - tokens.get(i, 0) for i, n in view.tokens.items()},
            {i: n - leased.get(i, 0) - flushing.get(i, 0) for i, n in view.slots.items()},
            {i: n - computing.get(i, 0) for i, n in view.computing.items()},
        )

    def _share_own_counts(self) -> None:
        """Another gateway shares the fleet now (or Redis is back after this one counted
        alone): the slots it counted by itself become leases, so that the others see them.
        The next sync writes them, as it puts back what a Redis that came back empty lost;
        until then the others may send one of them a request its slot is taken for, which
        a queue-less prefill answers with 429 and one that queues holds a little longer."""
        moved: list[tuple[str, str]] = []
        for held in self._live.values():
            for lease in held.values():
                if lease.local:
                    lease.local = False
                    moved.append((lease.instance_id, lease.lease_id))
        if moved:
            self._local.release_now(moved)
            log.info("another gateway joined: %d slots counted here are now leased", len(moved))

    def _held_leases(self) -> HeldLeases:
        """What this gateway holds, for the store to agree with (a failover or a Redis back
        empty loses leases; a lost release leaves one behind). Leases counted here only are
        not the store's business."""
        keep: dict[str, list[str]] = {}
        for lease in self._to_release:
            if not lease.local:
                keep.setdefault(lease.instance_id, []).append(lease.lease_id)
        live = {
            i: [(lid, x._computing) for lid, x in held.items() if not x.local]
            for i, held in self._live.items()
        }
        return HeldLeases(self.store.lease_cutoff(), live, keep)

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self._ttl_s / 3)
            live = {
                i: [lid for lid, lease in held.items() if not lease.local]
                for i, held in self._live.items()
            }
            with contextlib.suppress(RegistryUnavailable):
                started = time.perf_counter()
                await self.store.renew(live)
                self._count("renew", started)

    def _freed(self, event: Freed) -> None:
        """A slot of `instance_id` was freed somewhere in the fleet ("": somewhere), or it
        stopped computing (`event.slot` false: it may take a new batch now). Another
        gateway's release also lowers that gateway's share in our view at once: until the next
        sync (`fleet_sync_interval_s`) the instance would still look full to our policy, and
        the slot would idle while our queue waits (with several gateways, a measurable share
        of goodput). Optimism costs nothing here: the lease in
        Redis is exact, and an acquire that finds no room corrects the view."""
        instance_id = event.instance_id
        if not event.slot:
            if instance_id:
                self._tracker.others_idle(instance_id)
            self._tracker.pulse()
            return
        own = self._own_freed.get(instance_id, 0)
        if own:
            if own == 1:
                del self._own_freed[instance_id]
            else:
                self._own_freed[instance_id] = own - 1
        elif instance_id:
            self._tracker.others_freed(instance_id)
        self._tracker.pulse()

    async def _freed_loop(self) -> None:
        backoff = ExponentialBackoff(0.1, 2.0)
        attempt = 0
        while True:
            try:
                async for event in self.store.freed():
                    attempt = 0
                    self._freed(event)
            except RegistryUnavailable as exc:
                self._degrade(exc)
            attempt += 1
            await asyncio.sleep(backoff.delay(attempt - 1))


def monotonic_ms_left(deadline: float) -> float:
    """Milliseconds from now to a monotonic `deadline` (the fleet compares them by the Redis
    server's clock, so each gateway sends durations, never its own timestamps)."""
    return max(0.0, (deadline - time.monotonic()) * 1000)
