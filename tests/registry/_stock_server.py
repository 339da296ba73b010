"""A stock-like OpenAI completions server that is not a pdgate shim, run as a real process.

It behaves as ``vllm serve`` with a KV connector does towards a router, and no more:
``GET /v1/models``, ``GET /health`` and ``POST /v1/completions`` with vLLM's
``kv_transfer_params`` handshake. A prefill leg (``max_tokens=1`` and
``kv_transfer_params.do_remote_decode``) takes ``--prefill-s`` and answers one token plus
``kv_transfer_params`` naming this server; a decode leg (params with ``do_remote_prefill``)
streams SSE text. It has none of pdgate's extensions (no ``/v1/completions/batch``, no
``/load``, no ``/v1/kv``): those answer 404. It never answers 429: like stock vLLM, it queues
whatever it is sent, which is why the gateway must keep the queue-less rule itself.

For the tests only, ``GET /_stats`` reports what it saw (most prefill legs inside it at once,
404s by path, decode legs with a prefill's params) and ``POST /_health?ok=0|1`` makes
``/health`` answer 503 or 200 while the process keeps serving.

Run ``python -m tests.registry._stock_server --model NAME [--port N]``; prints
``stock-server: http://127.0.0.1:PORT`` once listening. `StockServer` starts and stops one.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson

READY = "stock-server: "


def completion_text(prompt: str, max_tokens: int) -> str:
    """The server's deterministic answer: the same for the same prompt on any process."""
    seed = hashlib.blake2b(prompt.encode(), digest_size=4).hexdigest()
    return "".join(f" {seed}-{i}" for i in range(max_tokens))


def _app(model: str, prefill_s: float, token_s: float) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    state: dict[str, Any] = {
        "healthy": True,
        "prefill_now": 0,
        "prefill_max": 0,
        "prefill_legs": 0,
        "decode_legs": 0,
        "decode_with_kv": 0,
        "not_found": Counter(),
    }
    started = int(time.time())
    port_holder: dict[str, int] = {}

    def error(message: str, status: int) -> Response:
        body = {"error": {"message": message, "type": "invalid_request_error", "code": status}}
        return JSONResponse(body, status)

    async def models(request: Request) -> Response:
        entry = {"id": model, "object": "model", "created": started, "owned_by": "stock"}
        adapter = {**entry, "id": f"{model}-lora", "parent": model}
        return JSONResponse({"object": "list", "data": [{**entry, "parent": None}, adapter]})

    async def health(request: Request) -> Response:
        return Response(status_code=200 if state["healthy"] else 503)

    async def set_health(request: Request) -> Response:
        state["healthy"] = request.query_params.get("ok") == "1"
        return Response(status_code=204)

    async def stats(request: Request) -> Response:
        return JSONResponse({**state, "not_found": dict(state["not_found"])})

    async def completions(request: Request) -> Response:
        body = orjson.loads(await request.body())
        if body.get("model") != model:
            return error(f"The model `{body.get('model')}` does not exist.", 404)
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            return error("prompt must be a string", 400)
        params = body.get("kv_transfer_params") or {}
        max_tokens = int(body.get("max_tokens") or 16)
        if params.get("do_remote_decode"):
            return await prefill_leg(request, prompt, max_tokens)
        state["decode_legs"] += 1
        if params.get("do_remote_prefill") and params.get("remote_request_id"):
            state["decode_with_kv"] += 1
        text = completion_text(prompt, max_tokens)
        if body.get("stream"):
            return StreamingResponse(stream(text, max_tokens), media_type="text/event-stream")
        return JSONResponse(answer(text, "length"))

    async def prefill_leg(request: Request, prompt: str, max_tokens: int) -> Response:
        if max_tokens != 1:
            return error("a prefill leg has max_tokens=1", 400)
        state["prefill_legs"] += 1
        state["prefill_now"] += 1
        state["prefill_max"] = max(state["prefill_max"], state["prefill_now"])
        try:
            await asyncio.sleep(prefill_s)  # queued or batched: it never refuses
        finally:
            state["prefill_now"] -= 1
        reply = answer(completion_text(prompt, 1), "length")
        reply["kv_transfer_params"] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": f"stock-{os.getpid()}",
            "remote_host": "127.0.0.1",
            "remote_port": port_holder["port"],
            "remote_block_ids": [0],
            "remote_request_id": hashlib.blake2b(prompt.encode(), digest_size=8).hexdigest(),
        }
        return JSONResponse(reply)

    def answer(text: str, finish: str | None) -> dict[str, Any]:
        return {
            "id": "cmpl-stock",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
        }

    async def stream(text: str, max_tokens: int) -> AsyncIterator[bytes]:
        pieces = text.split(" ")[1:]
        for i, piece in enumerate(pieces):
            await asyncio.sleep(token_s)
            finish = "length" if i == len(pieces) - 1 else None
            yield b"data: " + orjson.dumps(answer(" " + piece, finish)) + b"\n\n"
        yield b"data: [DONE]\n\n"

    async def not_found(request: Request, exc: Exception) -> Response:
        state["not_found"][request.url.path] += 1
        return error(f"no route {request.url.path}", 404)

    app = Starlette(
        routes=[
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/_stats", stats, methods=["GET"]),
            Route("/_health", set_health, methods=["POST"]),
        ],
        exception_handlers={404: not_found},
    )
    return app, port_holder


def serve(argv: list[str]) -> int:
    import uvicorn

    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--prefill-s", type=float, default=0.05)
    p.add_argument("--token-s", type=float, default=0.002)
    args = p.parse_args(argv)
    app, port_holder = _app(args.model, args.prefill_s, args.token_s)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))
    port_holder["port"] = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)

    async def main() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))  # handles SIGTERM itself
        while not server.started:
            if task.done():
                await task  # failed to start: its error
                return
            await asyncio.sleep(0.01)
        print(f"{READY}http://127.0.0.1:{port_holder['port']}", flush=True)
        await task

    asyncio.run(main())
    return 0


class StockServer:
    """One `_stock_server` process; `kill()` and `start()` again keep its port."""

    def __init__(self, model: str, *, prefill_s: float = 0.05, port: int = 0) -> None:
        self.model = model
        self.prefill_s = prefill_s
        self.port = port
        self.proc: subprocess.Popen[str] | None = None
        self.lines: list[str] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> StockServer:
        args = [sys.executable, "-m", "tests.registry._stock_server", "--model", self.model]
        args += ["--port", str(self.port), "--prefill-s", str(self.prefill_s)]
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("stock server exited:\n" + "".join(self.lines))
            self.lines.append(line)
            if line.startswith(READY):
                self.port = int(line.strip().rsplit(":", 1)[1])
                threading.Thread(target=self._drain, args=(self.proc,), daemon=True).start()
                return self
        self.kill()
        raise RuntimeError("stock server did not start:\n" + "".join(self.lines))

    def _drain(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if len(self.lines) < 1000:
                self.lines.append(line)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(10)

    def stats(self) -> dict[str, Any]:
        resp = httpx.get(self.url + "/_stats", timeout=5)
        resp.raise_for_status()
        data: dict[str, Any] = resp.json()
        return data

    def set_health(self, ok: bool) -> None:
        httpx.post(self.url + f"/_health?ok={int(ok)}", timeout=5).raise_for_status()


if __name__ == "__main__":
    raise SystemExit(serve(sys.argv[1:]))
