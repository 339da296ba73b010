"""Fleet-shared load on a real Redis: leases, deadline order, gossip, dead gateways."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio

from pdgate.registry.fleet import Candidate, Freed, HeldLeases, LocalFleet, RedisFleet
from tests._redis import RedisServer

P = [Candidate("p0", 2), Candidate("p1", 1)]


@pytest.fixture
async def fleet(redis_url: str, registry_prefix: str) -> AsyncIterator[list[RedisFleet]]:
    stores: list[RedisFleet] = []

    def make(**kw: object) -> RedisFleet:
        store = RedisFleet(redis_url, key_prefix=registry_prefix, **kw)  # type: ignore[arg-type]
        stores.append(store)
        return store

    yield make  # type: ignore[misc]
    for s in stores:
        await s.aclose()


async def test_leases_never_exceed_a_slot_count_across_gateways(fleet) -> None:  # type: ignore[no-untyped-def]
    a, b = fleet(gateway_id="a"), fleet(gateway_id="b")
    g1 = await a.acquire("m|", P, 5, head_in_ms=None, next_head_in_ms=None)
    assert g1.instance_id == "p0" and len(g1.lease_ids) == 2  # both slots of p0
    g2 = await b.acquire("m|", P, 5, head_in_ms=None, next_head_in_ms=None)
    assert g2.instance_id == "p1" and len(g2.lease_ids) == 1  # p0 full fleet-wide
    g3 = await a.acquire("m|", P, 1, head_in_ms=None, next_head_in_ms=None)
    assert g3.instance_id is None and g3.used == {"p0": 2, "p1": 1}
    await a.release([("p0", g1.lease_ids[0])])
    g4 = await b.acquire("m|", P, 1, head_in_ms=None, next_head_in_ms=None)
    assert g4.instance_id == "p0"


async def _listen(store: RedisFleet) -> tuple[asyncio.Queue[Freed], asyncio.Task[None]]:
    """What `store` hears of the fleet, once it is subscribed."""
    heard: asyncio.Queue[Freed] = asyncio.Queue()

    async def listen() -> None:
        async for event in store.freed():
            await heard.put(event)

    task = asyncio.create_task(listen())
    await asyncio.sleep(0.2)  # subscribed
    return heard, task


async def test_a_release_is_announced_to_every_gateway(fleet) -> None:  # type: ignore[no-untyped-def]
    a, b = fleet(gateway_id="a"), fleet(gateway_id="b")
    grant = await a.acquire("m|", P, 1, head_in_ms=None, next_head_in_ms=None)
    heard, task = await _listen(b)
    await a.release([("p0", grant.lease_ids[0])])
    # Given back before its answer: the slot is free and the prefill computes nothing.
    events = {await asyncio.wait_for(heard.get(), 2) for _ in range(2)}
    assert events == {Freed("p0", slot=True), Freed("p0", slot=False)}
    grant = await a.acquire("m|", P, 1, head_in_ms=None, next_head_in_ms=None)
    await a.computed([("p0", grant.lease_ids[0])])
    assert await asyncio.wait_for(heard.get(), 2) == Freed("p0", slot=False)
    await a.release([("p0", grant.lease_ids[0])])  # answered before: only the slot frees
    assert await asyncio.wait_for(heard.get(), 2) == Freed("p0", slot=True)
    await asyncio.sleep(0.1)
    assert heard.empty()
    task.cancel()


async def test_an_idle_acquire_skips_a_prefill_another_gateway_computes_at(fleet) -> None:  # type: ignore[no-untyped-def]
    """What a prefill computes, and for whom, is known fleet-wide in the same step that
    takes its slots: gateway b never sends into a batch gateway a's requests compute."""
    a, b = fleet(gateway_id="a"), fleet(gateway_id="b")
    big = [Candidate("p0", 8), Candidate("p1", 8)]
    g1 = await a.acquire("m|", big, 2, head_in_ms=None, next_head_in_ms=None, idle=True)
    assert g1.instance_id == "p0" and g1.computing["p0"] == 2
    # p0 has six free slots, but computes a's batch: b goes to the idle p1.
    g2 = await b.acquire("m|", big, 1, head_in_ms=None, next_head_in_ms=None, idle=True)
    assert g2.instance_id == "p1" and g2.computing == {"p0": 2, "p1": 1}
    # Without the idle rule, free slots are enough.
    g3 = await b.acquire("m|", big, 1, head_in_ms=None, next_head_in_ms=None)
    assert g3.instance_id == "p0"
    await b.release([("p0", g3.lease_ids[0])])
    # Answered, the slots still hold KV (leased) but p0 is idle again: b may use it.
    await a.computed([("p0", x) for x in g1.lease_ids])
    g4 = await b.acquire("m|", big[:1], 1, head_in_ms=None, next_head_in_ms=None, idle=True)
    assert g4.instance_id == "p0" and g4.used["p0"] == 3 and g4.computing["p0"] == 1


