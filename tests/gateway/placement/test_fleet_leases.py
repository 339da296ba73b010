"""When a gateway leases prefill slots through Redis: while other gateways share the fleet.
Alone, a gateway counts every prefill's slots itself, queue-less or not, and saves the Redis
round trip per dispatch; the slots it holds are handed over when another gateway joins."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from pdgate.config import Role
from pdgate.config.wire import EXT_QUEUELESS
from pdgate.gateway.instances.tracker import InstanceTracker
from pdgate.gateway.placement.leases import Fleet
from pdgate.registry.base import InstanceRecord
from pdgate.registry.fleet import RedisFleet
from tests._redis import delete_prefix
from tests.gateway._fakes import eventually


@pytest.fixture
async def fleet(redis_url: str, registry_prefix: str) -> AsyncIterator[Fleet]:
    tracker = InstanceTracker()
    tracker.update_membership(
        {
            "shim": InstanceRecord(
                id="shim", role=Role.PREFILL, url="http://shim", model="m", capacity=2,
                extensions=(EXT_QUEUELESS,),
            ),
            "stock": InstanceRecord(
                id="stock", role=Role.PREFILL, url="http://stock", model="m", capacity=2
            ),
        }
    )  # fmt: skip
    store = RedisFleet(redis_url, key_prefix=registry_prefix, gateway_id="g1")
    fleet = Fleet(store, tracker)
    fleet.loads = {c.id: c for c in tracker.loads(Role.PREFILL, "m")}  # type: ignore[attr-defined]
    yield fleet
    await fleet.aclose()


async def _leased_in_redis(fleet: Fleet, instance: str) -> int:
    view = await fleet.store.sync({}, {}, {}, ["shim", "stock"])
    return view.slots.get(instance, 0)


async def _acquire(fleet: Fleet, instance: str) -> bool:
    """Take one slot on `instance`; whether it was counted locally."""
    ranked = [fleet.loads[instance]]  # type: ignore[attr-defined]
    slots = await fleet.acquire("m|", ranked, 1, head_in_ms=None, next_head_in_ms=None)
    assert slots.instance is not None and slots.instance.id == instance
    (lease,) = slots.leases
    return lease.local


# "shim" is queue-less (it answers 429 when full), "stock" queues (a plain vLLM).
PREFILLS = ("shim", "stock")


@pytest.mark.parametrize("instance", PREFILLS)
async def test_alone_a_gateway_counts_every_prefills_slots_itself(
    fleet: Fleet, instance: str
) -> None:
    assert fleet.gateways == 1
    assert await _acquire(fleet, instance)
    assert await _leased_in_redis(fleet, instance) == 0


@pytest.mark.parametrize("instance", PREFILLS)
async def test_with_other_gateways_every_slot_is_leased(fleet: Fleet, instance: str) -> None:
    fleet.gateways = 2  # as the sync says once another gateway shares the fleet
    assert not await _acquire(fleet, instance)
    assert await _leased_in_redis(fleet, instance) == 1


@pytest.mark.parametrize("instance", PREFILLS)
async def test_slots_counted_alone_are_handed_over_when_another_gateway_joins(
    fleet: Fleet, redis_url: str, registry_prefix: str, instance: str
) -> None:
    """Alone, the gateway counted the prefill's slots itself; once a sync says another
    gateway shares the fleet, the slots it still holds are leased in Redis (the newcomer
    sees them taken), and their release goes to Redis."""
    assert await _acquire(fleet, instance)  # counted here only
    assert await _leased_in_redis(fleet, instance) == 0
    other = RedisFleet(redis_url, key_prefix=registry_prefix, gateway_id="g2")
    try:
        await other.sync({}, {}, {}, [instance])  # a second gateway is alive
        await fleet.sync_once()  # learns it: hands the slot over
        assert fleet.gateways == 2
        await fleet.sync_once()  # writes it
        assert (await other.sync({}, {}, {}, [instance])).slots[instance] == 1
        (lease,) = fleet._live[instance].values()
        assert not lease.local
        lease.release()
        await asyncio.sleep(0.05)  # the release flushed
        assert await _leased_in_redis(fleet, instance) == 0
    finally:
        await other.aclose()


def _tracker() -> InstanceTracker:
    tracker = InstanceTracker()
    tracker.update_membership(
        {"stock": InstanceRecord(id="stock", role=Role.PREFILL, url="s", model="m", capacity=2)}
    )
    return tracker


@contextlib.asynccontextmanager
async def _two_gateways(
    redis_url: str, prefix: str, *, listen: bool
) -> AsyncIterator[tuple[InstanceTracker, InstanceTracker, Fleet, Fleet]]:
    """Two gateways' fleets on one Redis (trackers a, b, then fleets a, b) that sync only when
    the test says; `listen`: started, so each hears the other's freed and idle prefills."""
    trackers = ta, tb = _tracker(), _tracker()
    fleets = a, b = [
        Fleet(RedisFleet(redis_url, key_prefix=prefix, gateway_id=gw), tr, sync_interval_s=3600)
        for gw, tr in zip("ab", trackers, strict=True)
    ]
    try:
        for f in fleets:
            if listen:
                await f.start()
            f.gateways = 2
        if listen:
            await asyncio.sleep(0.1)  # subscribed
        yield ta, tb, a, b
    finally:
        for f in fleets:
            await f.aclose()


