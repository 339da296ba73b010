"""A real HTTP server of decode-like streams for the upstream clients' tests."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from pdgate.gateway.upstream.base import UpstreamOptions
from pdgate.gateway.upstream.h1 import H1Upstream
from pdgate.gateway.upstream.http import HttpUpstream

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Client = type[HttpUpstream | H1Upstream]

# Each test of a stream's behaviour runs against both upstream clients.
both_clients = pytest.mark.parametrize("client", [HttpUpstream, H1Upstream], ids=["aiohttp", "h1"])


def connect(client: Client, **options: Any) -> HttpUpstream | H1Upstream:
    """`client` with a small pool, 1 s to connect and a read timeout past the test's time
    limit (a read only it would end fails the test), plus `options`."""
    return client.connect(
        UpstreamOptions(connections=4, connect_timeout_s=1, read_timeout_s=600, **options)
    )


async def event_stream(request: web.Request) -> web.StreamResponse:
    """An event-stream response to `request`, its head sent: the handler writes the events."""
    resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await resp.prepare(request)
    return resp


@contextlib.asynccontextmanager
async def serving(posts: dict[str, Handler]) -> AsyncIterator[str]:
    """Serve `posts` (path -> handler of POST) on a loopback port; yield the base URL."""
    app = web.Application()
    for path, handler in posts.items():
        app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
