"""RedisRegistry specifics: key layout, corrupt data, bounds, outages (real redis-server)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import orjson
import pytest
import redis.asyncio as aioredis

from pdgate.config import RegistrySettings
from pdgate.registry import (
    EventKind,
    MemoryRegistry,
    RedisRegistry,
    RegistryUnavailable,
    open_registry,
    redact_url,
)
from tests._redis import RedisServer, free_port
from tests.registry._util import eventually, make_record, next_event


@pytest.fixture
async def raw(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """A plain client to inspect and tamper with what the registry wrote."""
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def test_key_layout_and_server_side_ttl(
    redis_registry: RedisRegistry, raw: aioredis.Redis, registry_prefix: str
) -> None:
    record = make_record("p1")
    before = time.time() * 1000
    await redis_registry.put(record, 2.0)
    after = time.time() * 1000
    key = f"{registry_prefix}:instance:p1"
    stored = await raw.get(key)
    assert stored is not None
    assert orjson.loads(stored) == orjson.loads(record.to_json())
    assert 0 < await raw.pttl(key) <= 2000
    # The members' score: when the record expires, the put's time + its TTL.
    score = await raw.zscore(f"{registry_prefix}:members", "p1")
    assert score is not None
    assert before + 2000 <= score <= after + 2000

    await redis_registry.remove("p1")
    assert await raw.exists(key) == 0
    assert await raw.zscore(f"{registry_prefix}:members", "p1") is None


async def test_expired_member_is_pruned_from_index(
    redis_registry: RedisRegistry, raw: aioredis.Redis, registry_prefix: str
) -> None:
    await redis_registry.put(make_record("p1"), 0.2)
    assert await raw.zscore(f"{registry_prefix}:members", "p1") is not None

    async def expired() -> bool:
        return await redis_registry.snapshot() == []

    await eventually(expired, within=2.0, what="expiry")
    # The snapshot that found the key gone also dropped its index entry.
    assert await raw.zscore(f"{registry_prefix}:members", "p1") is None


async def test_corrupt_records_are_skipped_without_logging_them(
    redis_registry: RedisRegistry,
    raw: aioredis.Redis,
    registry_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    good = make_record("good")
    await redis_registry.put(good, 5.0)
    members = f"{registry_prefix}:members"
    far = time.time() * 1000 + 60_000
    secret = "s3cret-token-in-corrupt-value"
    bad = {
        "not-json": b'{"id": "not-json", ' + secret.encode(),
        "not-object": b"[1, 2]",
        "bad-role": orjson.dumps({"id": "bad-role", "role": "chef", "url": "u", "model": "m"}),
        "missing-field": orjson.dumps({"id": "missing-field", "role": "decode"}),
        "other-id": make_record("someone-else").to_json(),
    }
    for instance_id, value in bad.items():
        await raw.set(f"{registry_prefix}:instance:{instance_id}", value, px=60_000)
        await raw.zadd(members, {instance_id: far})

    with caplog.at_level(logging.WARNING, logger="pdgate.registry.redis"):
        assert await redis_registry.snapshot() == [good]
        assert await redis_registry.snapshot() == [good]
    warned = [r for r in caplog.records if "corrupt" in r.getMessage()]
    assert len(warned) == len(bad)  # once per record, not once per poll
    assert secret not in caplog.text


async def test_missing_key_dropped_from_index(
    redis_registry: RedisRegistry, raw: aioredis.Redis, registry_prefix: str
) -> None:
    members = f"{registry_prefix}:members"
    await raw.zadd(members, {"ghost": time.time() * 1000 + 60_000})  # e.g. evicted key
    await redis_registry.put(make_record("alive"), 5.0)
    assert [r.id for r in await redis_registry.snapshot()] == ["alive"]
    assert await raw.zscore(members, "ghost") is None
    assert await raw.zscore(members, "alive") is not None


async def test_snapshot_bounded_by_max_instances(
    redis_url: str, registry_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    reg = RedisRegistry(redis_url, key_prefix=registry_prefix, max_instances=3)
    try:
        for i in range(5):  # later ones expire later: "freshest" first
            await reg.put(make_record(f"i{i}"), 10.0 + i)
        with caplog.at_level(logging.WARNING, logger="pdgate.registry.redis"):
            snap = await reg.snapshot()
        assert sorted(r.id for r in snap) == ["i2", "i3", "i4"]
        assert "max_instances=3" in caplog.text
    finally:
        await reg.aclose()


async def test_malformed_events_are_ignored(
    redis_registry: RedisRegistry, raw: aioredis.Redis, registry_prefix: str
) -> None:
    stream = redis_registry.events()
    await stream.wait_subscribed()
    channel = f"{registry_prefix}:events"
    for junk in [
        b"not json",
        b"[]",
        orjson.dumps({"kind": "explode", "id": "x", "record": None}),
        orjson.dumps({"kind": "join", "id": "x", "record": None}),
        orjson.dumps({"kind": "join", "id": "x", "record": {"id": "y"}}),
        orjson.dumps({"kind": "leave", "id": 7}),
    ]:
        await raw.publish(channel, junk)
    await redis_registry.remove("real")
    event = await next_event(stream)
    assert (event.kind, event.instance_id) == (EventKind.LEAVE, "real")
    await stream.aclose()


async def test_unreachable_redis_raises_unavailable_without_password() -> None:
    url = f"redis://user:hunter2@127.0.0.1:{free_port()}/0"  # nothing listens there
    reg = RedisRegistry(url, key_prefix="pdgate-test", connect_timeout_s=0.3)
    try:
        for call in (reg.snapshot(), reg.put(make_record(), 1.0), reg.remove("x")):
            with pytest.raises(RegistryUnavailable) as info:
                await call
            assert "hunter2" not in str(info.value)
            assert isinstance(info.value.__cause__, Exception)
        with pytest.raises(RegistryUnavailable):
            await reg.events().wait_subscribed()
        assert "hunter2" not in repr(reg)
    finally:
        await reg.aclose()


async def test_event_stream_fails_when_server_stops(private_redis: RedisServer) -> None:
    reg = RedisRegistry(private_redis.url, key_prefix="t", connect_timeout_s=0.5)
    try:
        stream = reg.events()
        await stream.wait_subscribed()
        pending = asyncio.ensure_future(next_event(stream, within=5.0))
        await asyncio.sleep(0.05)
        await private_redis.astop()
        with pytest.raises(RegistryUnavailable):  # not next_event's own timeout
            await pending
        with pytest.raises(StopAsyncIteration):  # a failed stream stays ended
            await anext(stream)
    finally:
        await reg.aclose()


async def test_event_stream_detects_silent_server(private_redis: RedisServer) -> None:
    # CLIENT PAUSE makes the server hold every reply, like a half-open connection:
    # the stream must notice its PING going unanswered instead of waiting forever.
    reg = RedisRegistry(
        private_redis.url, key_prefix="t", connect_timeout_s=0.3, event_ping_interval_s=0.1
    )
    admin = aioredis.Redis.from_url(private_redis.url)
    try:
        stream = reg.events()
        await stream.wait_subscribed()
        await admin.client_pause(1500, all=True)
        # Its PING unanswered: after the pause the server would have answered it.
        with pytest.raises(RegistryUnavailable, match="PING"):
            await next_event(stream, within=3.0)
    finally:
        await admin.aclose()
        await reg.aclose()


async def test_commands_recover_after_restart(private_redis: RedisServer) -> None:
    reg = RedisRegistry(private_redis.url, key_prefix="t", connect_timeout_s=0.5)
    try:
        await reg.put(make_record("a"), 5.0)
        await private_redis.astop()
        with pytest.raises(RegistryUnavailable):
            await reg.snapshot()
        await private_redis.astart()
        assert await reg.snapshot() == []  # a new, empty server; pooled connections renewed
        await reg.put(make_record("a"), 5.0)
        assert [r.id for r in await reg.snapshot()] == ["a"]
    finally:
        await reg.aclose()


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://:pw@h:6379/0", "redis://***@h:6379/0"),
        ("rediss://user:pw@h/1", "rediss://***@h/1"),
        ("redis://h:6379", "redis://h:6379"),
        ("unix:///run/redis.sock?db=1&password=pw", "unix:///run/redis.sock?db=1&password=***"),
        ("redis://u:p@h/0?PASSWORD=pw&x=1#f", "redis://***@h/0?PASSWORD=***&x=1#f"),
        ("unix:///run/a@b.sock", "unix:///run/a@b.sock"),
        ("user:pw@h", "<redacted>"),
    ],
)
def test_redact_url(url: str, expected: str) -> None:
    assert redact_url(url) == expected


async def test_open_registry() -> None:
    assert isinstance(open_registry(RegistrySettings()), MemoryRegistry)
    assert isinstance(open_registry(RegistrySettings(url="")), MemoryRegistry)
    for url in ("redis://127.0.0.1:6379/0", "rediss://h:6380", "unix:///tmp/redis.sock"):
        reg = open_registry(RegistrySettings(url=url, key_prefix="x"))
        assert isinstance(reg, RedisRegistry)
        await reg.aclose()
    with pytest.raises(ValueError, match="unsupported scheme 'http'") as info:
        open_registry(RegistrySettings(url="http://u:topsecret@h:80"))
    assert "topsecret" not in str(info.value)
