"""A stock-like OpenAI server that is not a pdgate shim, run as a real process.

It behaves as ``vllm serve`` with a KV connector does towards a router, and no more:
``GET /v1/models``, ``GET /health``, ``POST /v1/completions`` and
``POST /v1/chat/completions`` with vLLM's ``kv_transfer_params`` handshake. A prefill leg
(``max_tokens=1`` and ``kv_transfer_params.do_remote_decode``) takes ``--prefill-s`` and
answers one token plus ``kv_transfer_params`` naming this server; a decode leg (params with
``do_remote_prefill``) streams SSE text. Answer ids are vLLM's: ``cmpl-`` (chat:
``chatcmpl-``) + the caller's ``x-request-id``, or a random one. With ``--api-key`` (or
``VLLM_API_KEY``) every ``/v1`` path wants ``Authorization: Bearer <key>`` and answers 401
otherwise, as ``vllm serve --api-key`` does; ``/health`` stays open. It has none of pdgate's
extensions (no ``/v1/completions/batch``, no ``/load``, no ``/v1/kv``): those answer 404. It
never answers 429: like stock vLLM, it queues whatever it is sent, which is why the gateway
must keep the queue-less rule itself.

For the tests only, ``GET /_stats`` reports what it saw (most prefill legs inside it at once,
404s by path, decode legs with a prefill's params), ``POST /_health?ok=0|1`` makes
``/health`` answer 503 or 200 while the process keeps serving, and ``POST /_prefill_s?s=X``
changes how long a prefill leg takes.

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
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson

READY = "stock-server: "

# A gateway's settings that probe static servers often and give up on one soon (tests).
FAST_PROBES = {
    "PDGATE_GATEWAY_STATIC_PROBE_INTERVAL_S": "0.2",
    "PDGATE_GATEWAY_STATIC_PROBE_TIMEOUT_S": "0.5",
}


def completion_text(prompt: str, max_tokens: int) -> str:
    """The server's deterministic answer: the same for the same prompt on any process."""
    seed = hashlib.blake2b(prompt.encode(), digest_size=4).hexdigest()
    return "".join(f" {seed}-{i}" for i in range(max_tokens))


