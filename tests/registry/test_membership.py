"""Membership: the gateway's view, fed by pub/sub (fast) and polling (truth)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping

import pytest

from pdgate.config.aio import ExponentialBackoff
from pdgate.registry import (
    Heartbeat,
    InstanceRecord,
    InstanceState,
    Membership,
    MemoryRegistry,
    RedisRegistry,
    Registry,
)
from tests._redis import RedisServer
from tests.registry._util import eventually, make_record

FAST = ExponentialBackoff(0.02, 0.1)


class Changes:
    """A listener recording (ids in view, departed ids) per call."""

    def __init__(self) -> None:
        self.calls: list[tuple[set[str], set[str]]] = []

    def __call__(self, view: Mapping[str, InstanceRecord], departed: set[str]) -> None:
        self.calls.append((set(view), departed))

    @property
    def departed(self) -> set[str]:
        return set().union(*(d for _, d in self.calls))


class GatedSnapshotRegistry(MemoryRegistry):
    """Snapshots are read at once but returned only when the test opens the gate,
    like a slow poll whose answer is already stale when it arrives."""

    def __init__(self) -> None:
        super().__init__()
        self.gate: asyncio.Event | None = None
        self.read = asyncio.Event()

    async def snapshot(self) -> list[InstanceRecord]:
        records = await super().snapshot()
        self.read.set()
        if self.gate is not None:
            await self.gate.wait()
        return records


@pytest.fixture
async def started() -> AsyncIterator[list[Membership]]:
    """Memberships registered here are stopped after the test."""
    memberships: list[Membership] = []
    yield memberships
    for m in memberships:
        await m.stop()


async def test_join_seen_via_pubsub_before_any_poll(
    redis_url: str, registry_prefix: str, started: list[Membership]
) -> None:
    gateway_side = RedisRegistry(redis_url, key_prefix=registry_prefix, connect_timeout_s=0.5)
    instance_side = RedisRegistry(redis_url, key_prefix=registry_prefix, connect_timeout_s=0.5)
    m = Membership(gateway_side, poll_interval_s=30)  # only pub/sub can be that quick
    started.append(m)
    hb = Heartbeat(instance_side, make_record("p1"), interval_s=5, ttl_s=15)
    try:
        await m.start()
        assert m.healthy
        assert m.instances() == {}
        version = m.version

        await hb.start()
        assert await m.wait_changed(1.0, since=version)
        assert set(m.instances()) == {"p1"}

        # A state change is pushed the same way.
        version = m.version
        await hb.set_state(InstanceState.DRAINING)
        assert await m.wait_changed(1.0, since=version)
        assert m.instances()["p1"].state is InstanceState.DRAINING

        # And so is a clean leave.
        version = m.version
        await hb.stop()
        assert await m.wait_changed(1.0, since=version)
        assert m.instances() == {}
    finally:
        await hb.stop()
        await m.stop()
        await gateway_side.aclose()
        await instance_side.aclose()


async def test_expiry_seen_via_polling(any_registry: Registry, started: list[Membership]) -> None:
    m = Membership(any_registry, poll_interval_s=0.1)
    started.append(m)
    changes = Changes()
    m.add_listener(changes)
    await any_registry.put(make_record("killed"), 0.3)  # then kill -9: no LEAVE ever comes
    await any_registry.put(make_record("alive"), 30.0)
    await m.start()
    assert set(m.instances()) == {"killed", "alive"}

    await eventually(lambda: "killed" not in m.instances(), within=2.0, what="expiry")
    assert set(m.instances()) == {"alive"}
    assert changes.calls[-1] == ({"alive"}, {"killed"})
    assert m.healthy


async def test_listener_and_version(started: list[Membership]) -> None:
    reg = MemoryRegistry()
    m = Membership(reg, poll_interval_s=30)
    started.append(m)
    changes = Changes()
    m.add_listener(changes)
    await m.start()
    assert m.version == 0  # an empty registry is no change

    await reg.put(make_record("a"), 30, announce=True)
    await eventually(lambda: "a" in m.instances(), what="join")
    assert m.version == 1
    assert changes.calls == [({"a"}, set())]

    await reg.put(make_record("a"), 30, announce=True)  # same record: nothing changed
    await reg.put(make_record("b"), 30, announce=True)
    await eventually(lambda: "b" in m.instances(), what="join b")
    assert m.version == 2

    view_before = m.instances()
    await reg.remove("a")
    await eventually(lambda: "a" not in m.instances(), what="leave")
    assert changes.calls[-1] == ({"b"}, {"a"})
    assert set(view_before) == {"a", "b"}  # published views are never mutated
    with pytest.raises(TypeError):
        view_before["x"] = make_record("x")  # type: ignore[index]

    m.remove_listener(changes)
    await reg.remove("b")
    await eventually(lambda: not m.instances(), what="leave b")
    assert len(changes.calls) == 3


async def test_wait_changed(started: list[Membership]) -> None:
    reg = MemoryRegistry()
    m = Membership(reg, poll_interval_s=30)
    started.append(m)
    await m.start()
    assert await m.wait_changed(0.05) is False
    version = m.version
    await reg.put(make_record("a"), 30, announce=True)
    await asyncio.sleep(0.05)  # the change happens before we start waiting...
    assert await m.wait_changed(0.05, since=version)  # ...and still counts with `since`
    waiter = asyncio.ensure_future(m.wait_changed(2.0))
    await asyncio.sleep(0.01)
    await reg.remove("a")
    assert await waiter


async def test_listener_errors_do_not_break_membership(
    started: list[Membership], caplog: pytest.LogCaptureFixture
) -> None:
    reg = MemoryRegistry()
    m = Membership(reg, poll_interval_s=30)
    started.append(m)

    def broken(view: Mapping[str, InstanceRecord], departed: set[str]) -> None:
        raise RuntimeError("listener bug")

    changes = Changes()
    m.add_listener(broken)
    m.add_listener(changes)
    await m.start()
    await reg.put(make_record("a"), 30, announce=True)
    await eventually(lambda: bool(changes.calls), what="second listener called")
    assert "listener bug" in caplog.text


async def test_bounded_by_max_instances(started: list[Membership]) -> None:
    reg = MemoryRegistry()
    for i in range(3):
        await reg.put(make_record(f"i{i}"), 30)
    m = Membership(reg, poll_interval_s=30, max_instances=2)
    started.append(m)
    await m.start()
    assert len(m.instances()) == 2
    await reg.put(make_record("late"), 30, announce=True)
    await asyncio.sleep(0.05)
    assert len(m.instances()) == 2 and "late" not in m.instances()


async def test_stale_poll_does_not_undo_a_leave(started: list[Membership]) -> None:
    reg = GatedSnapshotRegistry()
    await reg.put(make_record("a"), 30)
    await reg.put(make_record("b"), 30)
    m = Membership(reg, poll_interval_s=0.05)
    started.append(m)
    await m.start()
    assert set(m.instances()) == {"a", "b"}

    reg.gate = asyncio.Event()
    reg.read.clear()
    await asyncio.wait_for(reg.read.wait(), 2.0)  # a poll has read {a, b} and is held
    await reg.remove("a")
    await eventually(lambda: "a" not in m.instances(), what="leave applied")
    reg.gate.set()  # the stale {a, b} arrives
    version = m.version
    await m.wait_changed(0.2, since=version)
    assert set(m.instances()) == {"b"}


async def test_resubscribes_and_repolls_after_falling_behind(started: list[Membership]) -> None:
    reg = MemoryRegistry(queue_size=2)
    m = Membership(reg, poll_interval_s=30, backoff=FAST)
    started.append(m)
    await m.start()
    # Five announcements without yielding: more than the queue holds, so the membership's
    # subscription is dropped mid-burst and only a re-poll can catch up.
    for i in range(5):
        await reg.put(make_record(f"i{i}"), 30, announce=True)
    await reg.put(make_record("silent"), 30)  # never announced at all
    await eventually(lambda: len(m.instances()) == 6, within=2.0, what="re-poll")
    assert m.healthy


async def test_start_with_registry_down_then_recover(
    private_redis: RedisServer, started: list[Membership], caplog: pytest.LogCaptureFixture
) -> None:
    await private_redis.astop()
    reg = RedisRegistry(private_redis.url, key_prefix="t", connect_timeout_s=0.3)
    writer = RedisRegistry(private_redis.url, key_prefix="t", connect_timeout_s=0.3)
    m = Membership(reg, poll_interval_s=30, backoff=FAST)
    started.append(m)
    try:
        with caplog.at_level(logging.WARNING, logger="pdgate.registry.membership"):
            await m.start()  # must not raise
        assert not m.healthy
        assert m.instances() == {}
        assert caplog.text.count("registry unreachable") == 1

        await private_redis.astart()
        await eventually(lambda: m.healthy, within=3.0, what="healthy")
        await writer.put(make_record("p1"), 30, announce=True)
        await eventually(lambda: "p1" in m.instances(), within=1.0, what="join")
    finally:
        await m.stop()
        await reg.aclose()
        await writer.aclose()


async def test_redis_outage_keeps_view_and_recovers(
    private_redis: RedisServer, started: list[Membership], caplog: pytest.LogCaptureFixture
) -> None:
    reg = RedisRegistry(private_redis.url, key_prefix="t", connect_timeout_s=0.3)
    instance_side = RedisRegistry(private_redis.url, key_prefix="t", connect_timeout_s=0.3)
    m = Membership(reg, poll_interval_s=30, backoff=FAST)  # joins below: pub/sub only
    started.append(m)
    changes = Changes()
    m.add_listener(changes)
    hb = Heartbeat(instance_side, make_record("p1"), interval_s=0.2, ttl_s=0.6)
    try:
        await m.start()
        await hb.start()
        await eventually(lambda: "p1" in m.instances(), within=1.0, what="join")

        with caplog.at_level(logging.INFO, logger="pdgate.registry.membership"):
            await private_redis.astop()
            await eventually(lambda: not m.healthy, within=2.0, what="outage noticed")
            await asyncio.sleep(0.3)  # several failed reconnects and polls
            assert set(m.instances()) == {"p1"}  # the last view is kept
            assert not changes.departed

            await private_redis.astart()
            await eventually(lambda: m.healthy, within=3.0, what="recovered")
        assert caplog.text.count("registry unreachable") == 1  # once per outage
        assert "reachable again" in caplog.text

        version = m.version
        await instance_side.put(make_record("p2"), 30, announce=True)
        await eventually(lambda: "p2" in m.instances(), within=1.0, what="new join")
        assert m.version > version
    finally:
        await hb.stop()
        await m.stop()
        await reg.aclose()
        await instance_side.aclose()


async def test_view_kept_across_failed_polls(
    private_redis: RedisServer, started: list[Membership]
) -> None:
    reg = RedisRegistry(private_redis.url, key_prefix="t", connect_timeout_s=0.3)
    m = Membership(reg, poll_interval_s=0.05, backoff=FAST)
    started.append(m)
    try:
        await reg.put(make_record("p1"), 30)
        await m.start()
        assert set(m.instances()) == {"p1"}
        await private_redis.astop()
        await eventually(lambda: not m.healthy, within=2.0, what="outage noticed")
        await asyncio.sleep(0.5)  # ten poll intervals
        assert set(m.instances()) == {"p1"}
        await private_redis.astart()  # empty now: the truth is "nobody"
        await eventually(lambda: m.healthy and not m.instances(), within=3.0, what="re-poll")
    finally:
        await m.stop()
        await reg.aclose()


async def test_what_a_redis_restarted_empty_forgot_is_held_until_it_registers_again(
    private_redis: RedisServer, started: list[Membership]
) -> None:
    """An empty Redis after a restart is lost state, not every instance leaving: read as
    departures, a gateway answered 503 until the shims' next heartbeats. For `hold_s` (the
    record TTL) the forgotten instances stay; one that registers again stays for good, one
    that does not is gone after the hold, and one that leaves meanwhile leaves at once."""
    reg = RedisRegistry(private_redis.url, key_prefix="t", connect_timeout_s=0.3)
    m = Membership(reg, poll_interval_s=0.05, backoff=FAST, hold_s=1.0)
    started.append(m)
    changes = Changes()
    m.add_listener(changes)
    try:
        for i in (1, 2, 3):
            await reg.put(make_record(f"p{i}"), 30)
        await m.start()
        assert set(m.instances()) == {"p1", "p2", "p3"}
        before = reg.generation()
        assert before is not None
        await private_redis.astop()
        await private_redis.astart()  # empty
        await eventually(lambda: reg.generation() not in (None, before), within=3.0,
                         what="the new generation read")  # fmt: skip
        assert set(m.instances()) == {"p1", "p2", "p3"} and not changes.departed
        # A leave is an event (a poll cannot tell it from what the restart forgot): wait
        # until the membership has subscribed again.
        await eventually(lambda: m.healthy, within=3.0, what="subscribed again")
        await reg.put(make_record("p1"), 30, announce=True)  # its next heartbeat
        await reg.remove("p3")  # leaves: at once, hold or not
        await eventually(lambda: "p3" not in m.instances(), within=1.0, what="p3 left")
        assert "p2" in m.instances()
        await eventually(lambda: set(m.instances()) == {"p1"}, within=2.0, what="hold over")
        assert changes.departed == {"p2", "p3"}
    finally:
        await m.stop()
        await reg.aclose()


async def test_records_that_expired_during_an_outage_are_held_until_they_register_again(
    private_redis: RedisServer, started: list[Membership]
) -> None:
    """A Redis unreachable for longer than the records' TTL (a Sentinel failover, a stopped
    server) comes back with the same contents' name but the records expired: nobody could
    write them again. Read as departures, a gateway answered 503 until the instances' next
    heartbeats; for `hold_s` they stay, and one that does not come back is gone after it."""
    import os
    import signal

    reg = RedisRegistry(private_redis.url, key_prefix="t", connect_timeout_s=0.2)
    m = Membership(reg, poll_interval_s=0.05, backoff=FAST, hold_s=1.0)
    started.append(m)
    try:
        await reg.put(make_record("p1"), 0.5)
        await reg.put(make_record("p2"), 0.5)
        await m.start()
        assert set(m.instances()) == {"p1", "p2"}
        pid = private_redis._proc.pid  # type: ignore[union-attr]
        os.kill(pid, signal.SIGSTOP)
        try:
            await eventually(lambda: not m.healthy, within=2.0, what="outage noticed")
            await asyncio.sleep(0.6)  # past the records' TTL
        finally:
            os.kill(pid, signal.SIGCONT)
        await eventually(lambda: m.healthy, within=3.0, what="polls again")
        assert set(m.instances()) == {"p1", "p2"}  # expired, not departed
        await reg.put(make_record("p1"), 30, announce=True)  # its heartbeat after the outage
        await eventually(lambda: set(m.instances()) == {"p1"}, within=2.0, what="hold over")
    finally:
        await m.stop()
        await reg.aclose()


async def test_a_redis_emptied_between_the_index_and_the_records_reads_as_lost(
    private_redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A snapshot reads the index, then the records. Emptied in between, it once answered
    "nobody" under the old generation: the membership dropped every instance at once and,
    at its next poll, had nothing left to hold while they registered again."""
    import redis.asyncio as aioredis

    reg = RedisRegistry(private_redis.url, key_prefix="t", connect_timeout_s=0.3)
    admin = aioredis.Redis.from_url(private_redis.url)
    try:
        await reg.put(make_record("p1"), 30)
        assert [r.id for r in await reg.snapshot()] == ["p1"]
        before = reg.generation()
        client = reg._client
        opened = client.pipeline
        calls = 0

        def pipeline(*args: object, **kwargs: object) -> object:
            nonlocal calls
            calls += 1
            pipe = opened(*args, **kwargs)  # type: ignore[arg-type]
            if calls == 2:  # the records' read: the Redis is emptied just before it
                execute = pipe.execute

                async def flushed_then_execute(*a: object, **k: object) -> object:
                    await admin.flushall()
                    return await execute(*a, **k)  # type: ignore[arg-type]

                pipe.execute = flushed_then_execute  # type: ignore[method-assign]
            return pipe

        monkeypatch.setattr(client, "pipeline", pipeline)
        assert await reg.snapshot() == []
        assert calls == 2
        assert reg.generation() not in (None, before)
    finally:
        await admin.aclose()
        await reg.aclose()
