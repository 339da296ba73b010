"""Asyncio helpers shared by the background loops."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any


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
