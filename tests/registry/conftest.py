from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from pdgate.registry import MemoryRegistry, RedisRegistry, Registry
from tests.registry._stock_server import StockServer


@pytest.fixture
async def redis_registry(redis_url: str, registry_prefix: str) -> AsyncIterator[RedisRegistry]:
    reg = RedisRegistry(redis_url, key_prefix=registry_prefix, connect_timeout_s=0.5)
    yield reg
    await reg.aclose()


@pytest.fixture(params=["memory", "redis"])
async def any_registry(request: pytest.FixtureRequest) -> AsyncIterator[Registry]:
    """Each test runs against both implementations: they promise the same behaviour."""
    if request.param == "memory":
        reg: Registry = MemoryRegistry()
    else:
        reg = RedisRegistry(
            request.getfixturevalue("redis_url"),
            key_prefix=request.getfixturevalue("registry_prefix"),
            connect_timeout_s=0.5,
        )
    yield reg
    await reg.aclose()


@pytest.fixture
def servers() -> Iterator[list[StockServer]]:
    """Stock servers a test started (append them); killed afterwards whatever happened."""
    started: list[StockServer] = []
    yield started
    for server in started:
        server.kill()
