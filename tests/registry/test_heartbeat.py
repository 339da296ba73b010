"""Heartbeat: keeps a record alive, deregisters on stop, rides out registry outages."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from pdgate.registry import (
    EventKind,
    Heartbeat,
    InstanceRecord,
    InstanceState,
    MemoryRegistry,
    RedisRegistry,
    Registry,
    RegistryUnavailable,
)
from tests._redis import RedisServer
from tests.registry._util import eventually, make_record, next_event, subscribed


class FlakyRegistry(MemoryRegistry):
    """A real MemoryRegistry that can be switched "down", recording every put."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.puts: list[tuple[InstanceRecord, bool]] = []  # successful ones

    async def put(self, record: InstanceRecord, ttl_s: float, *, announce: bool = False) -> None:
        if self.down:
            raise RegistryUnavailable("switched off by the test")
        await super().put(record, ttl_s, announce=announce)
        self.puts.append((record, announce))


class HangingRemoveRegistry(MemoryRegistry):
    async def remove(self, instance_id: str) -> None:
        await asyncio.Event().wait()


class SwallowsCancelRegistry(MemoryRegistry):
    """put() swallows a cancellation, as redis-py does on Python 3.11 when one lands just
    as `asyncio.wait_for` completes."""

    def __init__(self) -> None:
        super().__init__()
        self.in_put = asyncio.Event()
        self.swallowed = 0

    async def put(self, record: InstanceRecord, ttl_s: float, *, announce: bool = False) -> None:
        self.in_put.set()
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            self.swallowed += 1
        await super().put(record, ttl_s, announce=announce)


async def ids(registry: Registry) -> set[str]:
    return {r.id for r in await registry.snapshot()}


async def test_keeps_record_alive_and_stop_deregisters(any_registry: Registry) -> None:
    async with subscribed(any_registry) as stream:
        hb = Heartbeat(any_registry, make_record("p1"), interval_s=0.1, ttl_s=0.3)
        await hb.start()
        assert hb.registered
        event = await next_event(stream)
        assert (event.kind, event.instance_id) == (EventKind.JOIN, "p1")

        deadline = time.monotonic() + 0.9  # three TTLs
        while time.monotonic() < deadline:
            assert await ids(any_registry) == {"p1"}
            await asyncio.sleep(0.05)

        await hb.stop()
        assert await ids(any_registry) == set()  # gone at once, not after the TTL
        event = await next_event(stream)
        assert (event.kind, event.instance_id) == (EventKind.LEAVE, "p1")
        assert not hb.registered
        await hb.stop()  # idempotent


async def test_set_state_is_announced(any_registry: Registry) -> None:
    async with subscribed(any_registry) as stream:
        hb = Heartbeat(any_registry, make_record("p1"), interval_s=5.0, ttl_s=15.0)
        await hb.start()
        await next_event(stream)  # the initial JOIN
        await hb.set_state(InstanceState.DRAINING)
        assert hb.record.state is InstanceState.DRAINING
        event = await next_event(stream)
        assert event.kind is EventKind.JOIN
        assert event.record is not None
        assert event.record.state is InstanceState.DRAINING
        assert [r.state for r in await any_registry.snapshot()] == [InstanceState.DRAINING]
        await hb.stop()


async def test_outage_logged_once_and_first_success_announced(
    caplog: pytest.LogCaptureFixture,
) -> None:
    reg = FlakyRegistry()
    hb = Heartbeat(reg, make_record("p1"), interval_s=0.05, ttl_s=0.5)
    with caplog.at_level(logging.DEBUG, logger="pdgate.registry.heartbeat"):
        await hb.start()
        await eventually(lambda: len(reg.puts) >= 3, what="refreshes")
        assert [announce for _, announce in reg.puts[:3]] == [True, False, False]

        reg.down = True
        await asyncio.sleep(0.4)  # several failed beats
        assert not hb.registered
        reg.down = False
        count = len(reg.puts)
        await eventually(lambda: len(reg.puts) > count + 1, what="recovery")
        # The first put after the outage announces (gateways learn at once), later ones not.
        assert [announce for _, announce in reg.puts[count : count + 2]] == [True, False]
        assert hb.registered
        await hb.stop()

    failures = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(failures) == 1, [r.getMessage() for r in failures]
    assert "p1" in failures[0].getMessage()
    assert any("restored" in r.getMessage() for r in caplog.records)


