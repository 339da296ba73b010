"""A completions endpoint on a real socket for the load generators' tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from aiohttp import web

from tests.loadtest._http import served

__all__ = ["completions_server"]


@asynccontextmanager
async def completions_server(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> AsyncIterator[str]:
    """Serve `handler` at ``/v1/completions``; yield that URL."""
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    async with served(app) as url:
        yield url + "/v1/completions"
