"""Asyncio helpers every pdgate process shares: back-off, cancellation, hand-offs.

Neutral ground (nothing of pdgate's is imported). The hand-off rule they implement, used
everywhere a result can be abandoned: **whoever abandons a result closes it**. A task that
finished just as its caller gave up (a prefill grant, an open decode stream, a slot) would
otherwise hold its counts and connections for ever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, Protocol, TypeVar, runtime_checkable

from starlette.types import Receive

__all__ = [
    "Background",
    "Backoff",
    "Closeable",
    "ConstantBackoff",
    "ExponentialBackoff",
    "cancel_and_wait",
    "close_abandoned",
    "finish_or_cancel",
    "run_unless",
    "shielded",
    "wait_disconnect",
]

T = TypeVar("T")
log = logging.getLogger("pdgate.aio")


# -- back-off ------------------------------------------------------------------------------


class Backoff(Protocol):
    def delay(self, attempt: int) -> float:
        """Seconds to wait after round `attempt` (0-based) that found nothing to do."""
        ...


class ExponentialBackoff:
    """``initial * 2**attempt`` capped at ``maximum``, with a fraction ``jitter`` randomised.

    Jitter keeps many waiting requests (and several gateways) from retrying in lock-step
    against the same instance the moment it frees a slot.
    """

    def __init__(
        self, initial: float, maximum: float, jitter: float = 0.5, rng: random.Random | None = None
    ) -> None:
        if initial <= 0 or maximum < initial:
            raise ValueError("need 0 < initial <= maximum")
        if not 0 <= jitter <= 1:
            raise ValueError("jitter must be within [0, 1]")
        self._initial = initial
        self._maximum = maximum
        self._jitter = jitter
        self._rng = rng or random.Random()

    def delay(self, attempt: int) -> float:
        base: float = min(self._maximum, self._initial * 2.0 ** min(max(attempt, 0), 32))
        return base * (1 - self._jitter * self._rng.random())


class ConstantBackoff:
    def __init__(self, seconds: float) -> None:
        self._seconds = seconds

    def delay(self, attempt: int) -> float:
        return self._seconds


# -- cancellation and hand-offs ------------------------------------------------------------


@runtime_checkable
class Closeable(Protocol):
    """A result that holds something (counts, a connection, a slot) until closed."""

    def close(self) -> None: ...


def close_abandoned(task: asyncio.Future[Any]) -> None:
    """`task` is over and nobody will take its result: close the result if it holds anything
    and retrieve any exception (so none is logged as "never retrieved")."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        return
    result = task.result()
    if isinstance(result, Closeable):
        result.close()


async def run_unless(work: Awaitable[T], gone: asyncio.Future[Any], *, lost: Exception) -> T:
    """Await `work` unless `gone` (e.g. a disconnect watcher) finishes first; then cancel the
    work, let it unwind, and raise `lost`. If the caller is cancelled, the work is cancelled
    and unwinds before the cancellation propagates. A result that arrives when nobody will
    take it is closed.

    A second cancellation of the caller while the work unwinds reaches the work too, so the
    work's clean-up must not await (pdgate's is `close()`, not an await)."""
    task = asyncio.ensure_future(work)
    left = False

    def on_gone(_: asyncio.Future[Any]) -> None:
        nonlocal left
        if not task.done():
            left = True
            task.cancel()

    # A callback and a plain await instead of `asyncio.wait` on both (a future, a set and four
    # callbacks, on every request): awaiting a task passes the
    # caller's cancellation on to it, and the caller wakes only once the task is done.
    gone.add_done_callback(on_gone)
    try:
        result = await task
    except asyncio.CancelledError:
        close_abandoned(task)
        current = asyncio.current_task()
        if left and (current is None or not current.cancelling()):
            raise lost from None
        raise
    finally:
        gone.remove_done_callback(on_gone)
    if left:  # the work swallowed its cancellation: its result has no taker
        close_abandoned(task)
        raise lost
    return result


async def wait_disconnect(receive: Receive) -> None:
    """Return when the ASGI client disconnects (call it only after the body was read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def shielded(coro: Awaitable[None]) -> None:
    """Run `coro` to its end even if the caller is cancelled meanwhile (clean-up calls that
    must reach an instance, e.g. releasing KV). The caller's cancellation is swallowed:
    use it only at the end of an unwinding path."""
    task = asyncio.ensure_future(coro)
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.shield(task)


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]], *, retry_s: float = 0.05) -> None:
    """Cancel `tasks` and return once all have ended.

    One cancel() is not always enough: on Python 3.11, `asyncio.wait_for` (which redis-py
    wraps every socket write in) drops a cancellation that arrives just as the inner call
    completes, and the task carries on. So cancel again until it is really done. Our own
    cancellation propagates (`asyncio.wait` does not swallow it).
    """
    pending = {t for t in tasks if not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=retry_s)


async def finish_or_cancel(tasks: Iterable[asyncio.Task[Any]], grace_s: float) -> int:
    """Let `tasks` end by themselves for up to `grace_s` (0: not at all), then cancel what
    still runs and wait for it; how many had to be cancelled."""
    pending = {t for t in tasks if not t.done()}
    if pending and grace_s > 0:
        _, pending = await asyncio.wait(pending, timeout=grace_s)
    await cancel_and_wait(pending)
    return len(pending)


class Background:
    """Fire-and-forget tasks (clean-up calls) that are still owned: each is referenced until
    it ends, failures are logged, and `aclose()` lets them finish (or cancels them after a
    grace period) before the resources they use are closed."""

    def __init__(self, name: str, *, limit: int = 65536) -> None:
        self._name = name
        self._limit = limit
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(
        self, coro: Coroutine[Any, Any, None], *, dropped: Callable[[], None] | None = None
    ) -> None:
        """Run `coro` in the background; past the bound it is dropped, and `dropped` called
        instead: a coroutine closed before it started runs none of its ``finally``, so what
        it would have given back in one must be given back there."""
        if len(self._tasks) >= self._limit:
            # Bounded. Clean-ups are best effort by nature: the instance's own timeout (e.g. a
            # prefill's KV hold timeout) is the backstop for a release call that never runs.
            log.warning("%s: %d clean-up tasks pending; dropping one", self._name, self._limit)
            coro.close()
            if dropped is not None:
                dropped()
            return
        task = asyncio.create_task(coro, name=self._name)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.warning("%s: clean-up task failed: %r", self._name, exc)

    async def aclose(self, grace_s: float = 2.0) -> None:
        await finish_or_cancel(self._tasks, grace_s)
