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

Like vLLM it lists its ``max_model_len`` (``--max-model-len``) and its LoRA adapters
(``--lora NAME``, and any loaded with ``POST /v1/load_lora_adapter``, dropped with
``/v1/unload_lora_adapter``, as vLLM with runtime LoRA updating) at ``GET /v1/models``, each
with ``parent`` = the model; a request for an adapter is answered with text of its own.
It refuses a prompt plus ``max_tokens`` beyond ``max_model_len`` with vLLM's 400. It serves
``/tokenize`` and ``/detokenize`` in vLLM's shapes with a byte tokenizer (one token per UTF-8
byte, a BOS of id 1 on a completion prompt; a conversation rendered ``<|role|>\ncontent\n``
per message, then ``<|assistant|>\n``). With ``--pooling`` it is a pooling model instead: no
completion paths, and ``/v1/embeddings`` (base64 too, as the openai client asks),
``/pooling``, ``/score``, ``/v1/score``, ``/rerank``, ``/v1/rerank`` and ``/v2/rerank`` in
vLLM's shapes. ``GET /openapi.json`` lists the paths it serves, as FastAPI's does.

For the tests only, ``GET /_stats`` reports what it saw (most prefill legs inside it at once,
404s by path, decode legs with a prefill's params, legs by model, side requests by path),
``POST /_health?ok=0|1`` makes ``/health`` answer 503 or 200 while the process keeps
serving, ``POST /_prefill_s?s=X`` changes how long a prefill leg takes, and
``POST /_fail?path=P&status=S&times=N`` makes the next N requests to side path P answer S.

Run ``python -m tests.registry._stock_server --model NAME [--port N]``; prints
``stock-server: http://127.0.0.1:PORT`` once listening. `StockServer` starts and stops one.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import os
import socket
import struct
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

from pdgate.config.wire import POOLING_ENDPOINTS

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


def byte_tokens(text: str, *, bos: bool) -> list[int]:
    """The server's tokenizer: one token per UTF-8 byte (id = byte + 3), BOS = 1."""
    return [1] * bos + [b + 3 for b in text.encode()]


def chat_text(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    """The server's chat template."""
    text = "".join(f"<|{m.get('role')}|>\n{m.get('content') or ''}\n" for m in messages)
    return text + ("<|assistant|>\n" if add_generation_prompt else "")


def openai_answer(
    model: str, rid: str, chat: bool, text: str, finish: str | None, *, chunk: bool = False
) -> dict[str, Any]:
    """A completion (chat: a chat completion, or with `chunk` a stream's chunk) in OpenAI's
    shape, as vLLM answers it."""
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


def embedding(text: str, dims: int = 8) -> list[float]:
    """The server's deterministic embedding of `text`."""
    digest = hashlib.blake2b(text.encode(), digest_size=dims).digest()
    return [round(b / 255, 4) for b in digest]


def _app(
    model: str,
    prefill_s: float,
    token_s: float,
    api_key: str | None = None,
    *,
    max_model_len: int = 8192,
    loras: tuple[str, ...] = (),
    pooling: bool = False,
) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
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
        "legs_by_model": Counter(),  # "prefill MODEL" / "decode MODEL"
        "side": Counter(),  # side requests by path
    }
    adapters: dict[str, str] = {name: f"/loras/{name}" for name in loras}  # name -> path
    failing: dict[str, list[int]] = {}  # side path -> [status, times left]
    started = int(time.time())
    port_holder: dict[str, int] = {}

    def error(message: str, status: int) -> Response:
        body = {"error": {"message": message, "type": "invalid_request_error", "code": status}}
        return JSONResponse(body, status)

    async def models(request: Request) -> Response:
        entry = {"object": "model", "created": started, "owned_by": "vllm", "permission": []}
        base = {**entry, "id": model, "root": model, "parent": None, "max_model_len": max_model_len}
        loaded = [
            {**entry, "id": name, "root": path, "parent": model, "max_model_len": None}
            for name, path in adapters.items()
        ]
        return JSONResponse({"object": "list", "data": [base, *loaded]})

    async def load_lora(request: Request) -> Response:
        body = orjson.loads(await request.body())
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str):
            return error("Both 'lora_name' and 'lora_path' must be provided.", 400)
        if name in adapters:
            return error(f"The lora adapter '{name}' has already been loaded.", 400)
        adapters[name] = path
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora(request: Request) -> Response:
        name = orjson.loads(await request.body()).get("lora_name")
        if adapters.pop(name, None) is None:
            return error(f"The lora adapter '{name}' cannot be found.", 404)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    def served(name: object) -> bool:
        return name is None or name == model or name in adapters

    def too_long(tokens: int, max_tokens: int) -> Response | None:
        if tokens + max_tokens <= max_model_len:
            return None
        return error(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {tokens} input tokens. Please reduce the length of the input.",
            400,
        )

    async def tokenize(request: Request) -> Response:
        body = orjson.loads(await request.body())
        if not served(body.get("model")):
            return error(f"The model `{body.get('model')}` does not exist.", 404)
        if "messages" in body:
            text = chat_text(body["messages"], body.get("add_generation_prompt", True))
            ids = byte_tokens(text, bos=bool(body.get("add_special_tokens", False)))
        elif isinstance(body.get("prompt"), str):
            ids = byte_tokens(body["prompt"], bos=bool(body.get("add_special_tokens", True)))
        else:
            return error("prompt or messages is required", 400)
        state["side"]["/tokenize"] += 1
        strs = [chr(t - 3) if t > 2 else "<s>" for t in ids]
        return JSONResponse(
            {
                "count": len(ids),
                "max_model_len": max_model_len,
                "tokens": ids,
                "token_strs": strs if body.get("return_token_strs") else None,
            }
        )

    async def detokenize(request: Request) -> Response:
        body = orjson.loads(await request.body())
        state["side"]["/detokenize"] += 1
        text = bytes(t - 3 for t in body["tokens"] if t > 2).decode(errors="replace")
        return JSONResponse({"prompt": text})

    async def pooled(request: Request) -> Response:
        path = request.url.path
        if (denied := refused(request)) is not None:
            return denied
        state["side"][path] += 1
        if (fail := failing.get(path)) is not None and fail[1] > 0:
            fail[1] -= 1
            return error(f"failing {path} as told", fail[0])
        body = orjson.loads(await request.body())
        name = body.get("model") or model
        if not served(name):
            return error(f"The model `{name}` does not exist.", 404)
        head = {"id": f"pool-{uuid.uuid4().hex}", "created": int(time.time()), "model": name}
        if path in ("/v1/embeddings", "/pooling"):
            given = body.get("input")
            texts = [given] if isinstance(given, str) else given
            if not isinstance(texts, list) or not texts:
                return error("input must be a string or a list of strings", 400)
            texts = [t if isinstance(t, str) else " ".join(map(str, t)) for t in texts]
            tokens = sum(len(byte_tokens(t, bos=True)) for t in texts)
            if long := too_long(max(len(byte_tokens(t, bos=True)) for t in texts), 0):
                return long
            usage = {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}
            if path == "/pooling":
                data = [
                    {"index": i, "object": "pooling", "data": embedding(t)}
                    for i, t in enumerate(texts)
                ]
                return JSONResponse({**head, "object": "list", "data": data, "usage": usage})
            vectors: list[Any] = [embedding(t) for t in texts]
            if body.get("encoding_format") == "base64":
                vectors = [
                    base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode() for v in vectors
                ]
            data = [
                {"index": i, "object": "embedding", "embedding": v} for i, v in enumerate(vectors)
            ]
            return JSONResponse({**head, "object": "list", "data": data, "usage": usage})
        query = body.get("query", body.get("text_1"))
        documents = body.get("documents", body.get("text_2"))
        if not isinstance(query, str) or not isinstance(documents, list | str):
            return error("a query (text_1) and documents (text_2) are required", 400)
        documents = [documents] if isinstance(documents, str) else documents
        scores = [embedding(query + "|" + d, 1)[0] for d in documents]
        usage = {"prompt_tokens": 0, "total_tokens": 0}
        if "rerank" in path:
            results = [
                {"index": i, "document": {"text": d}, "relevance_score": x}
                for i, (d, x) in enumerate(zip(documents, scores, strict=True))
            ]
            results.sort(key=lambda r: -float(r["relevance_score"]))  # type: ignore[arg-type]
            return JSONResponse({**head, "usage": usage, "results": results})
        data = [{"index": i, "object": "score", "score": x} for i, x in enumerate(scores)]
        return JSONResponse({**head, "object": "list", "data": data, "usage": usage})

    async def set_failing(request: Request) -> Response:
        query = request.query_params
        failing[query["path"]] = [int(query["status"]), int(query.get("times", "1"))]
        return Response(status_code=204)

    def openapi_paths() -> list[str]:
        paths = [
            "/v1/models",
            "/health",
            "/tokenize",
            "/detokenize",
            "/v1/load_lora_adapter",
            "/v1/unload_lora_adapter",
        ]
        return paths + (
            list(POOLING_ENDPOINTS) if pooling else ["/v1/completions", "/v1/chat/completions"]
        )

    async def openapi(request: Request) -> Response:
        paths = {
            p: {"post" if p not in ("/v1/models", "/health") else "get": {}}
            for p in openapi_paths()
        }
        # As large as vLLM's (its request schemas, a few hundred KiB): read in many chunks.
        schemas = {f"Schema{i}": {"type": "object", "description": "x" * 1000} for i in range(300)}
        return JSONResponse(
            {
                "openapi": "3.1.0",
                "info": {"title": "stock"},
                "paths": paths,
                "components": {"schemas": schemas},
            }
        )

    async def health(request: Request) -> Response:
        return Response(status_code=200 if state["healthy"] else 503)

    async def set_prefill_s(request: Request) -> Response:
        state["prefill_s"] = float(request.query_params["s"])
        return Response(status_code=204)

    async def set_health(request: Request) -> Response:
        state["healthy"] = request.query_params.get("ok") == "1"
        return Response(status_code=204)

    async def stats(request: Request) -> Response:
        counters = {k: dict(v) for k, v in state.items() if isinstance(v, Counter)}
        return JSONResponse({**state, **counters})

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
        name = body.get("model")
        if name is None or not served(name):
            return error(f"The model `{name}` does not exist.", 404)
        prompt = chat_prompt(body.get("messages")) if chat else body.get("prompt")
        if not isinstance(prompt, str):
            return error("prompt must be a string" if not chat else "bad messages", 400)
        ids = (
            byte_tokens(chat_text(body["messages"]), bos=False)
            if chat
            else byte_tokens(prompt, bos=True)
        )
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        if (long := too_long(len(ids), max_tokens)) is not None:
            return long
        if name != model:  # an adapter answers in its own words
            prompt = f"{name}:{prompt}"
        # vLLM's ids: the caller's x-request-id under vLLM's own prefix, else a random one.
        rid = ("chatcmpl-" if chat else "cmpl-") + (
            request.headers.get("x-request-id") or uuid.uuid4().hex
        )
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):
            state["legs_by_model"][f"prefill {name}"] += 1
            return await prefill_leg(prompt, max_tokens, rid, chat)
        state["legs_by_model"][f"decode {name}"] += 1
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
        return openai_answer(model, rid, chat, text, finish, chunk=chunk)

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

    completion_routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
    ]
    # vLLM's pooling routes, as the gateway lists them (config/wire.py).
    pooling_routes = [Route(p, pooled, methods=["POST"]) for p in POOLING_ENDPOINTS]
    app = Starlette(
        routes=[
            Route("/v1/models", models_guarded, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/openapi.json", openapi, methods=["GET"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/v1/load_lora_adapter", load_lora, methods=["POST"]),
            Route("/v1/unload_lora_adapter", unload_lora, methods=["POST"]),
            *(pooling_routes if pooling else completion_routes),
            Route("/_stats", stats, methods=["GET"]),
            Route("/_health", set_health, methods=["POST"]),
            Route("/_prefill_s", set_prefill_s, methods=["POST"]),
            Route("/_fail", set_failing, methods=["POST"]),
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
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--lora", action="append", default=[])
    p.add_argument("--pooling", action="store_true")
    args = p.parse_args(argv)
    app, port_holder = _app(
        args.model,
        args.prefill_s,
        args.token_s,
        args.api_key,
        max_model_len=args.max_model_len,
        loras=tuple(args.lora),
        pooling=args.pooling,
    )
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


class ServerProcess:
    """A test server run as a child process: started until it prints its ready line (its
    output kept, bounded, and drained so it never blocks), stopped with `kill()`."""

    port: int

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.lines: list[str] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _spawn(self, args: list[str], env: dict[str, str], ready: str, timeout: float) -> str:
        """Start `args` (a Python module and its flags); the rest of its ready line."""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**env, "PYTHONUNBUFFERED": "1"},
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{args[0]} exited:\n" + "".join(self.lines))
            self.lines.append(line)
            if line.startswith(ready):
                threading.Thread(target=self._drain, args=(self.proc,), daemon=True).start()
                return line[len(ready) :].strip()
        self.kill()
        raise RuntimeError(f"{args[0]} did not start:\n" + "".join(self.lines))

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

    def set_prefill_s(self, seconds: float) -> None:
        httpx.post(self.url + f"/_prefill_s?s={seconds}", timeout=5).raise_for_status()


class StockServer(ServerProcess):
    """One `_stock_server` process; `kill()` and `start()` again keep its port."""

    def __init__(
        self,
        model: str,
        *,
        prefill_s: float = 0.05,
        port: int = 0,
        api_key: str | None = None,
        max_model_len: int = 8192,
        loras: tuple[str, ...] = (),
        pooling: bool = False,
    ) -> None:
        super().__init__()
        self.model = model
        self.prefill_s = prefill_s
        self.port = port
        self.api_key = api_key
        self.flags = [f"--max-model-len={max_model_len}", *(f"--lora={n}" for n in loras)]
        self.flags += ["--pooling"] * pooling

    def start(self, timeout: float = 20.0) -> StockServer:
        args = ["tests.registry._stock_server", "--model", self.model]
        args += ["--port", str(self.port), "--prefill-s", str(self.prefill_s), *self.flags]
        env = dict(os.environ)
        env.pop("VLLM_API_KEY", None)
        if self.api_key is not None:
            env["VLLM_API_KEY"] = self.api_key
        self.port = int(self._spawn(args, env, READY, timeout).rsplit(":", 1)[1])
        return self

    def set_health(self, ok: bool) -> None:
        httpx.post(self.url + f"/_health?ok={int(ok)}", timeout=5).raise_for_status()

    def load_lora(self, name: str) -> None:
        """Load an adapter as vLLM's ``POST /v1/load_lora_adapter`` does."""
        body = {"lora_name": name, "lora_path": f"/loras/{name}"}
        httpx.post(self.url + "/v1/load_lora_adapter", json=body, timeout=5).raise_for_status()

    def unload_lora(self, name: str) -> None:
        body = {"lora_name": name}
        httpx.post(self.url + "/v1/unload_lora_adapter", json=body, timeout=5).raise_for_status()

    def fail(self, path: str, status: int, times: int = 1) -> None:
        """The next `times` requests to side `path` answer `status`."""
        query = f"path={path}&status={status}&times={times}"
        httpx.post(self.url + f"/_fail?{query}", timeout=5).raise_for_status()


if __name__ == "__main__":
    raise SystemExit(serve(sys.argv[1:]))
