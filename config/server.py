"""Running ASGI apps on uvicorn (uvloop + httptools) from pre-bound sockets.

Binding first means a process knows its real port (``--port 0`` included) before it
registers anywhere, and lets one event loop host several servers (``pdgate up``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any

import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from pdgate.config.openai_api import error_json

# As long as an idle keep-alive connection is kept, a client has to send a request's headers.
HEADER_TIMEOUT_S = 30.0


def bind_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


def bound_port(sock: socket.socket) -> int:
    return int(sock.getsockname()[1])


def is_wildcard(host: str) -> bool:
    """Whether a listening address means every interface (no one can connect to it as is)."""
    return host in ("0.0.0.0", "::", "")


def is_loopback(host: str) -> bool:
    """Whether a listening address is reachable from this machine only (then a gateway or a
    shim may serve without credentials)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # Signals belong to whoever owns the process (cli.py), not to each of its servers.
        yield


class _Protocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol with a deadline for each request's headers, and an OpenAI
    error body for a request it cannot parse.

    uvicorn times a connection out only while it idles after a response, and stops the clock
    at the first byte of the next request: a client that connects and sends nothing, or half
    a request line, holds its connection (a descriptor, a protocol) for ever. Here the
    headers must be whole `timeout_s` after the connection opened or the last response
    ended; the body has its own bound (``body_timeout_s``). Pipelined requests, whose headers
    came during the previous response, are not timed again."""

    timeout_s = HEADER_TIMEOUT_S
    _late: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_headers()

    def on_headers_complete(self) -> None:
        self._stop_clock()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # A pipelined request started just now: its headers are in.
        if not self.transport.is_closing() and self.cycle.response_complete:
            self._await_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_clock()
        super().connection_lost(exc)

    def _await_headers(self) -> None:
        self._stop_clock()
        self._late = self.loop.call_later(self.timeout_s, self._headers_late)

    def _stop_clock(self) -> None:
        if self._late is not None:
            self._late.cancel()
            self._late = None

    def _headers_late(self) -> None:
        self._late = None
        if not self.transport.is_closing():
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        # uvicorn's own answer is plain text; clients of an OpenAI API expect its error body.
        body = error_json(msg, "invalid_request_error")
        head = [STATUS_LINE[400]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head.append(b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body))
        self.transport.write(b"".join([*head, b"connection: close\r\n\r\n", body]))
        self.transport.close()


def make_server(
    app: ASGIApp,
    *,
    access_log: bool = False,
    graceful_s: int = 5,
    header_timeout_s: float = HEADER_TIMEOUT_S,
) -> uvicorn.Server:
    class Protocol(_Protocol):
        timeout_s = header_timeout_s

    config = uvicorn.Config(
        app,
        loop="none",  # the caller owns the loop (uvloop installed by the CLI)
        http=Protocol,
        lifespan="on",
        access_log=access_log,
        log_level="warning",
        timeout_graceful_shutdown=graceful_s,
        timeout_keep_alive=int(HEADER_TIMEOUT_S),
        # X-Forwarded-* from clients are not trusted (and not used): no middleware for them.
        proxy_headers=False,
    )
    return _Server(config)


@contextlib.asynccontextmanager
async def serving(
    app: ASGIApp,
    sock: socket.socket,
    *,
    access_log: bool = False,
    header_timeout_s: float = HEADER_TIMEOUT_S,
) -> AsyncIterator[uvicorn.Server]:
    """Serve `app` on `sock` until the block exits; startup failures raise here."""
    server = make_server(app, access_log=access_log, header_timeout_s=header_timeout_s)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("server exited during startup")
        await asyncio.sleep(0.01)
    try:
        yield server
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await task


def run(main: Coroutine[Any, Any, None]) -> None:
    """Run `main` to completion on a uvloop event loop (plain asyncio where uvloop is missing);
    Ctrl-C ends it quietly, the coroutine's own clean-up having run."""
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        runner = asyncio.Runner()
    with runner, contextlib.suppress(KeyboardInterrupt):
        runner.run(main)
