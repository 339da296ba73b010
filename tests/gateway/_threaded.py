"""Fake instances for tests of a real gateway process: one Starlette app served by uvicorn in a
thread, on loopback sockets bound before it is built, so that a prefill can name its own port
(its ``kv_transfer_params``). A subclass answers ``POST /v1/completions`` (both legs) and,
if it cares, ``DELETE /v1/kv/{id}``; ``/v1/models`` and ``/health`` are served here."""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Self

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests._cluster import wait_for


class ThreadedInstances:
    def __init__(self, ports: int = 2) -> None:
        self.socks = [_listen() for _ in range(ports)]
        self.urls = [f"http://127.0.0.1:{s.getsockname()[1]}" for s in self.socks]
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def port(self, index: int) -> int:
        return int(self.socks[index].getsockname()[1])

    model = "fake-model"  # what /v1/models lists

    def kv_params(self, kv_id: str) -> dict[str, object]:
        """The handshake a prefill on the first socket answers with."""
        return {"do_remote_prefill": True, "remote_host": "127.0.0.1",
                "remote_port": self.port(0), "remote_request_id": kv_id}  # fmt: skip

    async def completions(self, request: Request) -> Response:
        raise NotImplementedError

    async def release(self, request: Request) -> Response:
        return Response(status_code=204)

    def app(self) -> Starlette:
        models = {"object": "list", "data": [{"id": self.model, "object": "model"}]}

        async def listed(request: Request) -> Response:
            return JSONResponse(models)

        async def health(request: Request) -> Response:
            return Response(status_code=200)

        return Starlette(
            routes=[
                Route("/v1/models", listed, methods=["GET"]),
                Route("/health", health, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/kv/{kv_id}", self.release, methods=["DELETE"]),
            ]
        )

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
