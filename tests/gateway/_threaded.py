"""Fake instances for tests of a real gateway process: one Starlette app (a subclass's
`app`) served by uvicorn in a thread, on loopback sockets bound before it is built, so that
the app can name its own ports (a prefill's ``kv_transfer_params``)."""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Self

import uvicorn
from starlette.applications import Starlette

from tests._cluster import wait_for


class ThreadedInstances:
    def __init__(self, ports: int = 2) -> None:
        self.socks = [_listen() for _ in range(ports)]
        self.urls = [f"http://127.0.0.1:{s.getsockname()[1]}" for s in self.socks]
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def port(self, index: int) -> int:
        return int(self.socks[index].getsockname()[1])

    def app(self) -> Starlette:
        raise NotImplementedError

    def __enter__(self) -> Self:
        server = self._server = uvicorn.Server(
            uvicorn.Config(self.app(), log_level="warning", lifespan="off")
        )
        self._thread = threading.Thread(
            target=lambda: asyncio.run(server.serve(sockets=self.socks)), daemon=True
        )
        self._thread.start()
        wait_for(lambda: server.started, what="fake instances up")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:  # their streams may never end: no grace
            self._server.should_exit = self._server.force_exit = True
        if self._thread is not None:
            self._thread.join(10)


def _listen() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock
