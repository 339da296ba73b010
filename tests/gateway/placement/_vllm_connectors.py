"""A stock vLLM 0.32 server with a GPU KV connector, faked as a real process: no machine here
runs NIXL or Mooncake, so this server speaks each connector's handshake as vLLM 0.32's own
source defines it, and checks every leg it is sent against that source, field by field.

``python -m tests.gateway.placement._vllm_connectors --connector nixl|nixl_push|mooncake
--role prefill|decode --model NAME`` prints ``vllm-connector: http://127.0.0.1:PORT
side=PORT`` once listening. PORT is vLLM's OpenAI server; the side port stands in for what
the connector listens on besides it: NIXL's side channel (``VLLM_NIXL_SIDE_CHANNEL_PORT``,
a ZMQ socket in vLLM) where a decode reads or registers, Mooncake's bootstrap server
(``VLLM_MOONCAKE_BOOTSTRAP_PORT``, HTTP ``GET /query`` in vLLM) and its transfer engine. The
KV itself is not moved: a fake decode tells the fake prefill what the real one would (read,
register, pull), and the prefill checks it names exactly what it handed out.

Every rule a leg breaks answers 400 with the rule and the vLLM source it comes from (so the
client's request fails), and is kept in ``GET /_stats`` ``violations``; rules and sources:

* every leg (``vllm/entrypoints/serve/engine/serving.py`` ``_base_request_id``: the engine's
  request id is ``X-Request-Id``; the proxies ``toy_proxy_server.py``,
  ``toy_push_proxy_server.py`` and ``mooncake_connector_proxy.py`` send one on both legs):
  an ``X-Request-Id`` header, and no ``x-pdgate-*`` header (a shim's, meaningless here);
* the prefill leg (the proxies' ``send_request_to_service`` / ``send_prefill_request``):
  ``max_tokens`` 1, ``stream`` false, no ``stream_options``, no ``min_tokens`` (the NIXL
  proxies pop it: with ``max_tokens`` 1 vLLM's sampling params refuse it), and
  ``kv_transfer_params`` exactly the proxy's: NIXL's six fields
  (``do_remote_decode`` true, ``do_remote_prefill`` false, ``remote_engine_id``,
  ``remote_block_ids``, ``remote_host``, ``remote_port`` null), Mooncake's
  ``do_remote_decode``, ``do_remote_prefill`` and ``transfer_id`` = ``xfer-`` + the
  request id, with ``X-data-parallel-rank`` (``MooncakeConnectorScheduler
  .update_state_after_alloc`` reads ``transfer_id``);
* its answer: NIXL's ``kv_transfer_params`` as ``NixlPullConnectorScheduler
  .request_finished`` / ``NixlPushConnectorScheduler.request_finished`` return them
  (``pull_scheduler.py``, ``push_scheduler.py``); Mooncake's ``null``
  (``MooncakeConnectorScheduler.request_finished`` returns None);
* the decode leg: NIXL pull, the prefill's answer's params unchanged
  (``toy_proxy_server.py``; ``NixlPullConnectorScheduler.update_state_after_alloc`` reads
  ``remote_block_ids``, ``remote_engine_id``, ``remote_request_id``, ``remote_host``,
  ``remote_port``), and the prefill leg's ``X-Request-Id``; NIXL push,
  ``do_remote_prefill`` true, ``do_remote_decode`` false, the prefill's
  ``remote_engine_id``, ``remote_host``, ``remote_port``, ``tp_size`` and no
  ``remote_block_ids`` (``toy_push_proxy_server.py``;
  ``NixlPushConnectorScheduler.update_state_after_alloc`` reads them), under a request id
  whose base (``nixl/utils.py`` ``get_base_request_id``) is the prefill's: the prefill
  pushes to the decode whose registration matches it (``push_worker.py``
  ``_pop_matching_registration``); Mooncake, ``do_remote_decode`` false,
  ``do_remote_prefill`` true, ``remote_bootstrap_addr``, ``remote_engine_id`` of the rank
  and the prefill leg's ``transfer_id`` (``mooncake_connector_proxy.py``).

A prefill holds a finished request's blocks until a decode reads them (NIXL pull), it pushes
them (NIXL push, on a matching registration), a decode pulls them (Mooncake), a decode
refuses a request carrying them (vLLM's ``_with_kv_transfer_rejection_cleanup`` then runs
the connector's ``request_finished``, which tells the prefill to free them), or its lease
ends (``--lease-s``: NIXL's ``kv_lease_duration``, Mooncake's
``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT``). An aborted prefill holds nothing. ``GET /_stats``
counts the blocks held now and how each was freed, the legs, the decode legs' bodies, and
the push registrations that reached the prefill while it computed
(``registered_while_prefilling``). A decode refuses, as vLLM 0.32's
``OpenAIServingCompletion._create_completion`` does, a streamed request with
``use_beam_search`` (400) before its engine sees it. For the tests: ``POST /_prefill_s?s=X``
and ``/_token_s?s=X`` set how long a prefill and a decode's token take, ``POST
/_refuse?times=N`` makes the next N prefill legs answer 429 (vLLM queues instead; an
overload stands in).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import socket
import sys
import time
import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from pdgate.config.wire import prefill_kv_request
from tests.registry._stock_server import ServerProcess, completion_text, openai_answer

READY = "vllm-connector: "
BLOCK_TOKENS = 16
_MAX_VIOLATIONS = 200
_BASE_RE = re.compile(r"-[0-9a-f]{8}$")  # vLLM's nixl/utils.py _RANDOM_SUFFIX_RE


def base_request_id(request_id: str) -> str:
    return _BASE_RE.sub("", request_id)


class Violation(Exception):
    pass


@dataclass
class Held:
    """A finished prefill's blocks, held for a decode."""

    internal_id: str
    x_request_id: str
    params: dict[str, Any] | None
    expires: float
    ready: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Registration:
    """NIXL push: a decode's registration (push_scheduler.py ``_push_pending_registrations``)."""

    request_id: str
    engine_id: str
    done: asyncio.Event = field(default_factory=asyncio.Event)
    ok: bool = False