def _app(model: str, prefill_s: float, token_s: float, api_key: str | None = None) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    state: dict[str, Any] = {
        "healthy": True,
        "prefill_s": prefill_s,
        "prefill_now": 0,
        "prefill_max": 0,
        "prefill_legs": 0,
        "decode_legs": 0,
        "decode_with_kv": 0,
        "unauthorized": 0,
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

    async def set_prefill_s(request: Request) -> Response:
        state["prefill_s"] = float(request.query_params["s"])
        return Response(status_code=204)

    async def set_health(request: Request) -> Response:
        state["healthy"] = request.query_params.get("ok") == "1"
        return Response(status_code=204)

    async def stats(request: Request) -> Response:
        return JSONResponse({**state, "not_found": dict(state["not_found"])})

    def refused(request: Request) -> Response | None:
        if api_key is None or request.headers.get("authorization") == f"Bearer {api_key}":
            return None
        state["unauthorized"] += 1
        return error("Unauthorized", 401)

    async def models_guarded(request: Request) -> Response:
        return refused(request) or await models(request)

    async def completions(request: Request) -> Response:
        return await leg(request, chat=False)

    async def chat(request: Request) -> Response:
        return await leg(request, chat=True)

    async def leg(request: Request, *, chat: bool) -> Response:
        if (denied := refused(request)) is not None:
            return denied
        body = orjson.loads(await request.body())
        if body.get("model") != model:
            return error(f"The model `{body.get('model')}` does not exist.", 404)
        prompt = chat_prompt(body.get("messages")) if chat else body.get("prompt")
        if not isinstance(prompt, str):
            return error("prompt must be a string" if not chat else "bad messages", 400)
        # vLLM's ids: the caller's x-request-id under vLLM's own prefix, else a random one.
        rid = ("chatcmpl-" if chat else "cmpl-") + (
            request.headers.get("x-request-id") or uuid.uuid4().hex
        )
        params = body.get("kv_transfer_params") or {}
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        if params.get("do_remote_decode"):
            return await prefill_leg(prompt, max_tokens, rid, chat)
        state["decode_legs"] += 1
        if params.get("do_remote_prefill") and params.get("remote_request_id"):
            state["decode_with_kv"] += 1
        text = completion_text(prompt, max_tokens)
        if body.get("stream"):
            return StreamingResponse(stream(text, rid, chat), media_type="text/event-stream")
        return JSONResponse(answer(text, "length", rid, chat))

    async def prefill_leg(prompt: str, max_tokens: int, rid: str, chat: bool) -> Response:
        if max_tokens != 1:
            return error("a prefill leg has max_tokens=1", 400)
        state["prefill_legs"] += 1
        state["prefill_now"] += 1
        state["prefill_max"] = max(state["prefill_max"], state["prefill_now"])
        try:
            await asyncio.sleep(state["prefill_s"])  # queued or batched: it never refuses
        finally:
            state["prefill_now"] -= 1
        reply = answer(completion_text(prompt, 1), "length", rid, chat)
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

    def answer(
        text: str, finish: str | None, rid: str, chat: bool, *, chunk: bool = False
    ) -> dict[str, Any]:
        head = {"id": rid, "created": int(time.time()), "model": model}
        if not chat:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            return {**head, "object": "text_completion", "choices": [choice]}
        if chunk:
            delta = {"role": "assistant", "content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {**head, "object": "chat.completion.chunk", "choices": [choice]}
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        return {**head, "object": "chat.completion", "choices": [choice]}

    async def stream(text: str, rid: str, chat: bool) -> AsyncIterator[bytes]:
        pieces = text.split(" ")[1:]
        for i, piece in enumerate(pieces):
            await asyncio.sleep(token_s)
            finish = "length" if i == len(pieces) - 1 else None
            event = answer(" " + piece, finish, rid, chat, chunk=True)
            yield b"data: " + orjson.dumps(event) + b"\n\n"
        yield b"data: [DONE]\n\n"

    def chat_prompt(messages: Any) -> str | None:
        if not isinstance(messages, list) or not messages:
            return None
        parts = [m.get("content") for m in messages if isinstance(m, dict)]
        if not all(isinstance(p, str) for p in parts):
            return None
        return "\n".join(parts)

    async def not_found(request: Request, exc: Exception) -> Response:
        state["not_found"][request.url.path] += 1
        return error(f"no route {request.url.path}", 404)

    app = Starlette(
        routes=[
            Route("/v1/models", models_guarded, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/_stats", stats, methods=["GET"]),
            Route("/_health", set_health, methods=["POST"]),
            Route("/_prefill_s", set_prefill_s, methods=["POST"]),
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
    # As vllm serve: --api-key, else the VLLM_API_KEY variable (tests pass it by variable, so
    # the key never shows in `ps`).
    p.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY") or None)
    args = p.parse_args(argv)
    app, port_holder = _app(args.model, args.prefill_s, args.token_s, args.api_key)
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

    def __init__(
        self, model: str, *, prefill_s: float = 0.05, port: int = 0, api_key: str | None = None
    ) -> None:
        self.model = model
        self.prefill_s = prefill_s
        self.port = port
        self.api_key = api_key
        self.proc: subprocess.Popen[str] | None = None
        self.lines: list[str] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> StockServer:
        args = [sys.executable, "-m", "tests.registry._stock_server", "--model", self.model]
        args += ["--port", str(self.port), "--prefill-s", str(self.prefill_s)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("VLLM_API_KEY", None)
        if self.api_key is not None:
            env["VLLM_API_KEY"] = self.api_key
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
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

    def set_prefill_s(self, seconds: float) -> None:
        httpx.post(self.url + f"/_prefill_s?s={seconds}", timeout=5).raise_for_status()


if __name__ == "__main__":
    raise SystemExit(serve(sys.argv[1:]))