def _inflight(tracker: InstanceTracker) -> int:
    (load,) = tracker.loads(Role.PREFILL, "m")
    return load.inflight


async def test_a_slot_another_gateway_frees_is_seen_before_the_next_sync(
    redis_url: str, registry_prefix: str
) -> None:
    """Measured with 4 gateways at 4A: a slot freed by one gateway looked taken to the others
    until their next sync (100 ms), so it idled while their queues waited. The freed-slot
    message now lowers the other gateway's share at once; a gateway's own message does not
    lower the share of the others."""
    async with _two_gateways(redis_url, registry_prefix, listen=True) as (ta, tb, a, b):
        loads_a = ta.loads(Role.PREFILL, "m")
        loads_b = tb.loads(Role.PREFILL, "m")
        held_a = await a.acquire("m|", loads_a, 1, head_in_ms=None, next_head_in_ms=None)
        held_b = await b.acquire("m|", loads_b, 1, head_in_ms=None, next_head_in_ms=None)
        assert held_a.instance is not None and held_b.instance is not None
        for f in (a, b):
            await f.sync_once()
        # Each sees the other's slot (its own are counted by its forwarder, not used here).
        assert _inflight(ta) == 1 and _inflight(tb) == 1

        (lease,) = held_b.leases
        lease.release()
        # a sees b's slot free long before any sync; b's own message leaves a's share alone.
        await eventually(lambda: _inflight(ta) == 0)
        await asyncio.sleep(0.2)
        assert _inflight(tb) == 1  # a's slot, still held
        assert _inflight(ta) == 0
        # And the slot is really free in Redis: a takes it.
        again = await a.acquire(
            "m|", ta.loads(Role.PREFILL, "m"), 1, head_in_ms=None, next_head_in_ms=None
        )
        assert again.instance is not None


def _computing(tracker: InstanceTracker) -> int:
    (load,) = tracker.loads(Role.PREFILL, "m")
    return load.computing


async def test_what_another_gateway_computes_is_seen_at_once_and_when_it_ends(
    redis_url: str, registry_prefix: str
) -> None:
    """A prefill another gateway computes at leaves `idle` candidates at the next acquire's
    answer, not the next sync, and comes back as soon as its answer is marked: a view that
    lagged a sync either sent into the batch or left the prefill idle while requests
    waited. A lease given back before its answer ends its computing too."""
    async with _two_gateways(redis_url, registry_prefix, listen=True) as (ta, tb, a, b):
        held = await a.acquire(
            "m|", ta.loads(Role.PREFILL, "m"), 2, head_in_ms=None, next_head_in_ms=None, idle=True
        )
        assert len(held.leases) == 2
        # b asks, is refused (the prefill computes a's two), and knows why from the answer.
        refused = await b.acquire(
            "m|", tb.loads(Role.PREFILL, "m"), 1, head_in_ms=None, next_head_in_ms=None, idle=True
        )
        assert refused.instance is None and _computing(tb) == 2
        first, second = held.leases
        first.computed()
        second.release()  # abandoned before its answer
        await eventually(lambda: _computing(tb) == 0)  # the idle message, no sync
        assert _inflight(tb) == 1  # a's first slot still holds its KV
        got = await b.acquire(
            "m|", tb.loads(Role.PREFILL, "m"), 1, head_in_ms=None, next_head_in_ms=None, idle=True
        )
        assert got.instance is not None  # into the slot next to a's KV
        assert a.calls["computed"] == 1 and a.calls["release"] == 1 and a.calls["acquire"] == 1


async def test_after_redis_lost_the_leases_the_next_sync_puts_back_what_is_held(
    redis_url: str, registry_prefix: str
) -> None:
    """A stock prefill queues instead of refusing: with its leases lost (a Redis back empty,
    a failover to a replica that had not received them) the fleet would overfill it. One
    sync later every gateway's held leases are back; a released one is not."""
    async with _two_gateways(redis_url, registry_prefix, listen=False) as (ta, tb, a, b):
        held = await a.acquire(
            "m|", ta.loads(Role.PREFILL, "m"), 2, head_in_ms=None, next_head_in_ms=None
        )
        kept, released = held.leases
        released.release()
        await asyncio.sleep(0.05)  # the release flushed
        delete_prefix(redis_url, registry_prefix)  # Redis lost everything
        await a.sync_once()
        got = await b.acquire(
            "m|", tb.loads(Role.PREFILL, "m"), 2, head_in_ms=None, next_head_in_ms=None
        )
        assert len(got.leases) == 1  # a's kept lease is back: one slot of two is free
        assert kept.lease_id not in {x.lease_id for x in got.leases}
