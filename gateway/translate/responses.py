"""``POST /v1/responses``, OpenAI's Responses API, served as a chat request.

The request becomes one chat completions request (`ResponsesFront.translate`): the
``instructions`` a system message; the conversation of ``previous_response_id`` (read from
the fleet's response store, in the client key's scope; its instructions do not carry over)
and the ``input`` items as chat messages (``function_call`` items as the assistant's
``tool_calls``, ``function_call_output`` items as ``tool`` messages); ``max_output_tokens``,
sampling, function ``tools``, ``tool_choice``, ``parallel_tool_calls``, ``text.format`` (as
``response_format``) and ``user`` as chat's. vLLM's own Responses layer builds its chat
messages the same way (vllm/entrypoints/openai/responses/utils.py,
``construct_input_messages``).

The answer (`ResponsesShaper`) is a ``response`` object, or a stream of the API's typed
events with their sequence numbers: ``response.created``, ``response.in_progress``, per output
item ``response.output_item.added``, its parts and deltas (``response.content_part.added``,
``response.output_text.delta``/``.done``, ``response.function_call_arguments.delta``/
``.done``, ``response.content_part.done``), ``response.output_item.done``, and
``response.completed`` (its response ``incomplete`` when ``max_output_tokens`` cut it, as
vLLM sends it). A failure
after the stream began is an ``error`` event and ``response.failed``.

With ``store`` (the default, as OpenAI's) the response, its input items and the conversation
so far are written to the store before the client sees the response's end, so a chained
request through any gateway finds it.

What the API has and this does not (built-in tools, background mode, conversations, prompt
templates, item references, non-text input) is refused with a 400 naming the field, never
ignored: docs/api.md lists it.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson
from starlette.types import ASGIApp

from pdgate.config.openai_api import SAMPLING_FIELDS, OpenAIError, load_object
from pdgate.gateway.admission.auth import ApiKey
from pdgate.gateway.errors import BadRequest, from_openai_error
from pdgate.gateway.translate import checks
from pdgate.gateway.translate.base import (
    ChatShaper,
    ToolCall,
    Translated,
    Usage,
    chat_request,
    named_event,
    scope_of,
)
from pdgate.registry.responses import EntryTooLarge, ResponseStore

__all__ = ["ResponsesFront", "ResponsesShaper", "previous_not_found", "stored_response"]

log = logging.getLogger("pdgate.responses")

MAX_ITEMS = 2048  # input items, tools: far beyond any real request, bounded all the same
MAX_METADATA = 16  # OpenAI's bounds on metadata
_FIELDS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "max_output_tokens",
        "temperature",
        "top_p",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "text",
        "metadata",
        "user",
        "stream",
        "stream_options",
        "store",
        "previous_response_id",
        "reasoning",
        "include",
        "truncation",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
        "background",
        "top_logprobs",
        "max_tool_calls",
        "conversation",
        "prompt",
        # vLLM's sampling extensions, as its Responses API takes them
        *(f for f in SAMPLING_FIELDS if f not in ("logprobs", "ignore_eos")),
    }
)
# Fields that, set, ask for what the gateway does not do.
_REFUSED = {
    "background": "background mode is not supported",
    "conversation": "conversations are not supported; chain with previous_response_id",
    "prompt": "prompt templates are not supported",
    "max_tool_calls": "max_tool_calls is not supported",
    "top_logprobs": "logprobs are not supported by the Responses API here",
}
# `include` values whose items are never produced here, so asking for them changes nothing.
_HARMLESS_INCLUDES = frozenset({"reasoning.encrypted_content"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


def previous_not_found(response_id: str) -> BadRequest:
    return BadRequest(
        f"Previous response with id '{response_id[:128]}' not found.",
        param="previous_response_id",
    )


async def stored_response(
    store: ResponseStore, key: ApiKey | None, response_id: str
) -> dict[str, Any] | None:
    """The stored record of `response_id` in the key's scope: ``response``, ``input`` (its
    input items) and ``context`` (the conversation, as chat messages); its size in bytes
    under ``size``."""
    data = await store.get(scope_of(key), response_id)
    if data is None:
        return None
    record = orjson.loads(data)
    if not isinstance(record, dict):
        return None
    record["size"] = len(data)
    return record


class ResponsesFront:
    """Translates Responses API requests into chat requests and their answers back."""

    name = "responses"

    def __init__(
        self,
        store: ResponseStore,
        *,
        max_tokens_limit: int,
        default_max_tokens: int,
    ) -> None:
        self._store = store
        self._max_tokens_limit = max_tokens_limit
        self._default_max_tokens = default_max_tokens

    def credentials(self, headers: Mapping[str, str]) -> str | None:
        return headers.get("authorization")

    def error(self, error: OpenAIError) -> ASGIApp:
        return error.response()

    async def translate(self, body: bytes, key: ApiKey | None) -> Translated:
        try:
            raw = load_object(body)
        except OpenAIError as exc:
            raise from_openai_error(exc) from exc
        for name in raw:
            if name not in _FIELDS:
                raise BadRequest(f"Unknown parameter: '{name[:64]}'.", param=name[:64])
        for name, why in _REFUSED.items():
            if raw.get(name) not in (None, False, 0):
                raise BadRequest(why, param=name)
        if raw.get("truncation") not in (None, "disabled"):
            raise BadRequest("only truncation 'disabled' is supported", param="truncation")
        for name in ("service_tier", "prompt_cache_key", "safety_identifier"):
            checks.text_of(raw.get(name), name, required=False)
        for i, item in enumerate(checks.list_of(raw.get("include") or [], "include", 16)):
            if item not in _HARMLESS_INCLUDES:
                raise checks.invalid(f"include[{i}]", f"{str(item)[:64]!r} is not supported")
        if raw.get("stream_options") is not None:
            checks.object_of(raw["stream_options"], "stream_options")
        stream = checks.flag_of(raw.get("stream"), "stream", False)
        store = checks.flag_of(raw.get("store"), "store", True)
        model = checks.text_of(raw.get("model"), "model", required=False)
        instructions = checks.text_of(raw.get("instructions"), "instructions", required=False)
        limit = checks.count_of(
            raw.get("max_output_tokens"), "max_output_tokens", 1, self._max_tokens_limit
        )
        metadata = _metadata(raw.get("metadata"))
        user = checks.text_of(raw.get("user"), "user", required=False)
        tools, chat_tools = _tools(raw.get("tools"))
        tool_choice, chat_choice = _tool_choice(raw.get("tool_choice"), tools)
        parallel = checks.flag_of(raw.get("parallel_tool_calls"), "parallel_tool_calls", True)
        text, response_format = _text(raw.get("text"))
        reasoning = _reasoning(raw.get("reasoning"))

        previous_id = checks.text_of(
            raw.get("previous_response_id"), "previous_response_id", required=False
        )
        context: list[dict[str, Any]] = []
        context_bytes = 0
        if previous_id is not None:
            record = await stored_response(self._store, key, previous_id)
            if record is None:
                raise previous_not_found(previous_id)
            context = [m for m in record.get("context") or () if isinstance(m, dict)]
            context_bytes = record["size"]
        items, messages = input_items(raw.get("input"))
        if not context and not messages:
            raise checks.invalid("input", "must not be empty")

        chat: dict[str, Any] = {
            "messages": ([{"role": "system", "content": instructions}] if instructions else [])
            + context
            + messages,
            "stream": stream,
        }
        if model is not None:
            chat["model"] = model
        if stream:
            chat["stream_options"] = {"include_usage": True}
        if limit is not None:
            chat["max_tokens"] = limit
        for name, low, high, open_low in (("temperature", 0, 2, False), ("top_p", 0, 1, True)):
            if (
                value := checks.number_of(raw.get(name), name, low, high, open_low=open_low)
            ) is not None:
                chat[name] = value
        for name in SAMPLING_FIELDS:
            if name in raw and name not in chat and name in _FIELDS:
                chat[name] = raw[name]
        if chat_tools:
            chat["tools"] = chat_tools
            chat["tool_choice"] = chat_choice
            chat["parallel_tool_calls"] = parallel
        elif chat_choice not in ("auto", "none"):
            raise checks.invalid("tool_choice", "names a tool but no tools are given")
        if response_format is not None:
            chat["response_format"] = response_format
        if user is not None:
            chat["user"] = user
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]
        req, forward = chat_request(
            chat,
            max_tokens_limit=self._max_tokens_limit,
            default_max_tokens=self._default_max_tokens,
        )
        response_id = _new_id("resp")
        draft = {
            "id": response_id,
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "background": False,
            "error": None,
            "incomplete_details": None,
            "instructions": instructions,
            "max_output_tokens": limit,
            "model": model or req.model or "",
            "output": [],
            "parallel_tool_calls": parallel,
            "previous_response_id": previous_id,
            "reasoning": reasoning,
            "store": store,
            "temperature": chat.get("temperature", 1.0),
            "text": text,
            "tool_choice": tool_choice,
            "tools": tools,
            "top_p": chat.get("top_p", 1.0),
            "truncation": "disabled",
            "usage": None,
            "user": user,
            "metadata": metadata,
        }
        recorder = None
        if store:
            recorder = self._recorder(scope_of(key), response_id, items, context + messages)
        shaper = ResponsesShaper(draft, recorder)
        return Translated(req, forward, shaper, response_id, prompt_bytes=len(body) + context_bytes)

    def _recorder(
        self,
        scope: str,
        response_id: str,
        items: list[dict[str, Any]],
        conversation: list[dict[str, Any]],
    ) -> Callable[[dict[str, Any]], Awaitable[None]]:
        store = self._store

        async def record(response: dict[str, Any]) -> None:
            entry = {
                "response": response,
                "input": items,
                "context": [*conversation, assistant_message(response["output"])],
            }
            try:
                await store.put(scope, response_id, orjson.dumps(entry))
            except EntryTooLarge as exc:
                log.warning("response %s not stored: %s", response_id, exc)

        return record


# -- the request's parts -------------------------------------------------------------------


def _metadata(value: object) -> dict[str, str] | None:
    if value is None:
        return None
    metadata = checks.object_of(value, "metadata")
    if len(metadata) > MAX_METADATA:
        raise checks.invalid("metadata", f"has more than {MAX_METADATA} keys")
    for name, item in metadata.items():
        if len(name) > 64 or not isinstance(item, str) or len(item) > 512:
            raise checks.invalid(
                "metadata", "keys are at most 64 characters, values strings of 512"
            )
    return metadata


def _tools(value: object) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The function tools as echoed in the response, and as chat's tools."""
    if value is None:
        return [], []
    echo: list[dict[str, Any]] = []
    chat: list[dict[str, Any]] = []
    for i, raw in enumerate(checks.list_of(value, "tools", MAX_ITEMS)):
        tool = checks.object_of(raw, f"tools[{i}]")
        kind = tool.get("type")
        if kind != "function":
            raise checks.invalid(
                f"tools[{i}].type",
                f"{str(kind)[:64]!r} is not supported: only function tools are (no built-in tools)",
            )
        name = checks.text_of(tool.get("name"), f"tools[{i}].name")
        assert name is not None
        description = checks.text_of(
            tool.get("description"), f"tools[{i}].description", required=False
        )
        parameters = tool.get("parameters")
        if parameters is not None:
            checks.object_of(parameters, f"tools[{i}].parameters")
        strict = checks.flag_of(tool.get("strict"), f"tools[{i}].strict", False)
        # In the order clients write them (and vLLM's own translation keeps): a chat
        # template renders the tools as JSON, key order included.
        function: dict[str, Any] = {"name": name}
        if description is not None:
            function["description"] = description
        function["parameters"] = parameters or {}
        if tool.get("strict") is not None:
            function["strict"] = strict
        chat.append({"type": "function", "function": function})
        echo.append(
            {
                "type": "function",
                "name": name,
                "description": description,
                "parameters": parameters,
                "strict": tool.get("strict"),
            }
        )
    return echo, chat


