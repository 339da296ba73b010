"""The benchmark's plain engine: an OpenAI completions server that is not a pdgate shim.

``pdgate bench gateway --engine stock`` puts every front in front of these instead of the sim
shims, so the comparison does not depend on anything only pdgate's shims offer. Each instance
behaves as ``vllm serve`` with a KV connector does towards a router, and no more:

* ``GET /health``, ``GET /v1/models`` and ``POST /v1/completions``, and (unless
  ``tokenizer`` is off) vLLM's ``POST /tokenize`` and ``POST /v1/completions/render``, which
  vllm-router's cache_aware policy calls before each pick; nothing else: no batch prefill
  endpoint, no ``/load``, no ``/v1/kv``, no registration (pdgate fronts it with static
  ``--prefill/--decode`` URLs, vllm-router with its own flags). Other paths answer 404 with
  an OpenAI error body; the client's ``return_token_ids`` and the like are ignored;
* vLLM's P/D handshake: a request whose ``kv_transfer_params`` say ``do_remote_decode`` is a
  prefill leg (``max_tokens`` must be 1): it answers one token and ``kv_transfer_params``
  naming this instance (``do_remote_prefill``, engine id, host, port, block ids, request id).
  Any other request is a decode (or a plain, undisaggregated) leg and gets ``max_tokens``
  tokens, streamed as SSE when ``stream`` is true. No KV moves: the decode does not fetch
  anything (the shims do, over HTTP: docs/results/performance/README.md says what that costs);
* it never answers 429: like stock vLLM it takes whatever it is sent;
* fast and deterministic: no modelled compute unless ``prefill_s``/``token_s`` ask for it,
  the text is a function of the prompt, ids count up per instance.

Each instance is a bare ASGI callable (no framework) on the same server stack as the shims
(uvicorn, httptools, uvloop), so the HTTP layer costs what the shims' does. One bench-only
path, ``GET /_stats``, reports what an instance saw: requests per path, prefill and decode
legs, the decode legs that carried a prefill's parameters, and the distinct client
connections (client address and port), which is how the benchmark checks that every front
used the same endpoints and how many connections each opened; and ``GET /_timeline``, when
each of the last legs arrived and answered (``time.monotonic()``, a clock every process on
the machine shares) by a digest of its prompt (`prompt_key`), from which the benchmark splits
a request's TTFT into the hops of its path.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import orjson

from pdgate.config.server import bind_socket, bound_port, serving

__all__ = ["MODEL", "StockEngine", "StockOptions", "not_http", "prompt_key", "serve_stock"]

MODEL = "sim-llama-3.1-8b"  # the name the load client asks for, as with the shims
_HOST = "127.0.0.1"
_MAX_BODY = 1 << 20
_MAX_TOKENS = 4096
_MAX_PATHS = 64  # distinct paths counted (anything beyond is "other")
_MAX_CLIENTS = 1 << 17  # distinct client connections remembered
_MAX_TIMELINE = 1 << 14  # leg events kept for GET /_timeline

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_JSON_HEADERS = [(b"content-type", b"application/json")]
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class StockOptions:
    prefill_s: float = 0.0  # a prefill leg's compute time
    # The wait between two decoded tokens (the first goes out at once: 3600 makes streams
    # that started and then stay silent, as the idle-stream measurement wants).
    token_s: float = 0.0
    model: str = MODEL
    # vLLM's ``POST /tokenize`` and ``POST /v1/completions/render`` (what vllm-router's
    # cache_aware policy asks before each pick; the "tokens" are the prompt's bytes). Off:
    # they answer 404, as a plain OpenAI server does.
    tokenizer: bool = True


class _BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


def _error_body(message: str, status: int, param: str | None = None) -> bytes:
    kind = "invalid_request_error" if status < 500 else "internal_error"
    error = {"message": message, "type": kind, "param": param, "code": status}
    return orjson.dumps({"error": error})


def prompt_key(prompt: str) -> str:
    """How ``/_timeline`` names a request (never the prompt itself)."""
    return hashlib.blake2b(prompt.encode(), digest_size=8).hexdigest()


def _tokens(prompt: str, count: int) -> list[str]:
    """The answer's tokens: a function of the prompt alone, as greedy decoding is."""
    seed = hashlib.blake2b(prompt.encode(), digest_size=4).hexdigest()
    return [f" {seed}-{i}" for i in range(count)]


