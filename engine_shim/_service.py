"""What the prefill shim and the decode worker share: the request preamble, the endpoint's
error handling, tracing and the ``/load`` snapshot.

Both take a request the same way (check the cluster token, refuse while draining, read the
body within its size and time limits, validate it with the schema the gateway uses too,
check the model, tokenize or render the chat, check the context length) and differ only in
what they do with it: `ShimService` is that preamble, a role implements `_complete` and adds
its own ``/load`` fields. ``/v1/completions`` and ``/v1/chat/completions`` go through the same
code, told apart by their `Api`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pdgate.config import Role, ShimSettings
from pdgate.config.openai_api import Api, ClientGone, read_body
from pdgate.config.tracing import Span, Tracing
from pdgate.config.wire import REQUEST_ID_HEADER
from pdgate.engine_shim._completion import (
    ApiRequest,
    ChatCompletionRequest,
    chat_prompt,
    check_length,
    check_model,
    parse_request,
)
from pdgate.engine_shim._http import ApiError, ClusterAuth, bad_request, draining
from pdgate.engine_shim._metrics import Histograms
from pdgate.engine_shim._slots import SlotPool
from pdgate.engine_shim._tool_calls import tool_use
from pdgate.engine_shim.backend import (
    TOOL_USE,
    ChatTemplate,
    EngineStats,
    Prompt,
    ReportsModel,
    Sampling,
    ToolCalling,
    ToolUse,
)

__all__ = ["ShimService", "caller_request_id", "end_span", "engine_sampling"]

# Longest engine message passed on to a client (a template's refusal, an unknown token id).
_MAX_ENGINE_MESSAGE = 300


class _Engine(Protocol):
    """What the preamble needs of either role's backend."""

    def tokenize(self, prompt: Prompt) -> list[int]: ...

    def stats(self) -> EngineStats: ...


B = TypeVar("B", bound=_Engine)


