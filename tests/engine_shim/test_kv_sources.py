"""Which prefills a decode may pull KV from (engine_shim/_kv_sources.py): the registered ones,
including one that registered a moment ago, and never a flood of registry reads for made-up
hosts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from pdgate.config import Role
from pdgate.engine_shim._kv_sources import KvSources, endpoint
from pdgate.registry.base import InstanceRecord, RegistryEvent
from pdgate.registry.memory import MemoryRegistry


class QuietRegistry(MemoryRegistry):
    """Publishes no events and counts snapshots: joins are seen only by reading it."""

    def __init__(self) -> None:
        super().__init__()
        self.snapshots = 0

    async def snapshot(self) -> list[InstanceRecord]:
        self.snapshots += 1
        return await super().snapshot()

    async def _no_events(self) -> AsyncIterator[RegistryEvent]:
        await asyncio.Event().wait()
        yield  # pragma: no cover

    def events(self) -> AsyncIterator[RegistryEvent]:  # type: ignore[override]
        return self._no_events()


def _record(port: int, role: Role = Role.PREFILL) -> InstanceRecord:
    return InstanceRecord(id=f"{role.value}-{port}", role=role, url=f"http://127.0.0.1:{port}",
                          model="m")  # fmt: skip


@pytest.fixture
async def quiet() -> AsyncIterator[tuple[QuietRegistry, KvSources]]:
    registry = QuietRegistry()
    # Polls far apart: only the read on a miss can see a new prefill in time.
    sources = KvSources(registry, poll_interval_s=60, max_instances=16, refresh_interval_s=0.2)
    await registry.put(_record(1000), ttl_s=60)
    await sources.start()
    yield registry, sources
    await sources.aclose()
    await registry.aclose()


def test_endpoints_are_normalised() -> None:
    assert endpoint("LocalHost", "8100") == ("localhost", 8100)
    assert endpoint("[::1]", 80) == ("::1", 80)
    assert endpoint("h", "x") is None
    assert endpoint("", 80) is None
    assert endpoint("h", 70000) is None


async def test_known_prefills_only(quiet: tuple[QuietRegistry, KvSources]) -> None:
    registry, sources = quiet
    assert await sources.allowed("127.0.0.1", 1000)
    assert await sources.allowed("127.0.0.1", "1000")
    assert not await sources.allowed("127.0.0.1", 1001)
    assert not await sources.allowed("10.0.0.1", 1000)
    await registry.put(_record(1002, Role.DECODE), ttl_s=60)
    assert not await sources.allowed("127.0.0.1", 1002)  # a decode holds no KV to pull


async def test_a_prefill_that_just_registered_is_found_by_reading_again(
    quiet: tuple[QuietRegistry, KvSources],
) -> None:
    registry, sources = quiet
    await registry.put(_record(2000), ttl_s=60)  # no event: the view does not know it yet
    assert not sources.known("127.0.0.1", 2000)
    assert await sources.allowed("127.0.0.1", 2000)


async def test_misses_share_reads_at_a_bounded_rate(
    quiet: tuple[QuietRegistry, KvSources],
) -> None:
    registry, sources = quiet
    before = registry.snapshots
    loop = asyncio.get_running_loop()
    started = loop.time()
    results = await asyncio.gather(*(sources.allowed("10.9.9.9", p) for p in range(1, 201)))
    assert not any(results)
    assert registry.snapshots - before == 1  # 200 made-up hosts, one read
    results = await asyncio.gather(*(sources.allowed("10.9.9.9", p) for p in range(1, 51)))
    assert registry.snapshots - before == 2
    assert loop.time() - started >= 0.2  # the second read waited out the interval