class StockEngine:
    """One instance (an ASGI app). `port` is where it listens, for the handshake's
    ``remote_port``."""

    def __init__(self, options: StockOptions, *, engine_id: str, port: int) -> None:
        self._options = options
        self._engine_id = engine_id
        self._port = port
        self._ids = itertools.count()
        self._created = int(time.time())
        self._paths: Counter[str] = Counter()
        self._clients: set[tuple[str, int]] = set()
        self._legs = {"prefill": 0, "decode": 0, "decode_with_kv": 0}
        # (prompt key, event, time): prefill_in/prefill_out, decode_in/first_out
        self._timeline: deque[tuple[str, str, float]] = deque(maxlen=_MAX_TIMELINE)

    def stats(self) -> dict[str, Any]:
        return {**self._legs, "paths": dict(self._paths), "connections": len(self._clients)}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if await not_http(scope, receive, send):
            return
        method, path = scope["method"], scope["path"]
        self._count(f"{method} {path}", scope.get("client"))
        try:
            if method == "POST" and path == "/v1/completions":
                await self._completions(scope, receive, send)
            elif (
                method == "POST"
                and path in ("/tokenize", "/v1/completions/render")
                and self._options.tokenizer
            ):
                await self._tokenize(receive, send, render=path != "/tokenize")
            elif method == "GET" and path == "/health":
                await _answer(send, 200, b"", [])
            elif method == "GET" and path == "/v1/models":
                await _answer(send, 200, self._models(), _JSON_HEADERS)
            elif method == "GET" and path == "/_stats":
                await _answer(send, 200, orjson.dumps(self.stats()), _JSON_HEADERS)
            elif method == "GET" and path == "/_timeline":
                await _answer(send, 200, orjson.dumps(list(self._timeline)), _JSON_HEADERS)
            else:
                raise _BadRequest(f"no route {method} {path}", 404)
        except _BadRequest as exc:
            body = _error_body(str(exc), exc.status, exc.param)
            await _answer(send, exc.status, body, _JSON_HEADERS)

    def _count(self, key: str, client: Any) -> None:
        if key not in self._paths and len(self._paths) >= _MAX_PATHS:
            key = "other"
        self._paths[key] += 1
        if client is not None and len(self._clients) < _MAX_CLIENTS:
            self._clients.add((str(client[0]), int(client[1])))

    def _models(self) -> bytes:
        entry = {"id": self._options.model, "object": "model", "created": self._created,
                 "owned_by": "stock", "root": self._options.model, "parent": None}  # fmt: skip
        return orjson.dumps({"object": "list", "data": [entry]})

    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrived = time.monotonic()
        body = _parse(await _read_body(receive))
        if body.get("model") != self._options.model:
            raise _BadRequest(f"The model `{body.get('model')}` does not exist.", 404, "model")
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise _BadRequest("prompt must be a non-empty string", param="prompt")
        max_tokens = body.get("max_tokens", 16)
        if not isinstance(max_tokens, int) or not 1 <= max_tokens <= _MAX_TOKENS:
            raise _BadRequest(f"max_tokens must be 1..{_MAX_TOKENS}", param="max_tokens")
        params = body.get("kv_transfer_params")
        params = params if isinstance(params, dict) else {}
        rid = f"cmpl-{self._engine_id}-{next(self._ids)}"
        stream = body.get("stream") is True
        key = prompt_key(prompt)
        if params.get("do_remote_decode") is True:
            if max_tokens != 1:
                raise _BadRequest("a prefill leg has max_tokens=1", param="max_tokens")
            self._legs["prefill"] += 1
            self._timeline.append((key, "prefill_in", arrived))
            if self._options.prefill_s > 0:
                await asyncio.sleep(self._options.prefill_s)
            handoff = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": self._engine_id,
                "remote_host": _HOST,
                "remote_port": self._port,
                "remote_block_ids": [0],
                "remote_request_id": rid,
            }
            self._timeline.append((key, "prefill_out", time.monotonic()))
            await self._whole(send, rid, prompt, 1, handoff)
            return
        self._legs["decode"] += 1
        self._timeline.append((key, "decode_in", arrived))
        if params.get("do_remote_prefill") is True:
            self._legs["decode_with_kv"] += 1
        if stream:
            usage = isinstance(so := body.get("stream_options"), dict) and so.get("include_usage")
            await self._stream(send, rid, prompt, max_tokens, bool(usage), key)
        else:
            await self._whole(send, rid, prompt, max_tokens, None)

    async def _tokenize(self, receive: Receive, send: Send, *, render: bool) -> None:
        body = _parse(await _read_body(receive))
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise _BadRequest("prompt must be a string", param="prompt")
        ids = list(prompt.encode()[:_MAX_BODY])
        if render:
            rid = f"cmpl-{self._engine_id}-{next(self._ids)}"
            answer: Any = [{"request_id": rid, "model": self._options.model, "token_ids": ids,
                            "sampling_params": {}}]  # fmt: skip
        else:
            answer = {"count": len(ids), "max_model_len": 131072, "tokens": ids,
                      "token_strs": None}  # fmt: skip
        await _answer(send, 200, orjson.dumps(answer), _JSON_HEADERS)

    def _chunk(self, rid: str, text: str, finish: str | None) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                  "stop_reason": None}  # fmt: skip
        return {"id": rid, "object": "text_completion", "created": int(time.time()),
                "model": self._options.model, "choices": [choice]}  # fmt: skip

    async def _whole(
        self, send: Send, rid: str, prompt: str, n: int, handoff: dict[str, Any] | None
    ) -> None:
        answer = self._chunk(rid, "".join(_tokens(prompt, n)), "length")
        answer["usage"] = _usage(prompt, n)
        if handoff is not None:
            answer["kv_transfer_params"] = handoff
        await _answer(send, 200, orjson.dumps(answer), _JSON_HEADERS)

    async def _stream(
        self, send: Send, rid: str, prompt: str, n: int, usage: bool, key: str
    ) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        step = self._options.token_s
        for i, token in enumerate(_tokens(prompt, n)):
            if step > 0 and i > 0:
                await asyncio.sleep(step)
            event = self._chunk(rid, token, "length" if i == n - 1 else None)
            await _more(send, b"data: " + orjson.dumps(event) + b"\n\n")
            if i == 0:
                self._timeline.append((key, "first_out", time.monotonic()))
        if usage:
            tail = {**self._chunk(rid, "", None), "choices": [], "usage": _usage(prompt, n)}
            await _more(send, b"data: " + orjson.dumps(tail) + b"\n\n")
        await send({"type": "http.response.body", "body": _DONE})


