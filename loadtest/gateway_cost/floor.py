"""The least a Python gateway on pdgate's stack adds: ``python_floor``, a front of
``pdgate bench gateway --floor``.

A plain ASGI callable served as ``pdgate gateway`` is served (uvicorn with httptools on
uvloop, config/server.py; the cyclic collector settled the same way) that takes ``POST
/v1/completions``, makes the two legs of vLLM's handshake through pdgate's HTTP/1.1 client
(gateway/upstream/h1.py), round robin over the engines it was given, and passes the
decode's bytes through as they arrive. It watches for the client's disconnect as every
gateway must (an idle stream would otherwise hold its decode for ever). Nothing else: no
admission, queue, policy, counts, leases, metrics, token ids, deadlines or failover.

What it costs a request is what the server, the client and the event loop cost any gateway
written this way. Against SMG it bounds what pdgate can reach on this stack; pdgate against
it is what pdgate's own design costs. Not a gateway to deploy: an engine's error is a bare
502 and a failed leg is not tried elsewhere.

    python -m pdgate.loadtest.gateway_cost.floor --prefill URL --decode URL [--port 0]

prints ``python floor on http://127.0.0.1:PORT`` once it serves.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
from collections.abc import Sequence

import orjson
from starlette.types import Receive, Scope, Send

from pdgate.config.aio import run_unless, wait_disconnect
from pdgate.config.server import bind_socket, bound_port, run, serving
from pdgate.config.wire import prefill_kv_request
from pdgate.gateway.errors import UpstreamError
from pdgate.gateway.upstream.base import UpstreamOptions
from pdgate.gateway.upstream.h1 import H1Upstream
from pdgate.loadtest.gateway_cost.stock import _answer, not_http

__all__ = ["FloorApp", "main"]

_PATH = "/v1/completions"
_SSE = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
_JSON = [(b"content-type", b"application/json")]


class _Gone(Exception):
    """The client disconnected."""


class FloorApp:
    """Two legs and a byte relay per request, round robin over `prefills` and `decodes`."""

    def __init__(
        self, upstream: H1Upstream, prefills: Sequence[str], decodes: Sequence[str]
    ) -> None:
        if not prefills or not decodes:
            raise ValueError("the floor needs a prefill and a decode")
        self._upstream = upstream
        self._prefills = list(prefills)
        self._decodes = list(decodes)
        self._turn = itertools.count()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if await not_http(scope, receive, send):
            return
        if scope["path"] == "/health":
            await _answer(send, 200, b"{}", _JSON)
            return
        if scope["path"] != _PATH or scope["method"] != "POST":
            await _answer(send, 404, b'{"error":{"message":"not found"}}', _JSON)
            return
        body = b""
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
        try:
            request = orjson.loads(body)
        except orjson.JSONDecodeError:
            await _answer(send, 400, b'{"error":{"message":"the body is not JSON"}}', _JSON)
            return
        watcher = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await run_unless(self._serve(request, send), watcher, lost=_Gone())
        except _Gone:
            pass
        finally:
            watcher.cancel()

    async def _serve(self, request: dict[str, object], send: Send) -> None:
        turn = next(self._turn)
        prefill = self._prefills[turn % len(self._prefills)]
        decode = self._decodes[turn % len(self._decodes)]
        request_id = f"floor-{turn}"
        kv = prefill_kv_request()
        leg = {**request, "max_tokens": 1, "stream": False, "kv_transfer_params": kv}
        try:
            reply = await self._upstream.prefill(prefill, leg, request_id=request_id, timeout_s=60)
            stream = await self._upstream.open_decode(
                decode,
                {**request, "kv_transfer_params": reply["kv_transfer_params"]},
                request_id=request_id,
                connect_timeout_s=5,
            )
        except UpstreamError as exc:
            await _answer(send, 502, orjson.dumps({"error": {"message": str(exc)}}), _JSON)
            return
        try:
            await send({"type": "http.response.start", "status": 200, "headers": _SSE})
            while chunk := await stream.read(65536):
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except UpstreamError:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            stream.close()


async def _serve_forever(args: argparse.Namespace) -> None:
    from pdgate.gateway.cli import _settle_gc

    upstream = H1Upstream(
        UpstreamOptions(connections=8192, connect_timeout_s=5, read_timeout_s=3600)
    )
    app = FloorApp(upstream, args.prefill, args.decode)
    sock = bind_socket(args.host, args.port)
    try:
        async with serving(app, sock):
            _settle_gc()  # as `pdgate gateway` does once serving
            print(f"python floor on http://{args.host}:{bound_port(sock)}", flush=True)
            await asyncio.Event().wait()
    finally:
        await upstream.aclose()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="floor", description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill", action="append", required=True, help="an engine's base URL")
    p.add_argument("--decode", action="append", required=True, help="an engine's base URL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    run(_serve_forever(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
