"""The shared asyncio helpers: back-off and the abandoned-result hand-off."""

from __future__ import annotations

import asyncio
import random

import pytest

from pdgate.config.aio import Background, ExponentialBackoff, run_unless


def test_exponential_backoff_grows_caps_and_jitters() -> None:
    b = ExponentialBackoff(0.01, 0.08, jitter=0.0)
    assert [b.delay(i) for i in range(6)] == [0.01, 0.02, 0.04, 0.08, 0.08, 0.08]
    j = ExponentialBackoff(0.01, 1.0, jitter=0.5, rng=random.Random(1))
    delays = [j.delay(3) for _ in range(50)]
    assert all(0.04 <= d <= 0.08 for d in delays)
    assert len(set(delays)) > 1
    with pytest.raises(ValueError, match="initial"):
        ExponentialBackoff(0.0, 1.0)


class _Held:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


async def test_run_unless_closes_a_result_that_lands_as_the_caller_leaves() -> None:
    """The race of the correctness issue: the work finished, and the caller is cancelled before
    it resumed to take the result. Nobody will take it, so it must be closed, not dropped."""
    held = _Held()
    finished = False

    async def work() -> _Held:
        nonlocal finished
        finished = True
        return held

    gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    caller = asyncio.ensure_future(run_unless(work(), gone, lost=RuntimeError("gone")))
    await asyncio.sleep(0)  # the caller starts the work and waits for it
    await asyncio.sleep(0)  # the work returns; the caller's wake-up is queued behind us
    assert finished and not caller.done()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert held.closed


async def test_run_unless_lets_the_work_unwind_before_the_caller_is_cancelled() -> None:
    unwound = asyncio.Event()
    started = asyncio.Event()

    async def work() -> None:
        started.set()
        try:
            await asyncio.sleep(10)
        finally:
            await asyncio.sleep(0)  # unwinding takes a while
            unwound.set()

    gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    caller = asyncio.ensure_future(run_unless(work(), gone, lost=RuntimeError("gone")))
    await started.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert unwound.is_set()
    assert not gone.done()


async def test_run_unless_raises_lost_and_unwinds_the_work_when_gone_first() -> None:
    unwound = asyncio.Event()

    async def work() -> None:
        try:
            await asyncio.sleep(10)
        finally:
            unwound.set()

    gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    gone.set_result(None)
    with pytest.raises(LookupError):
        await run_unless(work(), gone, lost=LookupError())
    assert unwound.is_set()


async def test_run_unless_raises_lost_when_gone_fires_while_the_work_runs() -> None:
    held = _Held()
    gate = asyncio.Event()

    async def work() -> _Held:
        try:
            await gate.wait()
        except asyncio.CancelledError:
            return held  # it swallows the cancellation: its result still has no taker
        raise AssertionError("the work was not cancelled")

    gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    caller = asyncio.ensure_future(run_unless(work(), gone, lost=LookupError()))
    await asyncio.sleep(0)
    gone.set_result(None)
    with pytest.raises(LookupError):
        await caller
    assert held.closed


async def test_a_clean_up_dropped_past_the_bound_gives_back_what_it_held() -> None:
    """Past its bound a clean-up is dropped without a line of it run (its ``finally``
    neither), so what it holds goes back through `dropped`; one within the bound runs."""
    background = Background("test", limit=1)
    ran: list[str] = []
    gate = asyncio.Event()

    async def clean_up(name: str) -> None:
        try:
            await gate.wait()
        finally:
            ran.append(name)

    background.spawn(clean_up("first"), dropped=lambda: ran.append("first dropped"))
    background.spawn(clean_up("second"), dropped=lambda: ran.append("second dropped"))
    assert ran == ["second dropped"] and len(background) == 1
    gate.set()
    await background.aclose()
    assert ran == ["second dropped", "first"]