async def test_a_prefill_that_stops_computing_is_announced(fleet) -> None:  # type: ignore[no-untyped-def]
    a, b = fleet(gateway_id="a"), fleet(gateway_id="b")
    grant = await a.acquire("m|", P, 2, head_in_ms=None, next_head_in_ms=None, idle=True)
    heard, task = await _listen(b)
    await a.computed([("p0", grant.lease_ids[0])])  # one of two answered: still computing
    await a.computed([("p0", grant.lease_ids[1])])
    assert await asyncio.wait_for(heard.get(), 2) == Freed("p0", slot=False)
    assert heard.empty()
    task.cancel()


async def test_a_sync_reads_what_each_prefill_computes(fleet) -> None:  # type: ignore[no-untyped-def]
    a, b = fleet(gateway_id="a"), fleet(gateway_id="b")
    grant = await a.acquire("m|", P, 2, head_in_ms=None, next_head_in_ms=None, idle=True)
    view = await b.sync({}, {}, {}, ["p0", "p1"])
    assert view.computing == {"p0": 2, "p1": 0} and view.slots == {"p0": 2, "p1": 0}
    await a.release([("p0", grant.lease_ids[0])])  # a release ends its computing too
    view = await b.sync({}, {}, {}, ["p0", "p1"])
    assert view.computing == {"p0": 1, "p1": 0} and view.slots == {"p0": 1, "p1": 0}


async def test_prefill_time_samples_reach_the_other_gateways_once(fleet) -> None:  # type: ignore[no-untyped-def]
    a, b, c = fleet(gateway_id="a"), fleet(gateway_id="b"), fleet(gateway_id="c")
    heads = {"m|": None, "n|": None}
    await a.sync({}, {}, heads, [], {"m|": "p 100 0.5"})
    await b.sync({}, {}, heads, [], {"m|": "p 200 0.7", "n|": "c 9 0.1"})
    # c joins late and still gets what was shared before it (a warm start), of every queue,
    # its own included or not.
    view = await c.sync({}, {}, {}, [])
    assert {q: sorted(x) for q, x in view.samples.items()} == {
        "m|": ["p 100 0.5", "p 200 0.7"],
        "n|": ["c 9 0.1"],
    }
    # Each gateway gets only the others' samples, and each sample once.
    view = await a.sync({}, {}, heads, [])
    assert {q: list(x) for q, x in view.samples.items()} == {"m|": ["p 200 0.7"], "n|": ["c 9 0.1"]}
    assert (await a.sync({}, {}, heads, [])).samples == {}
    assert (await c.sync({}, {}, heads, [])).samples == {}


async def test_a_dead_gateways_leases_and_counts_vanish_within_its_ttl(fleet) -> None:  # type: ignore[no-untyped-def]
    dead = fleet(gateway_id="dead", ttl_s=0.3)
    live = fleet(gateway_id="live", ttl_s=0.3)
    await dead.acquire("m|", P, 2, head_in_ms=None, next_head_in_ms=None)
    await dead.sync({"p0": 5}, {"p0": 500}, {}, ["p0"])
    view = await live.sync({"p0": 1}, {}, {}, ["p0"])
    assert view.gateways == 2 and view.streams["p0"] == 6 and view.slots["p0"] == 2
    # "dead" stops renewing (as after kill -9); within its ttl everything it held is gone.
    await asyncio.sleep(0.45)
    view = await live.sync({"p0": 1}, {}, {}, ["p0"])
    assert view.gateways == 1
    assert view.streams["p0"] == 1 and view.tokens["p0"] == 0 and view.slots["p0"] == 0
    dead.gateway_id = "gone"  # its aclose must not touch the live one's state


