"""Stored responses: bounded, scoped, shared through a real Redis, and still served by a
gateway whose Redis went away."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from pdgate.registry.responses import (
    EntryTooLarge,
    MemoryResponseStore,
    RedisResponseStore,
    ResponseStore,
    StoreLimits,
)
from tests._redis import RedisServer


async def scopes_apart(one: ResponseStore, two: ResponseStore) -> None:
    """What one store (or gateway) put, the other reads in its scope alone."""
    await one.put("alice", "r1", b'{"a":1}')
    assert await two.get("alice", "r1") == b'{"a":1}'
    assert await two.get("bob", "r1") is None
    assert not await two.delete("bob", "r1")
    assert await two.delete("alice", "r1")
    assert await one.get("alice", "r1") is None
    assert not await one.delete("alice", "r1")


async def test_memory_store_keeps_each_scope_apart() -> None:
    store = MemoryResponseStore()
    await scopes_apart(store, store)


async def test_memory_store_bounds_entries_scopes_and_bytes() -> None:
    store = MemoryResponseStore(
        StoreLimits(ttl_s=60, max_entry_bytes=10, max_per_scope=2, max_bytes=25)
    )
    with pytest.raises(EntryTooLarge):
        await store.put("a", "big", b"x" * 11)
    for i in range(3):
        await store.put("a", f"r{i}", b"x" * 10)
    # The scope keeps its two newest.
    assert [await store.get("a", f"r{i}") is not None for i in range(3)] == [False, True, True]
    await store.put("b", "s0", b"y" * 10)
    # 30 bytes would pass the store's 25: the oldest of all goes.
    assert await store.get("a", "r1") is None
    assert await store.get("a", "r2") == b"x" * 10
    assert await store.get("b", "s0") == b"y" * 10
    assert len(store) == 2


async def test_memory_store_forgets_after_its_ttl() -> None:
    store = MemoryResponseStore(StoreLimits(ttl_s=0.05))
    await store.put("a", "r", b"x")
    await asyncio.sleep(0.1)
    assert await store.get("a", "r") is None
    await store.put("a", "r2", b"x")  # evicts the expired one on the way
    assert len(store) == 1


@pytest.fixture
async def stores(
    redis_url: str, registry_prefix: str
) -> AsyncIterator[tuple[RedisResponseStore, RedisResponseStore]]:
    """Two gateways' stores on one Redis."""
    limits = StoreLimits(ttl_s=30, max_entry_bytes=1 << 16, max_per_scope=3)
    one = RedisResponseStore(redis_url, key_prefix=registry_prefix, limits=limits)
    two = RedisResponseStore(redis_url, key_prefix=registry_prefix, limits=limits)
    yield one, two
    await one.aclose()
    await two.aclose()


async def test_redis_store_is_shared_by_the_fleet_and_scoped(
    stores: tuple[RedisResponseStore, RedisResponseStore],
) -> None:
    one, two = stores
    await scopes_apart(one, two)
    with pytest.raises(EntryTooLarge):
        await one.put("alice", "big", b"x" * (1 << 17))


async def test_redis_store_bounds_a_scope_and_deletes_what_it_drops(
    stores: tuple[RedisResponseStore, RedisResponseStore], redis_url: str, registry_prefix: str
) -> None:
    one, _ = stores
    for i in range(5):
        await one.put("alice", f"r{i}", b"x")
    present = [await one.get("alice", f"r{i}") is not None for i in range(5)]
    assert present == [False, False, True, True, True]
    client = aioredis.from_url(redis_url)
    try:
        keys = await client.keys(f"{registry_prefix}:responses:*")
        # Three entries and the scope's index: nothing else left behind.
        assert len(keys) == 4
        ttl = await client.pttl(f"{registry_prefix}:responses:{{alice}}")
        assert 0 < ttl <= 30_000
    finally:
        await client.aclose()


async def test_redis_store_entries_expire(redis_url: str, registry_prefix: str) -> None:
    store = RedisResponseStore(redis_url, key_prefix=registry_prefix, limits=StoreLimits(ttl_s=0.1))
    try:
        await store.put("a", "r", b"x")
        assert await store.get("a", "r") == b"x"
        await asyncio.sleep(0.3)
        assert await store.get("a", "r") is None
    finally:
        await store.aclose()


async def test_a_store_whose_redis_is_away_keeps_serving_from_memory(
    private_redis: RedisServer,
) -> None:
    store = RedisResponseStore(private_redis.url, connect_timeout_s=0.3)
    try:
        await store.put("a", "before", b"1")
        private_redis.stop()
        await store.put("a", "during", b"2")  # no exception: kept in this process
        assert await store.get("a", "during") == b"2"
        assert await store.delete("a", "during")
        await store.put("a", "during", b"3")
        private_redis.start()
        # Redis came back empty (no persistence): what was stored meanwhile is still here.
        assert await store.get("a", "during") == b"3"
        await store.put("a", "after", b"4")
        assert await store.get("a", "after") == b"4"
        assert await store.fallback.get("a", "after") is None  # it went to Redis
    finally:
        await store.aclose()