def _tool_choice(value: object, tools: list[dict[str, Any]]) -> tuple[Any, Any]:
    """``tool_choice`` as echoed, and as chat's."""
    if value is None:
        return "auto", "auto"
    if value in ("auto", "none", "required"):
        return value, value
    choice = checks.object_of(value, "tool_choice")
    if choice.get("type") != "function":
        raise checks.invalid("tool_choice", "must be auto, none, required or a function tool")
    name = checks.text_of(choice.get("name"), "tool_choice.name")
    if all(tool["name"] != name for tool in tools):
        raise checks.invalid("tool_choice.name", "names no tool of the request")
    return {"type": "function", "name": name}, {"type": "function", "function": {"name": name}}


def _text(value: object) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``text`` as echoed, and its format as chat's ``response_format``."""
    if value is None:
        return {"format": {"type": "text"}}, None
    text = checks.object_of(value, "text")
    fmt = text.get("format")
    if fmt is None:
        return {"format": {"type": "text"}}, None
    fmt = checks.object_of(fmt, "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return {"format": {"type": "text"}}, None
    if kind == "json_object":
        return {"format": {"type": "json_object"}}, {"type": "json_object"}
    if kind != "json_schema":
        raise checks.invalid("text.format.type", "must be text, json_object or json_schema")
    name = checks.text_of(fmt.get("name"), "text.format.name")
    schema = checks.object_of(fmt.get("schema"), "text.format.schema")
    strict = checks.flag_of(fmt.get("strict"), "text.format.strict", False)
    json_schema: dict[str, Any] = {"name": name, "schema": schema, "strict": strict}
    if (description := fmt.get("description")) is not None:
        json_schema["description"] = checks.text_of(description, "text.format.description")
    echo = {"format": {"type": "json_schema", **json_schema}}
    return echo, {"type": "json_schema", "json_schema": json_schema}


def _reasoning(value: object) -> dict[str, Any]:
    if value is None:
        return {"effort": None, "summary": None}
    reasoning = checks.object_of(value, "reasoning")
    effort = checks.text_of(reasoning.get("effort"), "reasoning.effort", required=False)
    summary = checks.text_of(reasoning.get("summary"), "reasoning.summary", required=False)
    return {"effort": effort, "summary": summary}


def _text_content(content: object, param: str) -> str:
    """A message's content as text: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    parts = checks.list_of(content, param, MAX_ITEMS)
    out: list[str] = []
    for j, raw in enumerate(parts):
        part = checks.object_of(raw, f"{param}[{j}]")
        kind = part.get("type")
        if kind in _TEXT_PARTS:
            text = checks.text_of(part.get("text"), f"{param}[{j}].text")
        elif kind == "refusal":
            text = checks.text_of(part.get("refusal"), f"{param}[{j}].refusal")
        else:
            raise checks.invalid(
                f"{param}[{j}].type",
                f"{str(kind)[:64]!r} is not supported: only text content is",
            )
        assert text is not None
        out.append(text)
    return "".join(out)


def input_items(value: object) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The ``input`` as the items a stored response lists (each with its id), and as chat
    messages."""
    if isinstance(value, str):
        item = {
            "id": _new_id("msg"),
            "type": "message",
            "role": "user",
            "status": "completed",
            "content": [{"type": "input_text", "text": value}],
        }
        return [item], [{"role": "user", "content": value}]
    if value is None:
        raise checks.invalid("input", "is required")
    items: list[dict[str, Any]] = []
    messages: list[dict[str, Any]] = []
    for i, raw in enumerate(checks.list_of(value, "input", MAX_ITEMS)):
        param = f"input[{i}]"
        item = checks.object_of(raw, param)
        kind = item.get("type", "message")
        given = item.get("id")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise checks.invalid(
                    f"{param}.role", "must be user, assistant, system or developer"
                )
            text = _text_content(item.get("content"), f"{param}.content")
            part = "output_text" if role == "assistant" else "input_text"
            content: list[dict[str, Any]] = [{"type": part, "text": text}]
            if part == "output_text":
                content[0]["annotations"] = []
            items.append(
                {
                    "id": given if isinstance(given, str) else _new_id("msg"),
                    "type": "message",
                    "role": role,
                    "status": "completed",
                    "content": content,
                }
            )
            messages.append({"role": role, "content": text})
        elif kind == "function_call":
            call_id = checks.text_of(item.get("call_id"), f"{param}.call_id")
            name = checks.text_of(item.get("name"), f"{param}.name")
            arguments = checks.text_of(item.get("arguments"), f"{param}.arguments")
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            items.append(
                {
                    "id": given if isinstance(given, str) else _new_id("fc"),
                    "type": "function_call",
                    "status": "completed",
                    "call_id": call_id,
                    "name": name,
                    "arguments": arguments,
                }
            )
        elif kind == "function_call_output":
            call_id = checks.text_of(item.get("call_id"), f"{param}.call_id")
            output = _text_content(item.get("output"), f"{param}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
            items.append(
                {
                    "id": given if isinstance(given, str) else _new_id("fco"),
                    "type": "function_call_output",
                    "status": "completed",
                    "call_id": call_id,
                    "output": output,
                }
            )
        elif kind == "reasoning":
            continue  # a reasoning model's earlier thoughts: not part of a chat prompt
        else:
            raise checks.invalid(
                f"{param}.type", f"{str(kind)[:64]!r} is not a supported input item"
            )
    return items, messages


def assistant_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output items as the assistant's turn of a chat conversation."""
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for item in output:
        if item.get("type") == "message":
            text.extend(part.get("text", "") for part in item.get("content") or ())
        elif item.get("type") == "function_call":
            calls.append(
                {
                    "id": item["call_id"],
                    "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]},
                }
            )
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text else None}
    if calls:
        message["tool_calls"] = calls
    elif message["content"] is None:
        message["content"] = ""
    return message


# -- the answer ----------------------------------------------------------------------------


def _usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt,
        "input_tokens_details": {"cached_tokens": usage.cached or 0, "cache_write_tokens": 0},
        "output_tokens": usage.completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt + usage.completion,
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item() -> dict[str, Any]:
    return {
        "id": _new_id("msg"),
        "type": "message",
        "status": "in_progress",
        "role": "assistant",
        "content": [],
    }


def _call_item(call: ToolCall) -> dict[str, Any]:
    return {
        "id": _new_id("fc"),
        "type": "function_call",
        "status": "in_progress",
        "call_id": call.id,
        "name": call.name,
        "arguments": "",
    }


class ResponsesShaper(ChatShaper):
    """One response's answer, from its chat events: its output items as they grow, the
    stream's events in order, the whole response."""

    def __init__(
        self,
        draft: dict[str, Any],
        record: Callable[[dict[str, Any]], Awaitable[None]] | None,
    ) -> None:
        self._draft = draft
        self._record = record
        super().__init__()
        self._seq = 0
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the output item still growing
        self._text: list[str] = []  # the open message's text
        self._by_call: dict[int, dict[str, Any]] = {}  # a chat call's index -> its item

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return named_event(kind, payload)

    def _response(self, status: str, **fields: Any) -> dict[str, Any]:
        return {**self._draft, "status": status, "output": list(self.output), **fields}

    def start(self, first: dict[str, Any]) -> bytes:
        self._model(first)
        response = self._response("in_progress")
        return self._event("response.created", response=response) + self._event(
            "response.in_progress", response=response
        )

    def _model(self, answer: dict[str, Any]) -> None:
        # A request without a model gets the one model served (gateway/api/completions.py).
        if not self._draft["model"] and isinstance(model := answer.get("model"), str):
            self._draft["model"] = model

    def _deltas(self, deltas: list[tuple[Any, ...]], *, stream: bool) -> list[bytes]:
        out: list[bytes] = []
        for delta in deltas:
            kind = delta[0]
            if kind == "text":
                if self._open is None or self._open["type"] != "message":
                    out.extend(self._close())
                    out.extend(self._open_item(_message_item()))
                self._text.append(delta[1])
                if stream:
                    out.append(
                        self._text_event("response.output_text.delta", delta=delta[1], logprobs=[])
                    )
            elif kind == "call":
                call: ToolCall = delta[1]
                out.extend(self._close())
                item = self._by_call[call.index] = _call_item(call)
                out.extend(self._open_item(item))
            elif kind == "arguments":
                growing = self._by_call.get(delta[1].index)
                if growing is not None and stream:
                    out.append(
                        self._item_event(
                            "response.function_call_arguments.delta", growing, delta=delta[2]
                        )
                    )
            # Reasoning deltas are not part of the output (no reasoning items: docs/api.md).
        return out

    def _item_event(self, kind: str, item: dict[str, Any], **fields: Any) -> bytes:
        """An event about one output item (its id and place in the output)."""
        index = self.output.index(item)
        return self._event(kind, item_id=item["id"], output_index=index, **fields)

    def _text_event(self, kind: str, **fields: Any) -> bytes:
        """An event about the open message's one text part."""
        assert self._open is not None
        return self._item_event(kind, self._open, content_index=0, **fields)

    def _open_item(self, item: dict[str, Any]) -> list[bytes]:
        self._open = item
        self._text = []
        self.output.append(item)
        added = self._event(
            "response.output_item.added", output_index=len(self.output) - 1, item=dict(item)
        )
        if item["type"] != "message":
            return [added]
        return [added, self._text_event("response.content_part.added", part=_text_part(""))]

    def _close(self, status: str = "completed") -> list[bytes]:
        """The open item's closing events; the item gets its final content."""
        item = self._open
        if item is None:
            return []
        item["status"] = status
        if item["type"] == "message":
            part = _text_part("".join(self._text))
            item["content"] = [part]
            out = [
                self._text_event("response.output_text.done", text=part["text"], logprobs=[]),
                self._text_event("response.content_part.done", part=part),
            ]
        else:
            call = next(c for c in self._reader.calls if self._by_call.get(c.index) is item)
            item["arguments"] = call.text
            item["name"] = call.name
            out = [
                self._item_event(
                    "response.function_call_arguments.done",
                    item,
                    name=call.name,
                    arguments=call.text,
                )
            ]
        self._open = None
        done = self._event(
            "response.output_item.done", output_index=self.output.index(item), item=item
        )
        return [*out, done]

    def _close_all(self) -> list[bytes]:
        """Every item still open; a call closed earlier gets its later fragments too."""
        cut = self._reader.finish_reason == "length"
        out = self._close("incomplete" if cut else "completed")
        for call in self._reader.calls:
            item = self._by_call.get(call.index)
            if item is not None:
                item["arguments"] = call.text
        return out

    def _final(self) -> dict[str, Any]:
        usage = _usage(self._reader.usage)
        if self._reader.finish_reason == "length":
            return self._response(
                "incomplete", incomplete_details={"reason": "max_output_tokens"}, usage=usage
            )
        return self._response("completed", usage=usage)

    async def finish(self) -> bytes:
        closing = self._close_all()
        response = self._final()
        if self._record is not None:
            await self._record(response)
        # Ended by max_output_tokens too: the response says "incomplete", the event is
        # ``response.completed`` (as vLLM's; the openai SDK's stream helper waits for it).
        return b"".join(closing) + self._event("response.completed", response=response)

    def fail(self, error: OpenAIError) -> bytes:
        closing = self._close("incomplete")
        failure = {"code": "server_error", "message": error.message}
        response = self._response("failed", error=failure, usage=_usage(self._reader.usage))
        return (
            b"".join(closing)
            + self._event(
                "error", code=error.code or "server_error", message=error.message, param=None
            )
            + self._event("response.failed", response=response)
        )

    async def whole(self, answer: dict[str, Any]) -> dict[str, Any]:
        self._model(answer)
        self._deltas(self._reader.whole(answer), stream=False)
        self._close_all()
        response = self._final()
        if self._record is not None:
            await self._record(response)
        return response
