"""Behaviour both registries promise (each test runs on memory and on Redis)."""

from __future__ import annotations

import asyncio

import pytest

from pdgate.registry import EventKind, InstanceState, Registry
from tests.registry._util import eventually, make_record, next_event, no_event, subscribed


async def test_put_snapshot_remove(any_registry: Registry) -> None:
    a, b = make_record("a"), make_record("b", capacity=2)
    await any_registry.put(a, 5.0)
    await any_registry.put(b, 5.0)
    assert sorted(await any_registry.snapshot(), key=lambda r: r.id) == [a, b]

    await any_registry.remove("a")
    assert await any_registry.snapshot() == [b]
    await any_registry.remove("never-registered")  # no error
    assert await any_registry.snapshot() == [b]


async def test_put_overwrites(any_registry: Registry) -> None:
    await any_registry.put(make_record("a"), 5.0)
    draining = make_record("a", state=InstanceState.DRAINING)
    await any_registry.put(draining, 5.0)
    assert await any_registry.snapshot() == [draining]


async def test_record_expires_after_ttl(any_registry: Registry) -> None:
    await any_registry.put(make_record("short"), 0.3)
    await any_registry.put(make_record("long"), 10.0)
    assert {r.id for r in await any_registry.snapshot()} == {"short", "long"}

    async def short_gone() -> bool:
        return {r.id for r in await any_registry.snapshot()} == {"long"}

    took = await eventually(short_gone, within=2.0, what="expiry")
    assert took >= 0.2  # not gone before its TTL


async def test_refresh_extends_ttl(any_registry: Registry) -> None:
    record = make_record("a")
    await any_registry.put(record, 0.3)
    for _ in range(4):  # 0.6 s in all: twice the TTL
        await asyncio.sleep(0.15)
        await any_registry.put(record, 0.3)
    assert await any_registry.snapshot() == [record]


async def test_events_join_and_leave(any_registry: Registry) -> None:
    async with subscribed(any_registry) as stream:
        record = make_record("a")
        await any_registry.put(record, 5.0)  # not announced: a plain refresh
        await any_registry.put(record, 5.0, announce=True)
        event = await next_event(stream)
        assert (event.kind, event.instance_id, event.record) == (EventKind.JOIN, "a", record)

        await any_registry.remove("a")
        event = await next_event(stream)
        assert (event.kind, event.instance_id, event.record) == (EventKind.LEAVE, "a", None)
        await no_event(stream, within=0.2)


async def test_events_start_from_now(any_registry: Registry) -> None:
    await any_registry.put(make_record("before"), 5.0, announce=True)
    async with subscribed(any_registry) as stream:
        await any_registry.put(make_record("after"), 5.0, announce=True)
        assert (await next_event(stream)).instance_id == "after"


async def test_bad_ttl_rejected(any_registry: Registry) -> None:
    with pytest.raises(ValueError, match="ttl"):
        await any_registry.put(make_record(), 0)