async def test_dead_gateways_leave_the_deadline_order(fleet, redis_url: str) -> None:  # type: ignore[no-untyped-def]
    """Gateways that died with requests queued stayed in the queue's heads for good (every
    sync renews the key), and reads see its first eight: nine such hid a live gateway's
    urgent head, and the fleet's deadline order stopped working."""
    for i in range(9):  # each died with a request due in 5 s queued
        await fleet(gateway_id=f"dead{i}", ttl_s=0.3).sync({}, {}, {"m|": 5000}, [])
    await asyncio.sleep(0.45)
    urgent = fleet(gateway_id="urgent", ttl_s=0.3, window_s=0.3)
    relaxed = fleet(gateway_id="relaxed", ttl_s=0.3, window_s=0.3)
    one = [Candidate("p1", 1)]
    held = await relaxed.acquire("m|", one, 1, head_in_ms=None, next_head_in_ms=None)
    await urgent.sync({}, {}, {"m|": 6000}, [])
    client = redis.asyncio.from_url(redis_url)
    try:
        assert await client.zrange(urgent._heads("m|"), 0, -1) == [b"urgent"]
    finally:
        await client.aclose()
    await relaxed.release([("p1", held.lease_ids[0])])
    y = await relaxed.acquire("m|", one, 1, head_in_ms=8000, next_head_in_ms=None)
    assert y.instance_id is None and y.yielded  # the live urgent head is seen


async def test_renewed_leases_outlive_the_ttl(fleet) -> None:  # type: ignore[no-untyped-def]
    a = fleet(gateway_id="a", ttl_s=0.3)
    grant = await a.acquire("m|", P, 2, head_in_ms=None, next_head_in_ms=None)
    for _ in range(4):
        await asyncio.sleep(0.1)
        await a.renew({"p0": list(grant.lease_ids)})
    view = await a.sync({}, {}, {}, ["p0"])
    assert view.slots["p0"] == 2


async def test_a_freed_slot_goes_to_the_fleets_most_urgent_request_first(fleet) -> None:  # type: ignore[no-untyped-def]
    urgent = fleet(gateway_id="urgent", window_s=0.3)
    relaxed = fleet(gateway_id="relaxed", window_s=0.3)
    one = [Candidate("p1", 1)]
    held = await relaxed.acquire("m|", one, 1, head_in_ms=None, next_head_in_ms=None)
    # The urgent gateway's most urgent request is due in 100 ms (it published its head).
    await urgent.sync({}, {}, {"m|": 100}, [])
    await relaxed.release([("p1", held.lease_ids[0])])
    # Within the window after the release, the relaxed gateway's 5 s request must yield...
    y = await relaxed.acquire("m|", one, 1, head_in_ms=5000, next_head_in_ms=None)
    assert y.instance_id is None and y.yielded
    # ...the urgent one gets it.
    g = await urgent.acquire("m|", one, 1, head_in_ms=100, next_head_in_ms=None)
    assert g.instance_id == "p1"
    await urgent.release([("p1", g.lease_ids[0])])
    # After the window anybody may take it: a gateway that never comes cannot idle a slot.
    await asyncio.sleep(0.35)
    late = await relaxed.acquire("m|", one, 1, head_in_ms=5000, next_head_in_ms=None)
    assert late.instance_id == "p1"


async def test_a_gateway_that_found_no_room_keeps_its_place_in_the_deadline_order(fleet) -> None:  # type: ignore[no-untyped-def]
    """Its head is still queued: it publishes that head, not the one after the batch it
    could not place, or the others would take the next freed slot before its request."""
    waiting = fleet(gateway_id="waiting", window_s=0.3)
    other = fleet(gateway_id="other", window_s=0.3)
    one = [Candidate("p1", 1)]
    held = await other.acquire("m|", one, 1, head_in_ms=None, next_head_in_ms=None)
    # Full: its head due in 100 ms stays queued (the request after a batch of 4: 900 ms).
    full = await waiting.acquire("m|", one, 4, head_in_ms=100, next_head_in_ms=900)
    assert full.instance_id is None and not full.yielded
    await other.release([("p1", held.lease_ids[0])])
    y = await other.acquire("m|", one, 1, head_in_ms=500, next_head_in_ms=None)
    assert y.instance_id is None and y.yielded  # 100 ms is due before 500 ms
    g = await waiting.acquire("m|", one, 4, head_in_ms=100, next_head_in_ms=900)
    assert g.instance_id == "p1"
    await waiting.release([("p1", g.lease_ids[0])])
    # Placed: its head is now the request after what it placed (900 ms), after 500 ms.
    mine = await other.acquire("m|", one, 1, head_in_ms=500, next_head_in_ms=None)
    assert mine.instance_id == "p1"