class Fake:
    def __init__(self, args: argparse.Namespace) -> None:
        self.connector: str = args.connector
        self.role: str = args.role
        self.model: str = args.model
        self.prefill_s: float = args.prefill_s
        self.token_s: float = args.token_s
        self.lease_s: float = args.lease_s
        self.engine_id: str = args.engine_id or f"engine-{uuid.uuid4()}"
        self.tp_size: int = args.tp
        self.side_port = 0
        self.port = 0
        self.held: dict[str, Held] = {}  # pull: internal id; push: internal id; mooncake: xfer id
        self.registrations: dict[str, Registration] = {}  # push: by the decode's base id
        self.violations: list[str] = []
        self.freed: Counter[str] = Counter()
        self.stats: Counter[str] = Counter()
        self.now: Counter[str] = Counter()
        self.peak: Counter[str] = Counter()
        self.decode_bodies: deque[dict[str, Any]] = deque(maxlen=100)
        self.refuse = 0  # prefill legs to answer 429 (vLLM queues; a test's overload)
        self.side = httpx.AsyncClient(timeout=30, headers={"x-fake-peer": "decode"})

    # -- bookkeeping ------------------------------------------------------------------------

    def violated(self, rule: str) -> Violation:
        if len(self.violations) < _MAX_VIOLATIONS:
            self.violations.append(rule)
        return Violation(rule)

    def enter(self, what: str) -> None:
        self.now[what] += 1
        self.peak[what] = max(self.peak[what], self.now[what])

    def free(self, key: str, how: str) -> bool:
        held = self.held.pop(key, None)
        if held is None:
            return False
        self.freed[how] += 1
        return True

    async def sweep(self) -> None:
        """Blocks whose lease ended are freed (NIXL kv_lease_duration, Mooncake's
        VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT); stale push registrations dropped
        (push_scheduler.py's registration watchdog)."""
        while True:
            await asyncio.sleep(0.05)
            now = time.monotonic()
            for key in [k for k, h in self.held.items() if h.expires < now]:
                self.free(key, "lease")

    def snapshot(self) -> dict[str, Any]:
        return {
            "connector": self.connector,
            "role": self.role,
            "engine_id": self.engine_id,
            "held": len(self.held),
            "freed": dict(self.freed),
            "violations": list(self.violations),
            "counts": dict(self.stats),
            "now": dict(self.now),
            "peak": dict(self.peak),
            "decode_bodies": list(self.decode_bodies)[-20:],
            "pending_registrations": len(self.registrations),
        }

    # -- checks -----------------------------------------------------------------------------

    def common_headers(self, headers: Any, leg: str) -> str:
        rid = headers.get("x-request-id")
        if not rid:
            raise self.violated(
                f"{leg}: no X-Request-Id (serving.py _base_request_id; the proxies send one)"
            )
        shim = sorted(h for h in headers if h.lower().startswith("x-pdgate-"))
        if shim:
            raise self.violated(f"{leg}: pdgate shim headers {shim} sent to a stock engine")
        return str(rid)

    def check_prefill_body(self, body: dict[str, Any], rid: str, headers: Any) -> None:
        proxy = "mooncake_connector_proxy.py" if self.connector == "mooncake" else "toy_proxy"
        if body.get("max_tokens") != 1 or body.get("stream") not in (False, None):
            raise self.violated(f"prefill leg: max_tokens 1 and stream false ({proxy})")
        if body.get("max_completion_tokens") not in (None, 1):
            raise self.violated(f"prefill leg: max_completion_tokens must be 1 ({proxy})")
        if "stream_options" in body:
            raise self.violated(f"prefill leg: stream_options deleted ({proxy})")
        params = body.get("kv_transfer_params")
        if self.connector in ("nixl", "nixl_push"):
            if "min_tokens" in body or "min_completion_tokens" in body:
                raise self.violated("prefill leg: min_tokens popped (toy_proxy_server.py)")
            # toy_proxy_server.py's six params, which the gateway builds in config/wire.py.
            if params != prefill_kv_request():
                raise self.violated(
                    f"prefill leg: kv_transfer_params {params!r} are not toy_proxy_server.py's"
                )
            return
        expected = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": f"xfer-{rid}",
        }
        if params != expected:
            raise self.violated(
                f"prefill leg: kv_transfer_params {params!r}, mooncake_connector_proxy.py "
                f"sends {expected!r}"
            )
        if headers.get("x-data-parallel-rank") != "0":
            raise self.violated(
                "prefill leg: X-data-parallel-rank names the rank (mooncake_connector_proxy.py)"
            )

    def check_decode_params(self, params: Any) -> dict[str, Any]:
        if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
            raise self.violated(f"decode leg: kv_transfer_params {params!r} lack do_remote_prefill")
        if self.connector == "nixl":
            need = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host")
            if any(k not in params for k in (*need, "remote_port", "tp_size")):
                raise self.violated(
                    f"decode leg: {sorted(params)} lack a field pull_scheduler.py reads"
                )
        elif self.connector == "nixl_push":
            allowed = {
                "do_remote_prefill",
                "do_remote_decode",
                "remote_engine_id",
                "remote_request_id",
                "remote_host",
                "remote_port",
                "tp_size",
            }
            if params.get("do_remote_decode") is not False or set(params) - allowed:
                raise self.violated(
                    f"decode leg: {sorted(params)}: toy_push_proxy_server.py sends "
                    f"{sorted(allowed)}, do_remote_decode false, no remote_block_ids"
                )
            for key in ("remote_engine_id", "remote_host", "remote_port", "tp_size"):
                if params.get(key) is None:
                    raise self.violated(f"decode leg: no {key} (push_scheduler.py reads it)")
        else:
            expected_keys = {
                "do_remote_decode",
                "do_remote_prefill",
                "remote_bootstrap_addr",
                "remote_engine_id",
                "transfer_id",
            }
            if set(params) != expected_keys or params["do_remote_decode"] is not False:
                raise self.violated(
                    f"decode leg: {sorted(params)}, mooncake_connector_proxy.py sends "
                    f"{sorted(expected_keys)}"
                )
        return params

    # -- the prefill --------------------------------------------------------------------------

    def prefill_params(self, internal_id: str, blocks: list[int], tokens: int) -> Any:
        if self.connector == "mooncake":
            return None  # MooncakeConnectorScheduler.request_finished returns None
        params: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [blocks],
            "remote_engine_id": self.engine_id,
            "remote_request_id": internal_id,
            "remote_host": "127.0.0.1",
            "remote_port": self.side_port,
            "tp_size": self.tp_size,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": tokens,
        }
        if self.connector == "nixl":
            params["remote_blocks_expiry_time"] = None
        params["transfer_mode"] = "push" if self.connector == "nixl_push" else "pull"
        return params

    async def prefill_leg(self, request: Any, body: dict[str, Any], chat: bool) -> Any:
        from starlette.responses import JSONResponse

        rid = self.common_headers(request.headers, "prefill leg")
        self.check_prefill_body(body, rid, request.headers)
        if self.refuse > 0:
            self.refuse -= 1
            self.stats["prefill_refused"] += 1
            return JSONResponse({"error": {"message": "busy", "code": 429}}, 429)
        prompt = prompt_of(body, chat)
        internal = (f"chatcmpl-{rid}" if chat else f"cmpl-{rid}-0") + f"-{uuid.uuid4().hex[:8]}"
        self.stats["prefill_legs"] += 1
        self.enter("prefill")
        try:
            if not await computed(request, self.prefill_s):
                self.stats["prefill_aborted"] += 1  # an aborted prefill frees its blocks
                return JSONResponse({"error": "aborted"}, 499)
        finally:
            self.now["prefill"] -= 1
        tokens = len(prompt.encode()) + 1
        blocks = list(range(-(-tokens // BLOCK_TOKENS)))
        params = self.prefill_params(internal, blocks, tokens)
        key = body["kv_transfer_params"]["transfer_id"] if params is None else internal
        held = Held(internal, rid, params, time.monotonic() + self.lease_s)
        self.held[key] = held
        held.ready.set()
        if self.connector == "nixl_push":
            self.match_push(base_request_id(internal))
        reply = completion(self.model, rid, chat, completion_text(prompt, 1), "length")
        reply["kv_transfer_params"] = params
        return JSONResponse(reply)

    def match_push(self, base: str) -> None:
        """A finished prefill and a registration with the same base id: the prefill writes
        into the decode's blocks, then frees its own (push_worker.py)."""
        reg = self.registrations.get(base)
        held = (k for k, h in self.held.items() if base_request_id(h.internal_id) == base)
        key = next(held, None)
        if reg is None or key is None:
            return
        del self.registrations[base]
        self.free(key, "push")
        reg.ok = True
        reg.done.set()

    # -- the side port (prefill) ----------------------------------------------------------------

    async def side_read(self, request: Any) -> Any:
        """NIXL pull: a decode reads the blocks named by params (an empty read, from a
        request the decode refused, only frees them: pull_scheduler.request_finished)."""
        from starlette.responses import JSONResponse

        data = orjson.loads(await request.body())
        params, rid = data["params"], data["x_request_id"]
        held = self.held.get(str(params.get("remote_request_id")))
        if params.get("remote_engine_id") != self.engine_id or held is None:
            return JSONResponse({"error": "no such request or engine"}, 409)
        if params != held.params:
            self.violated(f"decode leg: params {params!r} are not the prefill's answer's")
            return JSONResponse({"error": "params changed on the way"}, 409)
        if data["empty"]:
            self.free(held.internal_id, "rejected")
        else:
            if rid != held.x_request_id:
                self.violated("decode leg: X-Request-Id differs from the prefill leg's")
            self.free(held.internal_id, "read")
        return JSONResponse({"ok": True})

    async def side_register(self, request: Any) -> Any:
        """NIXL push: a decode's registration, matched by base request id."""
        from starlette.responses import JSONResponse

        data = orjson.loads(await request.body())
        if data["remote_engine_id"] != self.engine_id:
            return JSONResponse({"error": "engine id mismatch"}, 409)
        base = base_request_id(data["request_id"])
        if not any(base_request_id(h.internal_id) == base for h in self.held.values()):
            # Named to the prefill before it was done: it pushes as soon as it is.
            self.stats["registered_while_prefilling"] += 1
        reg = self.registrations[base] = Registration(data["request_id"], data["decode_engine"])
        self.match_push(base)
        try:
            await asyncio.wait_for(reg.done.wait(), self.lease_s)
        except TimeoutError:
            self.registrations.pop(base, None)
            return JSONResponse({"error": "no push"}, 504)
        return JSONResponse({"ok": reg.ok})

    async def side_pull(self, request: Any) -> Any:
        """Mooncake: a decode pulls by transfer id, waiting for the prefill to finish; an
        empty pull only frees (MooncakeConnectorWorker._handle_failed_recv)."""
        from starlette.responses import JSONResponse

        data = orjson.loads(await request.body())
        if data["remote_engine_id"] != self.engine_id:
            return JSONResponse({"error": "engine id mismatch"}, 409)
        xfer = data["transfer_id"]
        deadline = time.monotonic() + self.lease_s
        while xfer not in self.held:
            if time.monotonic() > deadline:
                return JSONResponse({"error": "timeout waiting for P side ready"}, 504)
            await asyncio.sleep(0.01)
        self.free(xfer, "rejected" if data["empty"] else "pull")
        return JSONResponse({"ok": True})

    async def side_query(self, request: Any) -> Any:
        """Mooncake's bootstrap server: MooncakeBootstrapServer.query."""
        from starlette.responses import JSONResponse

        addr = f"127.0.0.1:{self.side_port}"
        return JSONResponse({"0": {"engine_id": self.engine_id, "worker_addr": {"0": {"0": addr}}}})

    # -- the decode ---------------------------------------------------------------------------

    async def transfer(self, params: dict[str, Any], rid: str, internal: str, empty: bool) -> bool:
        """What the decode's connector does with the prefill: read, register or pull."""
        if self.connector == "mooncake":
            url = str(params["remote_bootstrap_addr"]) + "/mooncake/pull"
            payload: dict[str, Any] = {
                "transfer_id": params["transfer_id"],
                "remote_engine_id": params["remote_engine_id"],
                "empty": empty,
            }
        else:
            side = f"http://{params['remote_host']}:{params['remote_port']}"
            if self.connector == "nixl":
                url = side + "/nixl/read"
                payload = {"params": params, "x_request_id": rid, "empty": empty}
            else:
                if empty:
                    return True  # a refused push request registers nothing
                url = side + "/nixl/push_reg"
                payload = {
                    "request_id": internal,
                    "decode_engine": self.engine_id,
                    "remote_engine_id": params["remote_engine_id"],
                }
        try:
            resp = await self.side.post(url, content=orjson.dumps(payload))
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    async def decode_leg(self, request: Any, body: dict[str, Any], chat: bool) -> Any:
        from starlette.responses import JSONResponse, StreamingResponse

        rid = self.common_headers(request.headers, "decode leg")
        params = self.check_decode_params(body.get("kv_transfer_params"))
        internal = (f"chatcmpl-{rid}" if chat else f"cmpl-{rid}-0") + f"-{uuid.uuid4().hex[:8]}"
        if body.get("stream") and body.get("use_beam_search"):
            # OpenAIServingCompletion._create_completion's first refusal, before the engine;
            # _with_kv_transfer_rejection_cleanup then frees the prefill's blocks.
            self.stats["refused_legs"] += 1
            await self.transfer(params, rid, internal, empty=True)
            message = "Streaming is not currently supported with beam search"
            return JSONResponse({"error": {"message": message, "code": 400}}, 400)
        self.stats["decode_legs"] += 1
        kept = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        self.decode_bodies.append({**kept, "x-request-id": rid})
        prompt = prompt_of(body, chat)
        max_tokens = int(body.get("max_tokens") or 16)
        usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def events() -> AsyncIterator[bytes]:
            self.enter("decode")
            loaded = False
            try:
                loaded = await self.transfer(params, rid, internal, empty=False)
                if not loaded:
                    # kv_load_failure_policy "fail" (vLLM's default): the request errors.
                    error = {"error": {"message": "KV load failed", "code": 500}}
                    yield b"data: " + orjson.dumps(error) + b"\n\n"
                    return
                text = completion_text(prompt, max_tokens)
                pieces = text.split(" ")[1:]
                for i, piece in enumerate(pieces):
                    await asyncio.sleep(self.token_s)
                    finish = "length" if i == len(pieces) - 1 else None
                    event = completion(self.model, rid, chat, " " + piece, finish, chunk=True)
                    yield b"data: " + orjson.dumps(event) + b"\n\n"
                if usage:
                    n = len(prompt.encode()) + 1
                    counts = {"prompt_tokens": n, "completion_tokens": max_tokens}
                    tail = completion(self.model, rid, chat, "", None, chunk=True)
                    tail["choices"] = []
                    tail["usage"] = {**counts, "total_tokens": n + max_tokens}
                    yield b"data: " + orjson.dumps(tail) + b"\n\n"
                yield b"data: [DONE]\n\n"
                self.stats["decode_done"] += 1
            finally:
                self.now["decode"] -= 1
                if not loaded and self.connector != "nixl_push":
                    # Aborted before its KV came: request_finished still sees
                    # do_remote_prefill and tells the prefill to free (an empty read/pull).
                    self.stats["decode_aborted"] += 1
                    asyncio.get_running_loop().create_task(
                        self.transfer(params, rid, internal, empty=True)
                    )

        return StreamingResponse(events(), media_type="text/event-stream")

    # -- the app --------------------------------------------------------------------------------

    async def leg(self, request: Any, chat: bool) -> Any:
        from starlette.responses import JSONResponse

        body = orjson.loads(await request.body())
        if body.get("model") != self.model:
            return JSONResponse({"error": {"message": "no such model", "code": 404}}, 404)
        try:
            if self.role == "prefill":
                return await self.prefill_leg(request, body, chat)
            return await self.decode_leg(request, body, chat)
        except Violation as exc:
            return JSONResponse({"error": {"message": str(exc), "code": 400}}, 400)

    def apps(self) -> tuple[Any, Any]:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse, Response
        from starlette.routing import Route

        async def models(request: Request) -> Response:
            card = {"id": self.model, "object": "model", "parent": None, "max_model_len": 8192}
            return JSONResponse({"object": "list", "data": [card]})

        async def health(request: Request) -> Response:
            return Response(status_code=200)

        async def openapi(request: Request) -> Response:
            paths = {"/v1/completions": {}, "/v1/chat/completions": {}, "/v1/models": {}}
            return JSONResponse({"openapi": "3.1.0", "paths": paths})

        async def stats(request: Request) -> Response:
            return JSONResponse(self.snapshot())

        async def set_prefill_s(request: Request) -> Response:
            self.prefill_s = float(request.query_params["s"])
            return Response(status_code=204)

        async def set_token_s(request: Request) -> Response:
            self.token_s = float(request.query_params["s"])
            return Response(status_code=204)

        async def set_refuse(request: Request) -> Response:
            self.refuse = int(request.query_params["times"])
            return Response(status_code=204)

        async def completions(request: Request) -> Response:
            return await self.leg(request, chat=False)

        async def chat(request: Request) -> Response:
            return await self.leg(request, chat=True)

        async def stranger(request: Request, exc: Exception) -> Response:
            # Anything else (a shim's DELETE /v1/kv/{id}, its batch endpoint, /load): vLLM
            # has no such route.
            self.violated(f"{request.method} {request.url.path}: not a vLLM route")
            return JSONResponse({"detail": "Not Found"}, 404)

        api = Starlette(
            routes=[
                Route("/v1/models", models, methods=["GET"]),
                Route("/health", health, methods=["GET"]),
                Route("/openapi.json", openapi, methods=["GET"]),
                Route("/v1/completions", completions, methods=["POST"]),
                Route("/v1/chat/completions", chat, methods=["POST"]),
                Route("/_stats", stats, methods=["GET"]),
                Route("/_prefill_s", set_prefill_s, methods=["POST"]),
                Route("/_token_s", set_token_s, methods=["POST"]),
                Route("/_refuse", set_refuse, methods=["POST"]),
            ],
            exception_handlers={404: stranger, 405: stranger},
        )

        async def side_stranger(request: Request, exc: Exception) -> Response:
            self.violated(f"{request.method} {request.url.path} on the connector's port")
            return JSONResponse({"detail": "Not Found"}, 404)

        def peer_only(handler: Any) -> Any:
            async def checked(request: Request) -> Response:
                if request.headers.get("x-fake-peer") != "decode":
                    self.violated(f"{request.method} {request.url.path}: only a decode calls here")
                    return JSONResponse({"detail": "Not Found"}, 404)
                result: Response = await handler(request)
                return result

            return checked

        side = Starlette(
            routes=[
                Route("/query", self.side_query, methods=["GET"]),
                Route("/nixl/read", peer_only(self.side_read), methods=["POST"]),
                Route("/nixl/push_reg", peer_only(self.side_register), methods=["POST"]),
                Route("/mooncake/pull", peer_only(self.side_pull), methods=["POST"]),
            ],
            exception_handlers={404: side_stranger, 405: side_stranger},
        )
        return api, side


async def computed(request: Any, seconds: float) -> bool:
    """Compute for `seconds`; False if the caller left meanwhile (vLLM aborts the request)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if await request.is_disconnected():
            return False
        await asyncio.sleep(min(0.01, max(0.0, end - time.monotonic())))
    return True


def prompt_of(body: dict[str, Any], chat: bool) -> str:
    if not chat:
        return str(body.get("prompt"))
    return "\n".join(str(m.get("content")) for m in body.get("messages") or [])


def completion(
    model: str, rid: str, chat: bool, text: str, finish: str | None, *, chunk: bool = False
) -> dict[str, Any]:
    """vLLM's answer: its id is vLLM's prefix and the caller's request id."""
    return openai_answer(
        model, ("chatcmpl-" if chat else "cmpl-") + rid, chat, text, finish, chunk=chunk
    )


def serve(argv: list[str]) -> int:
    import uvicorn

    p = argparse.ArgumentParser()
    p.add_argument("--connector", choices=["nixl", "nixl_push", "mooncake"], required=True)
    p.add_argument("--role", choices=["prefill", "decode"], required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--prefill-s", type=float, default=0.05)
    p.add_argument("--token-s", type=float, default=0.005)
    p.add_argument("--lease-s", type=float, default=30.0)
    p.add_argument("--engine-id", default="")
    p.add_argument("--tp", type=int, default=1)
    args = p.parse_args(argv)
    fake = Fake(args)
    api, side = fake.apps()
    socks = []
    for port in (args.port, 0):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        socks.append(sock)
    fake.port, fake.side_port = (s.getsockname()[1] for s in socks)
    servers = [
        uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        for app in (api, side)
    ]

    async def main() -> None:
        tasks = [
            asyncio.create_task(server.serve(sockets=[sock]))
            for server, sock in zip(servers, socks, strict=True)
        ]
        sweeper = asyncio.create_task(fake.sweep())
        while not all(s.started for s in servers):
            for task in tasks:
                if task.done():
                    await task
                    return
            await asyncio.sleep(0.01)
        print(f"{READY}http://127.0.0.1:{fake.port} side={fake.side_port}", flush=True)
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        sweeper.cancel()

    asyncio.run(main())
    return 0


class ConnectorServer(ServerProcess):
    """One fake server process; `kill()` stops it."""

    def __init__(self, connector: str, role: str, model: str, **options: Any) -> None:
        super().__init__()
        self.connector, self.role, self.model = connector, role, model
        self.options = options
        self.port = 0
        self.side_port = 0

    @property
    def side(self) -> str:
        """Its connector's port, HOST:PORT (NIXL's side channel, Mooncake's bootstrap)."""
        return f"127.0.0.1:{self.side_port}"

    def start(self, timeout: float = 20.0) -> ConnectorServer:
        args = ["tests.gateway.placement._vllm_connectors", "--connector", self.connector]
        args += ["--role", self.role, "--model", self.model]
        for key, value in self.options.items():
            args += [f"--{key.replace('_', '-')}", str(value)]
        url, side = self._spawn(args, dict(os.environ), READY, timeout).split()
        self.port = int(url.rsplit(":", 1)[1])
        self.side_port = int(side.removeprefix("side="))
        return self

    def set_token_s(self, seconds: float) -> None:
        httpx.post(self.url + f"/_token_s?s={seconds}", timeout=5).raise_for_status()

    def refuse(self, times: int) -> None:
        """The next `times` prefill legs answer 429."""
        httpx.post(self.url + f"/_refuse?times={times}", timeout=5).raise_for_status()


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1:]))
