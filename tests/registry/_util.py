"""Helpers for the registry tests."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from pdgate.config import Role
from pdgate.registry import EventStream, InstanceRecord, InstanceState, Registry, RegistryEvent


def make_record(
    instance_id: str = "prefill-1",
    *,
    role: Role = Role.PREFILL,
    state: InstanceState = InstanceState.READY,
    capacity: int = 8,
) -> InstanceRecord:
    return InstanceRecord(
        id=instance_id,
        role=role,
        url=f"http://{instance_id}.test:8100",
        model="sim-llama-3.1-8b",
        capacity=capacity,
        state=state,
        version="test",
        started_at=1_700_000_000.0,
    )


async def eventually(
    predicate: Callable[[], bool | Awaitable[bool]],
    *,
    within: float = 3.0,
    interval: float = 0.01,
    what: str = "condition",
) -> float:
    """Poll `predicate` until true; returns the seconds it took, fails after `timeout`."""
    start = time.monotonic()
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return time.monotonic() - start
        if time.monotonic() - start > within:
            raise AssertionError(f"{what} not reached within {within}s")
        await asyncio.sleep(interval)


async def next_event(stream: AsyncIterator[RegistryEvent], within: float = 2.0) -> RegistryEvent:
    async with asyncio.timeout(within):
        return await anext(stream)


async def no_event(stream: AsyncIterator[RegistryEvent], within: float) -> None:
    """Assert nothing arrives on `stream` for `within` seconds."""
    try:
        async with asyncio.timeout(within):
            event = await anext(stream)
    except TimeoutError:
        return
    raise AssertionError(f"unexpected event {event}")


@contextlib.asynccontextmanager
async def subscribed(registry: Registry) -> AsyncIterator[EventStream]:
    """`registry`'s event stream once its subscription is live; closed at the end."""
    stream = registry.events()
    assert isinstance(stream, EventStream)
    try:
        await stream.wait_subscribed()
        yield stream
    finally:
        await stream.aclose()