def _usage(prompt: str, completion: int) -> dict[str, int]:
    prompt_tokens = max(1, len(prompt) // 4)  # about four characters per token
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}  # fmt: skip


def _parse(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise _BadRequest("the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise _BadRequest("the body must be a JSON object")
    return body


async def _read_body(receive: Receive) -> bytes:
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _BadRequest("the client left", 499)
        part = message.get("body", b"")
        size += len(part)
        if size > _MAX_BODY:
            raise _BadRequest(f"the body is over {_MAX_BODY} bytes", 413)
        parts.append(part)
        if not message.get("more_body", False):
            return b"".join(parts)


async def _answer(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _more(send: Send, data: bytes) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": True})


async def not_http(scope: Scope, receive: Receive, send: Send) -> bool:
    """Answer what is not an HTTP request (the lifespan protocol: started, stopped); True
    where the scope was not one."""
    if scope["type"] == "lifespan":
        await _lifespan(receive, send)
        return True
    return bool(scope["type"] != "http")


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


@contextlib.asynccontextmanager
async def serve_stock(
    options: StockOptions, prefills: int, decodes: int
) -> AsyncIterator[dict[str, list[str]]]:
    """`prefills` + `decodes` instances in this event loop; yields their base URLs. Both kinds
    are the same server (as ``vllm serve`` instances are): the role is the front's choice."""
    async with contextlib.AsyncExitStack() as stack:
        urls: dict[str, list[str]] = {"prefills": [], "decodes": []}
        for key, count in (("prefills", prefills), ("decodes", decodes)):
            for i in range(count):
                sock = bind_socket(_HOST, 0)
                port = bound_port(sock)
                app = StockEngine(options, engine_id=f"stock-{key[0]}{i}", port=port)
                await stack.enter_async_context(serving(app, sock))
                urls[key].append(f"http://{_HOST}:{port}")
        yield urls
