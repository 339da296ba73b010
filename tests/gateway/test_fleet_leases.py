"""When a gateway leases prefill slots through Redis: always for a prefill that queues (only
the gateways keep it queue-less), and for queue-less prefills only while other gateways
share them; alone, a gateway counts the slots of queue-less prefills itself and saves the
Redis round trip per dispatch."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from pdgate.config import Role
from pdgate.config.wire import EXT_QUEUELESS
from pdgate.gateway.fleet import Fleet
from pdgate.gateway.instances import InstanceTracker
from pdgate.registry.base import InstanceRecord
from pdgate.registry.fleet import RedisFleet


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


async def test_alone_a_gateway_counts_queueless_slots_itself(fleet: Fleet) -> None:
    assert fleet.gateways == 1
    assert await _acquire(fleet, "shim")
    assert await _leased_in_redis(fleet, "shim") == 0


async def test_a_prefill_that_queues_is_always_leased(fleet: Fleet) -> None:
    assert not await _acquire(fleet, "stock")
    assert await _leased_in_redis(fleet, "stock") == 1


async def test_with_other_gateways_every_slot_is_leased(fleet: Fleet) -> None:
    fleet.gateways = 2  # as the sync says once another gateway shares the fleet
    assert not await _acquire(fleet, "shim")
    assert await _leased_in_redis(fleet, "shim") == 1