class ShimService(Generic[B]):
    role: ClassVar[Role]
    # Cumulative counts reported in /load (and as Prometheus counters).
    counts: ClassVar[tuple[str, ...]] = ("admitted", "rejected", "completed", "cancelled")

    def __init__(
        self,
        settings: ShimSettings,
        backend: B,
        slots: SlotPool,
        *,
        instance_id: str,
        max_body_bytes: int,
        auth: ClusterAuth | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self._settings = settings
        self._backend = backend
        self._slots = slots
        self._instance_id = instance_id
        self._max_body_bytes = max_body_bytes
        self._auth = auth or ClusterAuth(None)
        self._tracing = tracing or Tracing.off()
        self._counts = dict.fromkeys(self.counts, 0)
        # Whether the engine's model calls function tools (engine_shim/_tool_calls.py).
        self._calls_tools = isinstance(backend, ToolCalling)
        self._adapters: frozenset[str] | None = None
        self.draining = False

    @property
    def slots(self) -> SlotPool:
        return self._slots

    def routes(self) -> list[Route]:
        return [
            Route(Api.COMPLETIONS.path, self.completions, methods=["POST"]),
            Route(Api.CHAT.path, self.chat, methods=["POST"]),
        ]

    def load(self) -> dict[str, Any]:
        stats = self._backend.stats()
        return {
            "role": self.role.value,
            "instance_id": self._instance_id,
            "model": self._settings.model,
            "group": self._settings.group,
            "draining": self.draining,
            "capacity": self._slots.capacity,
            "used": self._slots.used,
            "free": self._slots.free,
            "queued": self._slots.queued,
            "waiting": stats.waiting,
            "running": stats.running,
            "retrieving": 0,
            "kv_held": 0,
            "kv_sending": 0,
            "prefix_cache_hit_tokens": stats.prefix_hit_tokens,
            "prefix_cache_total_tokens": stats.prefix_query_tokens,
            "kv_cache_usage": stats.kv_cache_usage,
            "engine_aborted": stats.aborted,
            **self._counts,
            **self._load(),
        }

    def _load(self) -> Mapping[str, Any]:
        """The role's own /load fields (they may replace the common ones)."""
        return {}

    def histograms(self) -> Histograms:
        """Distributions exported on /metrics (see `pdgate.engine_shim._metrics`)."""
        return {}

    async def aclose(self) -> None:
        return None

    # -- POST /v1/completions, /v1/chat/completions ---------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, Api.COMPLETIONS)

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, Api.CHAT)

    async def _serve(self, request: Request, api: Api) -> Response:
        try:
            # Before a byte of the body is read: a caller without the token costs nothing.
            self._auth.check(request)
        except ApiError as exc:
            return exc.response()
        span = self._server_span(request, api)
        try:
            response = await self._complete(request, api, span)
        except ApiError as exc:
            end_span(span, "error", exc.status)
            return exc.response()
        except ClientGone:
            end_span(span, "client_gone")
            return Response(status_code=499)  # nobody is listening; for the access log only
        except BaseException as exc:
            cancelled = isinstance(exc, asyncio.CancelledError)
            end_span(
                span, "cancelled" if cancelled else "internal_error", None if cancelled else 500
            )
            raise
        return response

    def _server_span(self, request: Request, api: Api) -> Span:
        """The request's span, in the caller's trace (W3C ``traceparent``); ended by the
        role once its answer is whole (a stream: when it ends)."""
        span = self._tracing.serve(f"pdgate.shim.{self.role.value}", request.headers)
        if span.is_recording():
            span.set_attribute("pdgate.instance", self._instance_id)
            span.set_attribute("pdgate.api", api.value)
            rid = caller_request_id(request)
            if rid is not None:
                span.set_attribute("pdgate.request_id", rid[:128])
        return span

    async def _complete(self, request: Request, api: Api, span: Span) -> Response:
        """The role's answer; it ends `span` on success (errors end it in `_serve`)."""
        raise NotImplementedError

    async def _read(self, request: Request, api: Api) -> ApiRequest:
        """The request's validated body; refused while draining."""
        if self.draining:
            raise draining()
        body = await read_body(request, self._max_body_bytes, self._settings.body_timeout_s)
        return self._parse(body, api)

    @property
    def adapters(self) -> frozenset[str]:
        """The LoRA adapters the engine serves (`ReportsModel`), read once it runs."""
        if self._adapters is None:
            backend = self._backend
            served = backend.served_model() if isinstance(backend, ReportsModel) else None
            self._adapters = frozenset(served.adapters if served is not None else ())
        return self._adapters

    def _adapter(self, req: ApiRequest) -> str | None:
        """The adapter `req` is for (None: the model itself), as `_parse` checked it."""
        model = req.model
        return None if model is None or model == self._settings.model else model

    def _parse(self, body: bytes, api: Api) -> ApiRequest:
        req = parse_request(body, max_model_len=self._settings.max_model_len, api=api)
        check_model(req.model, self._settings.model, self.adapters)
        if isinstance(req, ChatCompletionRequest):
            _check_chat(req)
            tool_use(req, can_call=self._calls_tools)
        return req

    def _tool_use(self, req: ApiRequest) -> ToolUse | None:
        """The chat's tools for an engine whose model calls them (checked by `_parse`);
        None: the model answers with text."""
        if not self._calls_tools or not isinstance(req, ChatCompletionRequest) or not req.tools:
            return None
        return tool_use(req, can_call=True)

    def _tokens(self, req: ApiRequest, max_tokens: int | None = None) -> list[int]:
        """The prompt's token ids (a chat rendered with the model's template), within the
        model's context with `max_tokens` (default: the request's ``max_tokens``)."""
        param = "prompt"
        try:
            if isinstance(req, ChatCompletionRequest):
                param = "messages"
                if not isinstance(self._backend, ChatTemplate):
                    raise bad_request("this engine does not serve chat completions", param)
                tokens = self._backend.render_chat(chat_prompt(req))
            else:
                tokens = self._backend.tokenize(req.one_prompt)
        except ValueError as exc:
            raise bad_request(str(exc)[:_MAX_ENGINE_MESSAGE], param) from None
        if max_tokens is None:
            max_tokens = req.max_tokens or 0
        check_length(len(tokens), max_tokens, self._settings.max_model_len)
        return tokens


def engine_sampling(req: ApiRequest, tools: ToolUse | None) -> Sampling:
    """What the engine gets of the request's sampling: the client's fields, and the chat's
    tools for an engine that calls them (as vLLM's structured outputs ride in its sampling
    params)."""
    out = req.sampling()
    if tools is not None:
        out[TOOL_USE] = tools
    return out


def _check_chat(req: ChatCompletionRequest) -> None:
    """Refuse what pdgate's engines cannot honour rather than answer with less (a stock vLLM
    behind the gateway gets these fields as the client sent them); tools: `tool_use`."""
    fmt = req.response_format
    if fmt is not None and fmt.get("type") != "text":
        raise bad_request("this engine produces text only (response_format)", "response_format")


def end_span(span: Span, outcome: str, status: int | None = None) -> None:
    if span.is_recording():
        span.set_attribute("pdgate.outcome", outcome)
        if status is not None:
            span.set_attribute("http.response.status_code", status)
    span.end()


def caller_request_id(request: Request) -> str | None:
    """The caller's ``x-request-id``, if any (checked where it is used)."""
    return request.headers.get(REQUEST_ID_HEADER)
