"""What the front doors share: the `Front` seam, the reader of chat events, checks of the
client's JSON with the path of what is wrong.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
from starlette.types import ASGIApp, Send

from pdgate.config.openai_api import ChatCompletionRequest, OpenAIError, chat_from_object
from pdgate.gateway.admission.auth import ApiKey
from pdgate.gateway.errors import BadRequest
from pdgate.gateway.stream.out import ClientOut, ShapedStreamOut, ShapedWholeOut, Shaper

__all__ = [
    "ANONYMOUS",
    "ChatReader",
    "ChatShaper",
    "Front",
    "ToolCall",
    "Translated",
    "Usage",
    "chat_request",
    "named_event",
    "new_call_id",
    "scope_of",
]

ANONYMOUS = "anonymous"  # the scope of requests without a client key (keys off)


def scope_of(key: ApiKey | None) -> str:
    """The storage scope of a client key: what it stored, it alone reads."""
    return ANONYMOUS if key is None else key.digest.hex()


def named_event(name: str, payload: dict[str, Any]) -> bytes:
    """One SSE event with its ``event:`` line, as the Responses and Messages APIs send."""
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


@dataclass(slots=True)
class Translated:
    """A client's request as the internal chat request, and how its answer is shaped."""

    req: ChatCompletionRequest
    forward: dict[str, Any]  # the chat body as it goes upstream
    shaper: Shaper
    request_id: str  # the answer's id (``resp_...``, ``msg_...``)
    # At least the prompt's bytes: the request's, and a stored conversation's it continues
    # (what the context-length check's cheap bound counts).
    prompt_bytes: int = 0

    def out(self, send: Send, request_id: str) -> ClientOut:
        """The client's response; `request_id` goes in its ``x-request-id``."""
        if self.req.stream:
            return ShapedStreamOut(send, request_id, self.shaper)
        return ShapedWholeOut(send, request_id, self.shaper)


class Front(Protocol):
    """A client API served as chat requests (`ResponsesFront`, `MessagesFront`)."""

    name: str  # the API, in spans and logs

    def credentials(self, headers: Mapping[str, str]) -> str | None:
        """The client's credentials as an ``Authorization`` value (the key ring reads it)."""
        ...

    async def translate(self, body: bytes, key: ApiKey | None) -> Translated:
        """The request as a chat request. Raises `GatewayError` (the client's 4xx)."""
        ...

    def error(self, error: OpenAIError) -> ASGIApp:
        """An error as this API's status and body (before anything was sent)."""
        ...


def chat_request(
    body: dict[str, Any], *, max_tokens_limit: int, default_max_tokens: int
) -> tuple[ChatCompletionRequest, dict[str, Any]]:
    """The translated chat body, checked by the same schema as a client's chat request."""
    try:
        return chat_from_object(
            body, max_tokens_limit=max_tokens_limit, default_max_tokens=default_max_tokens
        )
    except OpenAIError as exc:
        raise BadRequest(exc.message, param=exc.param) from exc


# -- reading chat events -------------------------------------------------------------------


@dataclass(slots=True)
class ToolCall:
    index: int  # the chat stream's index of the call
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.arguments)


@dataclass(frozen=True, slots=True)
class Usage:
    prompt: int = 0
    completion: int = 0
    cached: int | None = None  # prompt tokens the prefix cache held (None: not reported)

    @classmethod
    def of(cls, raw: object) -> Usage:
        if not isinstance(raw, dict):
            return cls()
        details = raw.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return cls(
            _count(raw.get("prompt_tokens")),
            _count(raw.get("completion_tokens")),
            cached if type(cached) is int else None,
        )


def _count(value: object) -> int:
    return value if type(value) is int and value >= 0 else 0


# What one chat event adds: ("text", str), ("reasoning", str), ("call", ToolCall) when a
# tool call starts, ("arguments", ToolCall, str) for a fragment of its arguments.
Delta = tuple[Any, ...]


def new_call_id(index: int) -> str:
    """An id for a tool call the engine sent without one."""
    return f"call_{secrets.token_hex(12)}"


class ChatReader:
    """One chat answer read event by event (a stream's chunks, or a whole completion as one),
    into the parts every API's answer is made of: text, reasoning, tool calls, the finish
    reason (with the matched stop string where the engine says it: vLLM's ``stop_reason``)
    and the usage."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.calls: list[ToolCall] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None
        self.usage = Usage()
        self._by_index: dict[int, ToolCall] = {}

    def chunk(self, event: dict[str, Any]) -> list[Delta]:
        """A stream's chat chunk (``chat.completion.chunk``)."""
        if event.get("usage") is not None:
            self.usage = Usage.of(event["usage"])
        out: list[Delta] = []
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):
                self._delta(delta, out)
            self._finish(choice)
        return out

    def whole(self, answer: dict[str, Any]) -> list[Delta]:
        """A whole chat completion (as gateway/stream/assemble.py puts a stream together)."""
        self.usage = Usage.of(answer.get("usage"))
        out: list[Delta] = []
        for choice in answer.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            message = choice.get("message")
            if isinstance(message, dict):
                calls = message.get("tool_calls")
                self._delta({**message, "tool_calls": None}, out)
                for index, call in enumerate(calls if isinstance(calls, list) else ()):
                    if isinstance(call, dict):
                        self._delta({"tool_calls": [{**call, "index": index}]}, out)
            self._finish(choice)
        return out

    def _finish(self, choice: dict[str, Any]) -> None:
        if isinstance(reason := choice.get("finish_reason"), str):
            self.finish_reason = reason
            stop = choice.get("stop_reason")
            self.stop_reason = stop if isinstance(stop, str) else None

    def _delta(self, delta: dict[str, Any], out: list[Delta]) -> None:
        # vLLM's reasoning parsers send ``reasoning`` (``reasoning_content`` before 0.10).
        reasoning = delta.get("reasoning", delta.get("reasoning_content"))
        if isinstance(reasoning, str) and reasoning:
            out.append(("reasoning", reasoning))
        content = delta.get("content")
        if isinstance(content, str) and content:
            self.text.append(content)
            out.append(("text", content))
        calls = delta.get("tool_calls")
        if not isinstance(calls, list):
            return
        for raw in calls:
            if not isinstance(raw, dict):
                continue
            index = raw.get("index", len(self.calls))
            if type(index) is not int:
                continue
            fn = raw.get("function")
            fn = fn if isinstance(fn, dict) else {}
            call = self._by_index.get(index)
            if call is None:
                name = fn.get("name")
                call_id = raw.get("id")
                call = ToolCall(
                    index,
                    call_id if isinstance(call_id, str) and call_id else new_call_id(index),
                    name if isinstance(name, str) else "",
                )
                self._by_index[index] = call
                self.calls.append(call)
                out.append(("call", call))
            elif isinstance(name := fn.get("name"), str) and not call.name:
                call.name = name
            arguments = fn.get("arguments")
            if isinstance(arguments, str) and arguments:
                call.arguments.append(arguments)
                out.append(("arguments", call, arguments))


class ChatShaper:
    """What the shapers share: the chat answer read event by event (`ChatReader`), each
    event's parts turned into the API's events by `_deltas`."""

    def __init__(self) -> None:
        self._reader = ChatReader()

    def chunk(self, event: dict[str, Any]) -> bytes:
        return b"".join(self._deltas(self._reader.chunk(event), stream=True))

    def _deltas(self, deltas: list[Delta], *, stream: bool) -> list[bytes]:
        """The API's events for `deltas` (none when not `stream`: a whole answer's parts
        only grow its items)."""
        raise NotImplementedError