async def test_local_fleet_counts_its_own_leases() -> None:
    f = LocalFleet()
    g = await f.acquire("q", [Candidate("p", 3)], 5, head_in_ms=None, next_head_in_ms=None)
    assert len(g.lease_ids) == 3  # alone: the whole capacity
    assert (
        await f.acquire("q", [Candidate("p", 3)], 1, head_in_ms=None, next_head_in_ms=None)
    ).instance_id is None
    await f.release([("p", g.lease_ids[0])])
    await f.release([("p", g.lease_ids[0])])  # given back once only
    assert (await f.sync({}, {}, {}, ["p"])).slots == {"p": 2}


async def test_a_sync_makes_the_store_agree_with_the_leases_a_gateway_holds(
    fleet, redis_url: str, registry_prefix: str
) -> None:  # type: ignore[no-untyped-def]
    """A failover to a replica that had not received them, or a Redis back empty, loses
    leases: the prefill would look free and be overfilled. A release the old primary took
    with it leaves a lease nobody holds: phantom load until its TTL. Each sync puts back what
    the gateway holds and takes away its own leases it does not."""
    a, b = fleet(gateway_id="a"), fleet(gateway_id="b")
    big = [Candidate("p0", 8)]
    mine = await a.acquire("m|", big, 2, head_in_ms=None, next_head_in_ms=None, idle=True)
    theirs = await b.acquire("m|", big, 1, head_in_ms=None, next_head_in_ms=None)
    one, two = mine.lease_ids
    await a.computed([("p0", two)])
    lost = redis.asyncio.Redis.from_url(redis_url)
    await lost.delete(f"{registry_prefix}:fleet:slots:p0", f"{registry_prefix}:fleet:computing:p0")
    await lost.aclose()
    held = HeldLeases(a.lease_cutoff(), {"p0": [(one, True), (two, False)]})
    view = await a.sync({}, {}, {}, ["p0"], leases=held)
    assert (view.slots, view.computing) == ({"p0": 2}, {"p0": 1})  # b's is b's to restore
    b_holds = HeldLeases(b.lease_cutoff(), {"p0": [(theirs.lease_ids[0], True)]})
    view = await b.sync({}, {}, {}, ["p0"], leases=b_holds)
    assert (view.slots, view.computing) == ({"p0": 3}, {"p0": 2})
    # a gave `two` back, but the release never reached Redis: a phantom, until a's next sync.
    late = await a.acquire("m|", big, 1, head_in_ms=None, next_head_in_ms=None)
    (three,) = late.lease_ids
    in_flight = HeldLeases(a.lease_cutoff() - 1, {"p0": [(one, True)]})  # `three` not yet seen
    view = await a.sync({}, {}, {}, ["p0"], leases=in_flight)
    assert view.slots == {"p0": 3}  # one, b's, and three (which a may not have heard of yet)
    giving_back = HeldLeases(a.lease_cutoff(), {"p0": [(one, True)]}, {"p0": [three]})
    view = await a.sync({}, {}, {}, ["p0"], leases=giving_back)
    assert view.slots == {"p0": 3}  # three is being given back: its release will say so
    view = await a.sync(
        {}, {}, {}, ["p0"], leases=HeldLeases(a.lease_cutoff(), {"p0": [(one, True)]})
    )
    assert (view.slots, view.computing) == ({"p0": 2}, {"p0": 2})  # b's is never a's to drop


async def test_a_gateway_closes_its_fleet_state_with_redis_away(private_redis: RedisServer) -> None:
    """Its farewell sync fails (its state then expires in Redis): it used to raise out of
    the app's shutdown, and the gateway exited with a traceback instead of cleanly."""
    store = RedisFleet(private_redis.url, key_prefix="t", connect_timeout_s=0.5)
    await store.sync({"p0": 1}, {}, {}, ["p0"])
    await private_redis.astop()
    await store.aclose()