async def test_start_tolerates_a_down_registry(caplog: pytest.LogCaptureFixture) -> None:
    reg = FlakyRegistry()
    reg.down = True
    hb = Heartbeat(reg, make_record("p1"), interval_s=0.05, ttl_s=0.5)
    with caplog.at_level(logging.WARNING, logger="pdgate.registry.heartbeat"):
        await hb.start()  # must not raise
    assert not hb.registered
    assert "retrying" in caplog.text
    reg.down = False
    await eventually(lambda: bool(reg.puts), what="registration")
    assert reg.puts[0][1] is True
    await hb.stop()


async def test_state_change_during_outage_announced_later() -> None:
    reg = FlakyRegistry()
    hb = Heartbeat(reg, make_record("p1"), interval_s=0.05, ttl_s=0.5)
    await hb.start()
    reg.down = True
    await hb.set_state(InstanceState.DRAINING)  # fails quietly
    reg.down = False
    await eventually(
        lambda: any(r.state is InstanceState.DRAINING and a for r, a in reg.puts),
        what="draining announced",
    )
    await hb.stop()


async def test_an_updated_record_is_announced_once_and_keeps_the_state() -> None:
    from dataclasses import replace

    reg = FlakyRegistry()
    hb = Heartbeat(reg, make_record("p1"), interval_s=10, ttl_s=30)
    await hb.start()
    await hb.set_state(InstanceState.DRAINING)
    served = replace(make_record("p1"), adapters=("m-lora",), max_model_len=2048)
    before = len(reg.puts)
    await hb.update(served)  # announced at once, still draining
    record, announced = reg.puts[-1]
    assert announced and record.adapters == ("m-lora",) and record.max_model_len == 2048
    assert record.state is InstanceState.DRAINING
    await hb.update(served)  # nothing changed: nothing written
    assert len(reg.puts) == before + 1
    with pytest.raises(ValueError, match="one instance id"):
        await hb.update(make_record("p2"))
    await hb.stop()


async def test_stop_is_bounded_when_remove_hangs() -> None:
    reg = HangingRemoveRegistry()
    hb = Heartbeat(reg, make_record("p1"), interval_s=0.05, ttl_s=0.5, stop_timeout_s=0.2)
    await hb.start()
    await hb.stop()  # the remove given up after stop_timeout_s: it would hang forever


async def test_stop_survives_a_swallowed_cancellation() -> None:
    reg = SwallowsCancelRegistry()
    hb = Heartbeat(reg, make_record("p1"), interval_s=0.1, ttl_s=1.0)
    await hb.start()
    reg.in_put.clear()
    await asyncio.wait_for(reg.in_put.wait(), 2.0)  # the loop is inside put() now
    async with asyncio.timeout(2.0):
        await hb.stop()
    assert reg.swallowed == 1
    assert await ids(reg) == set()


async def test_stop_without_start_and_bad_intervals() -> None:
    reg = MemoryRegistry()
    stream = reg.events()
    await Heartbeat(reg, make_record(), interval_s=1, ttl_s=3).stop()
    await reg.put(make_record("marker"), 1.0, announce=True)
    assert (await next_event(stream)).instance_id == "marker"  # no LEAVE was published
    with pytest.raises(ValueError, match="interval_s"):
        Heartbeat(reg, make_record(), interval_s=1, ttl_s=1)


async def test_reannounces_after_redis_restart(private_redis: RedisServer) -> None:
    interval = 0.2
    instance = RedisRegistry(private_redis.url, key_prefix="t", connect_timeout_s=0.5)
    observer = RedisRegistry(private_redis.url, key_prefix="t", connect_timeout_s=0.5)
    hb = Heartbeat(instance, make_record("p1"), interval_s=interval, ttl_s=3 * interval)
    try:
        await hb.start()
        assert await ids(observer) == {"p1"}

        await private_redis.astop()
        await eventually(lambda: not hb.registered, within=2.0, what="outage noticed")
        await private_redis.astart()  # same port, empty

        async def back() -> bool:
            return await ids(observer) == {"p1"}

        await eventually(back, within=3.0, what="record back")
        # (That it comes back announced is covered by the FlakyRegistry test above and by
        # the Membership restart test: observing it here would race the re-subscription.)
    finally:
        await hb.stop()
        await instance.aclose()
        await observer.aclose()
