"""The shared asyncio helpers: back-off and the abandoned-result hand-off."""

from __future__ import annotations

import asyncio
import random

import pytest

from pdgate.config.aio import ExponentialBackoff, run_unless


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
    """The race of the correctness issue: the work finishes in the same loop iteration as the
    caller is cancelled. Nobody will take the result, so it must be closed, not dropped."""
    held = _Held()
    gate = asyncio.Event()

    async def work() -> _Held:
        await gate.wait()
        return held

    gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    caller = asyncio.ensure_future(run_unless(work(), gone, lost=RuntimeError("gone")))
    await asyncio.sleep(0)
    gate.set()  # the work's result is ready at the next iteration...
    caller.cancel()  # ...and the caller is cancelled in this one
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert held.closed


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
