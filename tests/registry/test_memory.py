"""MemoryRegistry specifics: a controllable clock, the size bound, slow subscribers."""

from __future__ import annotations

import pytest

from pdgate.registry import EventKind, MemoryRegistry, RegistryError, RegistryUnavailable
from tests.registry._util import make_record, next_event


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_expiry_follows_the_clock() -> None:
    clock = Clock()
    reg = MemoryRegistry(clock=clock)
    await reg.put(make_record("a"), 3.0)
    clock.now += 2.9
    assert [r.id for r in await reg.snapshot()] == ["a"]
    await reg.put(make_record("a"), 3.0)  # refreshed: 3 s from now
    clock.now += 2.9
    assert [r.id for r in await reg.snapshot()] == ["a"]
    clock.now += 0.2
    assert await reg.snapshot() == []


async def test_max_instances_bound() -> None:
    clock = Clock()
    reg = MemoryRegistry(max_instances=2, clock=clock)
    await reg.put(make_record("a"), 1.0)
    await reg.put(make_record("b"), 5.0)
    with pytest.raises(RegistryError, match="full"):
        await reg.put(make_record("c"), 5.0)
    await reg.put(make_record("b"), 5.0)  # refreshing a member is always fine
    clock.now += 1.5  # "a" expired: its slot is free again
    await reg.put(make_record("c"), 5.0)
    assert sorted(r.id for r in await reg.snapshot()) == ["b", "c"]


async def test_slow_subscriber_is_dropped_others_are_not() -> None:
    reg = MemoryRegistry(queue_size=3)
    slow, fast = reg.events(), reg.events()
    for i in range(3):
        await reg.put(make_record(f"i{i}"), 5.0, announce=True)
        assert (await next_event(fast)).instance_id == f"i{i}"
    await reg.put(make_record("overflow"), 5.0, announce=True)  # the 4th for `slow`
    assert (await next_event(fast)).instance_id == "overflow"

    # The dropped stream ends at once (stale events discarded): its consumer re-polls.
    assert [e async for e in slow] == []
    await reg.put(make_record("later"), 5.0, announce=True)
    assert (await next_event(fast)).instance_id == "later"
    assert [e async for e in slow] == []
    await fast.aclose()


async def test_closed_stream_stops_receiving() -> None:
    reg = MemoryRegistry()
    stream = reg.events()
    await stream.aclose()
    await reg.put(make_record(), 5.0, announce=True)
    assert [e async for e in stream] == []


async def test_aclose_ends_streams_and_refuses_calls() -> None:
    reg = MemoryRegistry()
    stream = reg.events()
    await reg.put(make_record("a"), 5.0)
    await reg.aclose()
    assert [e async for e in stream] == []
    assert [e async for e in reg.events()] == []
    with pytest.raises(RegistryUnavailable):
        await reg.snapshot()
    with pytest.raises(RegistryUnavailable):
        await reg.put(make_record("a"), 5.0)


async def test_remove_publishes_leave() -> None:
    reg = MemoryRegistry()
    stream = reg.events()
    await reg.remove("gone")
    event = await next_event(stream)
    assert (event.kind, event.instance_id) == (EventKind.LEAVE, "gone")
    await stream.aclose()


def test_rejects_bad_bounds() -> None:
    with pytest.raises(ValueError, match="positive"):
        MemoryRegistry(max_instances=0)
