"""``POST /v1/messages``, Anthropic's Messages API, served as a chat request.

The request becomes one chat completions request (`MessagesFront.translate`), as vLLM's own
Messages layer does it (vllm/entrypoints/anthropic/serving.py,
``to_chat_completion_request``): ``system`` the first message; ``text`` blocks the content;
an assistant's ``tool_use`` blocks its ``tool_calls``; a user's ``tool_result`` blocks ``tool``
messages ahead of the rest of that turn; ``max_tokens``, ``stop_sequences``, ``temperature``,
``top_p``, ``top_k``, ``metadata.user_id`` (as ``user``), ``tools`` (their ``input_schema`` as
the parameters), ``tool_choice`` (``any`` as ``required``, ``tool`` as a named function,
``disable_parallel_tool_use`` as ``parallel_tool_calls``) and ``output_config.format`` (as
``response_format``) as chat's.

The answer (`MessagesShaper`) is a ``message`` object, or the API's stream: ``message_start``,
``ping``, per content block ``content_block_start``, ``content_block_delta`` (``text_delta``,
``input_json_delta``, ``thinking_delta``) and ``content_block_stop``, then ``message_delta``
(``stop_reason``, ``stop_sequence``, usage) and ``message_stop``. A failure after the stream
began is an ``error`` event. Errors before it are Anthropic's ``{"type": "error", "error":
{...}}`` with the status the gateway chose (a 503 past capacity, with ``Retry-After``).

Clients authenticate with ``x-api-key`` (Anthropic's SDKs) or ``Authorization: Bearer``;
``anthropic-version`` and ``anthropic-beta`` are accepted and not needed.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

import orjson
from starlette.responses import Response
from starlette.types import ASGIApp

from pdgate.config.openai_api import OpenAIError, load_object
from pdgate.config.wire import MAX_STOP_SEQUENCES
from pdgate.gateway.admission.auth import ApiKey
from pdgate.gateway.errors import BadRequest, from_openai_error
from pdgate.gateway.translate import checks
from pdgate.gateway.translate.base import (
    ChatReader,
    ChatShaper,
    ToolCall,
    Translated,
    chat_request,
    named_event,
)

__all__ = ["MessagesFront", "MessagesShaper", "anthropic_error", "chat_messages"]

MAX_ITEMS = 2048
_FIELDS = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "system",
        "stop_sequences",
        "temperature",
        "top_p",
        "top_k",
        "tools",
        "tool_choice",
        "metadata",
        "stream",
        "thinking",
        "output_config",
        # Hints for Anthropic's own service (prompt caching, routing, tiers): nothing to do
        # for them here, and nothing lost by their absence.
        "service_tier",
        "cache_control",
        "inference_geo",
        "speed",
        "diagnostics",
        "user_profile_id",
        "workspace_id",
        "container",
        "mcp_servers",
        "context_management",
    }
)
_REFUSED = {
    "container": "containers (code execution) are not supported",
    "mcp_servers": "MCP servers are not supported",
    "context_management": "context management is not supported",
}
# Anthropic's error type for each status the gateway answers with.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def anthropic_error(error: OpenAIError, request_id: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "type": "error",
        "error": {"type": _ERROR_TYPES.get(error.status, "api_error"), "message": error.message},
    }
    if error.retry_after is not None:
        body["error"]["retry_after"] = error.retry_after
    if request_id is not None:
        body["request_id"] = request_id
    return body


class MessagesFront:
    """Translates Anthropic Messages requests into chat requests and their answers back."""

    name = "messages"

    def __init__(self, *, max_tokens_limit: int) -> None:
        self._max_tokens_limit = max_tokens_limit

    def credentials(self, headers: Mapping[str, str]) -> str | None:
        authorization = headers.get("authorization")
        if authorization is None and (key := headers.get("x-api-key")) is not None:
            return f"Bearer {key}"
        return authorization

    def error(self, error: OpenAIError) -> ASGIApp:
        return Response(
            orjson.dumps(anthropic_error(error)),
            status_code=error.status,
            headers=error.headers(),
            media_type="application/json",
        )

    def chat_body(self, raw: dict[str, Any], *, counting: bool = False) -> dict[str, Any]:
        """The request (``counting``: a count_tokens request, no ``max_tokens``) as a chat
        body. Raises `BadRequest`."""
        for name in raw:
            if name not in _FIELDS:
                raise BadRequest(f"{name[:64]}: Extra inputs are not permitted", param=name[:64])
        for name, why in _REFUSED.items():
            if raw.get(name) is not None:
                raise BadRequest(why, param=name)
        model = checks.text_of(raw.get("model"), "model")
        chat: dict[str, Any] = {"model": model, "messages": chat_messages(raw)}
        if not counting:
            limit = checks.count_of(raw.get("max_tokens"), "max_tokens", 1, self._max_tokens_limit)
            if limit is None:
                raise checks.invalid("max_tokens", "Field required")
            chat["max_tokens"] = limit
            stream = checks.flag_of(raw.get("stream"), "stream", False)
            chat["stream"] = stream
            if stream:
                chat["stream_options"] = {"include_usage": True}
            stops = checks.list_of(
                raw.get("stop_sequences") or [], "stop_sequences", MAX_STOP_SEQUENCES
            )
            if stops:
                chat["stop"] = [
                    checks.text_of(s, f"stop_sequences[{i}]") for i, s in enumerate(stops)
                ]
            for name, high in (("temperature", 1), ("top_p", 1)):
                value = checks.number_of(raw.get(name), name, 0, high, open_low=name == "top_p")
                if value is not None:
                    chat[name] = value
            if (top_k := checks.count_of(raw.get("top_k"), "top_k", 0, 1 << 20)) is not None:
                chat["top_k"] = top_k
            if raw.get("metadata") is not None:
                metadata = checks.object_of(raw["metadata"], "metadata")
                user = checks.text_of(metadata.get("user_id"), "metadata.user_id", required=False)
                if user is not None:
                    chat["user"] = user
            checks.text_of(raw.get("service_tier"), "service_tier", required=False)
        self._tools(raw, chat)
        self._thinking(raw.get("thinking"), chat)
        if raw.get("output_config") is not None:
            config = checks.object_of(raw["output_config"], "output_config")
            if config.get("format") is not None:
                fmt = checks.object_of(config["format"], "output_config.format")
                if fmt.get("type") != "json_schema":
                    raise checks.invalid("output_config.format.type", "must be json_schema")
                schema = checks.object_of(fmt.get("schema"), "output_config.format.schema")
                chat["response_format"] = {
                    "type": "json_schema",
                    "json_schema": {"name": "json_schema", "schema": schema},
                }
            if (effort := config.get("effort")) is not None:
                chat["reasoning_effort"] = checks.text_of(effort, "output_config.effort")
        return chat

    async def translate(self, body: bytes, key: ApiKey | None) -> Translated:
        try:
            raw = load_object(body)
        except OpenAIError as exc:
            raise from_openai_error(exc) from exc
        chat = self.chat_body(raw)
        # No default limit: the client's max_tokens is required and already checked.
        req, forward = chat_request(
            chat, max_tokens_limit=self._max_tokens_limit, default_max_tokens=1
        )
        message_id = _new_id("msg")
        shaper = MessagesShaper(message_id, str(chat["model"]))
        return Translated(req, forward, shaper, message_id, prompt_bytes=len(body))

    @staticmethod
    def _tools(raw: dict[str, Any], chat: dict[str, Any]) -> None:
        names: list[str] = []
        if raw.get("tools") is not None:
            tools: list[dict[str, Any]] = []
            for i, item in enumerate(checks.list_of(raw["tools"], "tools", MAX_ITEMS)):
                tool = checks.object_of(item, f"tools[{i}]")
                kind = tool.get("type")
                if kind not in (None, "custom"):
                    raise checks.invalid(
                        f"tools[{i}].type",
                        f"{str(kind)[:64]!r} is not supported: only client tools are (no "
                        "server tools)",
                    )
                name = checks.text_of(tool.get("name"), f"tools[{i}].name")
                assert name is not None
                schema = checks.object_of(tool.get("input_schema"), f"tools[{i}].input_schema")
                # In the order clients write them: a template renders them as JSON.
                function: dict[str, Any] = {"name": name}
                if (description := tool.get("description")) is not None:
                    function["description"] = checks.text_of(description, f"tools[{i}].description")
                function["parameters"] = schema
                tools.append({"type": "function", "function": function})
                names.append(name)
            if tools:
                chat["tools"] = tools
                chat["tool_choice"] = "auto"
        if raw.get("tool_choice") is None:
            return
        choice = checks.object_of(raw["tool_choice"], "tool_choice")
        kind = choice.get("type")
        if kind not in ("auto", "any", "tool", "none"):
            raise checks.invalid("tool_choice.type", "must be auto, any, tool or none")
        if kind == "none":
            chat["tool_choice"] = "none"
            return
        if not names:
            raise checks.invalid("tool_choice", "needs tools")
        if kind == "tool":
            name = checks.text_of(choice.get("name"), "tool_choice.name")
            if name not in names:
                raise checks.invalid("tool_choice.name", "names no tool of the request")
            chat["tool_choice"] = {"type": "function", "function": {"name": name}}
        else:
            chat["tool_choice"] = "required" if kind == "any" else "auto"
        disable = choice.get("disable_parallel_tool_use")
        if checks.flag_of(disable, "tool_choice.disable_parallel_tool_use", False):
            chat["parallel_tool_calls"] = False

    @staticmethod
    def _thinking(value: object, chat: dict[str, Any]) -> None:
        if value is None:
            return
        thinking = checks.object_of(value, "thinking")
        kind = thinking.get("type")
        if kind == "enabled":
            budget = checks.count_of(
                thinking.get("budget_tokens"), "thinking.budget_tokens", 1024, 1 << 30
            )
            if budget is None:
                raise checks.invalid("thinking.budget_tokens", "Field required")
            if "max_tokens" in chat and budget >= chat["max_tokens"]:
                raise checks.invalid("thinking.budget_tokens", "must be less than max_tokens")
            chat["thinking_token_budget"] = budget
        elif kind not in ("disabled", "adaptive"):
            raise checks.invalid("thinking.type", "must be enabled, disabled or adaptive")


def _blocks(content: object, param: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [
        checks.object_of(b, f"{param}[{j}]")
        for j, b in enumerate(checks.list_of(content, param, MAX_ITEMS))
    ]


def _text_blocks(content: object, param: str) -> str:
    """Content that may hold text only (a system prompt, a tool's result)."""
    out: list[str] = []
    for j, block in enumerate(_blocks(content, param)):
        if block.get("type") != "text":
            raise checks.invalid(f"{param}[{j}].type", "only text blocks are supported here")
        text = checks.text_of(block.get("text"), f"{param}[{j}].text")
        assert text is not None
        out.append(text)
    return "".join(out)


def chat_messages(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """``system`` and ``messages`` as chat messages."""
    out: list[dict[str, Any]] = []
    if raw.get("system") is not None:
        system = _text_blocks(raw["system"], "system")
        if system:
            out.append({"role": "system", "content": system})
    if raw.get("messages") is None:
        raise checks.invalid("messages", "Field required")
    messages = checks.list_of(raw["messages"], "messages", MAX_ITEMS)
    if not messages:
        raise checks.invalid("messages", "must not be empty")
    for i, item in enumerate(messages):
        param = f"messages[{i}]"
        message = checks.object_of(item, param)
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise checks.invalid(f"{param}.role", "must be user or assistant")
        text: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(_blocks(message.get("content"), f"{param}.content")):
            where = f"{param}.content[{j}]"
            kind = block.get("type")
            if kind == "text":
                value = checks.text_of(block.get("text"), f"{where}.text")
                assert value is not None
                text.append(value)
            elif kind == "tool_use" and role == "assistant":
                call_id = checks.text_of(block.get("id"), f"{where}.id")
                name = checks.text_of(block.get("name"), f"{where}.name")
                arguments = checks.object_of(block.get("input", {}), f"{where}.input")
                calls.append(
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": name, "arguments": orjson.dumps(arguments).decode()},
                    }
                )
            elif kind == "tool_result" and role == "user":
                call_id = checks.text_of(block.get("tool_use_id"), f"{where}.tool_use_id")
                result = block.get("content")
                checks.flag_of(block.get("is_error"), f"{where}.is_error", False)
                content = "" if result is None else _text_blocks(result, f"{where}.content")
                out.append({"role": "tool", "tool_call_id": call_id, "content": content})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # earlier reasoning: not part of a chat prompt (as vLLM's layer)
            else:
                raise checks.invalid(
                    f"{where}.type", f"{str(kind)[:64]!r} blocks are not supported in a {role} turn"
                )
        if calls:
            out.append({"role": "assistant", "content": "".join(text) or None, "tool_calls": calls})
        elif text or role == "assistant" or message.get("content") == "":
            out.append({"role": role, "content": "".join(text)})
    return out


# -- the answer ----------------------------------------------------------------------------


def _stop_reason(reader: ChatReader) -> tuple[str | None, str | None]:
    """Chat's finish reason as Anthropic's ``stop_reason`` and ``stop_sequence`` (vLLM's
    mapping: the length wins, then a complete tool call, then a matched stop string)."""
    finish = reader.finish_reason
    if finish == "length":
        return "max_tokens", None
    if finish not in ("stop", "tool_calls"):
        return None, None
    if reader.calls and all(_is_json(call.text) for call in reader.calls):
        return "tool_use", None
    if reader.stop_reason is not None:
        return "stop_sequence", reader.stop_reason
    return ("tool_use" if reader.calls else "end_turn"), None


def _is_json(text: str) -> bool:
    try:
        orjson.loads(text or "{}")
    except orjson.JSONDecodeError:
        return False
    return True


def _usage(reader: ChatReader) -> dict[str, Any]:
    usage = reader.usage
    out = {"input_tokens": usage.prompt, "output_tokens": usage.completion}
    if usage.cached is not None:
        out["input_tokens"] = max(0, usage.prompt - usage.cached)
        out["cache_read_input_tokens"] = usage.cached
    return out


class MessagesShaper(ChatShaper):
    """One message's answer, from its chat events: content blocks as they grow, the stream's
    events in order, the whole message."""

    def __init__(self, message_id: str, model: str) -> None:
        self._id = message_id
        self._model = model
        super().__init__()
        self._blocks: list[dict[str, Any]] = []
        self._open: str | None = None  # the type of the block still growing
        self._parts: list[str] = []  # its text, thinking or JSON so far
        self._call: ToolCall | None = None

    def _message(self, **fields: Any) -> dict[str, Any]:
        return {
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": self._blocks,
            "stop_reason": None,
            "stop_sequence": None,
            **fields,
        }

    def start(self, first: dict[str, Any]) -> bytes:
        message = self._message(content=[], usage={"input_tokens": 0, "output_tokens": 0})
        return named_event("message_start", {"type": "message_start", "message": message}) + (
            named_event("ping", {"type": "ping"})
        )

    def _deltas(self, deltas: list[tuple[Any, ...]], *, stream: bool) -> list[bytes]:
        out: list[bytes] = []
        for delta in deltas:
            kind = delta[0]
            if kind in ("text", "reasoning"):
                block = "text" if kind == "text" else "thinking"
                if self._open != block:
                    out.extend(self._close())
                    out.extend(self._start(block, {"type": block, block: ""}))
                self._parts.append(delta[1])
                if stream:
                    key = "text_delta" if block == "text" else "thinking_delta"
                    out.append(self._delta({"type": key, block: delta[1]}))
            elif kind == "call":
                call: ToolCall = delta[1]
                out.extend(self._close())
                self._call = call
                start = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
                out.extend(self._start("tool_use", start))
            elif kind == "arguments" and delta[1] is self._call:
                self._parts.append(delta[2])
                if stream:
                    out.append(self._delta({"type": "input_json_delta", "partial_json": delta[2]}))
        return out

    def _start(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        self._open = kind
        self._parts = []
        self._blocks.append(dict(block))
        payload = {
            "type": "content_block_start",
            "index": len(self._blocks) - 1,
            "content_block": block,
        }
        return [named_event("content_block_start", payload)]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        payload = {"type": "content_block_delta", "index": len(self._blocks) - 1, "delta": delta}
        return named_event("content_block_delta", payload)

    def _close(self) -> list[bytes]:
        kind, self._open = self._open, None
        if kind is None:
            return []
        block = self._blocks[-1]
        text = "".join(self._parts)
        if kind == "tool_use":
            assert self._call is not None
            try:
                parsed = orjson.loads(text or "{}")
            except orjson.JSONDecodeError:
                parsed = {}  # cut short (max_tokens): what there is stays in the stream
            block["input"] = parsed if isinstance(parsed, dict) else {}
            block["name"] = self._call.name
            self._call = None
        elif kind == "thinking":
            block["thinking"] = text
            block["signature"] = ""
        else:
            block["text"] = text
        payload = {"type": "content_block_stop", "index": len(self._blocks) - 1}
        return [named_event("content_block_stop", payload)]

    async def finish(self) -> bytes:
        out = self._close()
        stop_reason, stop_sequence = _stop_reason(self._reader)
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": _usage(self._reader),
        }
        out.append(named_event("message_delta", delta))
        out.append(named_event("message_stop", {"type": "message_stop"}))
        return b"".join(out)

    def fail(self, error: OpenAIError) -> bytes:
        return b"".join(self._close()) + named_event("error", anthropic_error(error))

    async def whole(self, answer: dict[str, Any]) -> dict[str, Any]:
        if isinstance(model := answer.get("model"), str) and model:
            self._model = model
        self._deltas(self._reader.whole(answer), stream=False)
        self._close()
        if not self._blocks:
            self._blocks.append({"type": "text", "text": ""})  # Anthropic's empty answer
        stop_reason, stop_sequence = _stop_reason(self._reader)
        return self._message(
            stop_reason=stop_reason, stop_sequence=stop_sequence, usage=_usage(self._reader)
        )
