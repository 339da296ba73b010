"""The shims' side of ``/v1/completions`` and ``/v1/chat/completions``: the checks only an
engine can make, and the responses' shapes as vLLM serves them.

The requests themselves are validated by the schemas both sides of the wire share
(`pdgate.config.openai_api`), so the gateway and the shims can never disagree about a field.
Error messages never echo request content: it may be a prompt.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Protocol

from pdgate.config.openai_api import (
    Api,
    ApiRequest,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    OpenAIError,
    parse_api,
    sse_event,
)
from pdgate.config.wire import valid_request_id
from pdgate.engine_shim._tool_calls import ToolCallParser
from pdgate.engine_shim.backend import ChatPrompt, TokenLogprobs, ToolUse

__all__ = [
    "ApiRequest",
    "ChatCompletionRequest",
    "ChatFields",
    "ChatShape",
    "CompletionRequest",
    "CompletionShape",
    "Shape",
    "chat_prompt",
    "check_length",
    "check_model",
    "completion_id",
    "parse_request",
    "shape_for",
    "usage",
]


def parse_request(body: bytes, *, max_model_len: int, api: Api = Api.COMPLETIONS) -> ApiRequest:
    """A validated request (raises `OpenAIError` 400); no ``max_tokens`` beyond the model."""
    req, _ = parse_api(api, body, max_tokens_limit=max_model_len)
    return req


def check_model(model: str | None, served: str, adapters: Collection[str] = ()) -> str | None:
    """The LoRA adapter `model` names (None: the served model itself); 404 for any other."""
    if model is None or model == served:
        return None
    if model in adapters:
        return model
    raise OpenAIError(
        404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
    )


def check_length(prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    if prompt_tokens + max_tokens > max_model_len:
        raise OpenAIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{prompt_tokens} tokens and max_tokens is {max_tokens}.",
            param="prompt",
        )


class ChatFields(Protocol):
    """What shapes a rendered conversation: a chat request's fields, or a chat ``/tokenize``
    request's."""

    @property
    def messages(self) -> Sequence[ChatMessage]: ...

    @property
    def tools(self) -> Sequence[Mapping[str, Any]] | None: ...

    @property
    def add_generation_prompt(self) -> bool: ...

    @property
    def continue_final_message(self) -> bool: ...

    @property
    def chat_template_kwargs(self) -> Mapping[str, Any] | None: ...


def chat_prompt(req: ChatFields) -> ChatPrompt:
    """What an engine's chat template needs of a chat request (content as plain text)."""
    messages: list[dict[str, Any]] = []
    for message in req.messages:
        item: dict[str, Any] = {"role": message.role, "content": message.text}
        if message.name is not None:
            item["name"] = message.name
        if message.tool_calls:
            item["tool_calls"] = message.tool_calls
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        messages.append(item)
    return ChatPrompt(
        messages,
        tools=req.tools,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        template_kwargs=req.chat_template_kwargs,
    )


def completion_id(request_id: str | None, prefix: str = "cmpl") -> str:
    """The caller's ``x-request-id`` when it is usable, so that a completion has one id in
    its body, its headers and every log line; otherwise a fresh one."""
    if request_id is not None and valid_request_id(request_id):
        return request_id
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


class Shape:
    """Builds the JSON of one answer (whole or as SSE chunks) with a fixed id and time; the
    subclasses say where the text goes (`_content`) and how logprobs look (`_logprobs`).

    With ``token_ids`` (vLLM's ``return_token_ids``) the answer carries the prompt's ids
    (a stream: in its first event) and each choice the ids of its tokens (a stream: of the
    tokens whose text that chunk carries)."""

    object = ""
    chunk_object = ""
    # Where the prompt's ids go: in the choice (completions) or beside the choices (chat).
    prompt_ids_in_choice = True

    def __init__(
        self,
        model: str,
        *,
        request_id: str | None = None,
        logprobs: int | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        id_prefix: str = "cmpl",
    ) -> None:
        self.id = completion_id(request_id, id_prefix)
        self.created = int(time.time())
        self.model = model
        self.logprobs = logprobs
        self.prompt_token_ids = None if prompt_token_ids is None else list(prompt_token_ids)
        self._started = False
        self._held_logprobs: list[TokenLogprobs] = []
        self._held_ids: list[int] = []

    @property
    def with_logprobs(self) -> bool:
        return self.logprobs is not None

    @property
    def with_token_ids(self) -> bool:
        return self.prompt_token_ids is not None

    def _head(self, object_: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model}

    def _content(self, text: str, *, delta: bool) -> dict[str, Any]:
        """The choice's text (`delta`: a stream's chunk)."""
        raise NotImplementedError

    def _logprobs(self, entries: Sequence[TokenLogprobs]) -> dict[str, Any] | None:
        raise NotImplementedError

    def _choice(
        self,
        content: dict[str, Any],
        finish_reason: str | None,
        logprobs: Sequence[TokenLogprobs],
        token_ids: Sequence[int],
        *,
        prompt_ids: bool,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": 0,
            **content,
            "logprobs": self._logprobs(logprobs),
            "finish_reason": finish_reason,
        }
        if self.with_token_ids:
            if prompt_ids and self.prompt_ids_in_choice:
                choice["prompt_token_ids"] = self.prompt_token_ids
            choice["token_ids"] = list(token_ids)
        return choice

    def completion(
        self,
        text: str,
        finish_reason: str,
        usage_: dict[str, Any],
        logprobs: Sequence[TokenLogprobs] = (),
        token_ids: Sequence[int] = (),
        **extra: Any,
    ) -> dict[str, Any]:
        content, finish_reason = self._whole(text, finish_reason)
        choice = self._choice(content, finish_reason, logprobs, token_ids, prompt_ids=True)
        out = {**self._head(self.object), "choices": [choice], "usage": usage_}
        if self.with_token_ids and not self.prompt_ids_in_choice:
            out["prompt_token_ids"] = self.prompt_token_ids
        return {**out, **extra}

    def _whole(self, text: str, finish_reason: str) -> tuple[dict[str, Any], str]:
        """A whole answer's choice content and finish reason."""
        return self._content(text, delta=False), finish_reason

    def start(self) -> bytes:
        """The stream's opening event, if the API has one (chat: the role); b"" otherwise.
        Send it only once the KV arrived: the gateway reads a first event as that sign."""
        return b""

    def chunk(
        self,
        text: str,
        finish_reason: str | None,
        logprobs: Sequence[TokenLogprobs] = (),
        token_ids: Sequence[int] = (),
    ) -> bytes:
        """The stream's event for the next piece; b"" when `_delta` holds it back: its
        tokens' logprobs and ids then go with the next event that is sent."""
        piece = self._delta(text, finish_reason)
        if piece is None:
            self._held_logprobs.extend(logprobs)
            self._held_ids.extend(token_ids)
            return b""
        if self._held_logprobs or self._held_ids:
            logprobs = [*self._held_logprobs, *logprobs]
            token_ids = [*self._held_ids, *token_ids]
            self._held_logprobs.clear()
            self._held_ids.clear()
        content, finish_reason = piece
        return self._event(content, finish_reason, logprobs, token_ids)

    def _delta(
        self, text: str, finish_reason: str | None
    ) -> tuple[dict[str, Any], str | None] | None:
        """A stream chunk's choice content and finish reason; None: nothing to send yet."""
        return self._content(text, delta=True), finish_reason

    def _event(
        self,
        content: dict[str, Any],
        finish_reason: str | None,
        logprobs: Sequence[TokenLogprobs],
        token_ids: Sequence[int],
    ) -> bytes:
        choice = self._choice(content, finish_reason, logprobs, token_ids, prompt_ids=self._first())
        return sse_event({**self._head(self.chunk_object), "choices": [choice]})

    def usage_chunk(self, usage_: dict[str, Any]) -> bytes:
        return sse_event({**self._head(self.chunk_object), "choices": [], "usage": usage_})

    def _first(self) -> bool:
        """Whether this is the stream's first event (which carries the prompt's ids)."""
        first, self._started = not self._started, True
        return first


class CompletionShape(Shape):
    """``text_completion`` answers. With ``logprobs``, every choice carries OpenAI's
    completions ``logprobs`` for its tokens; ``text_offset`` counts from the start of the
    completion's text and goes on across chunks, as vLLM's does."""

    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, model: str, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self._offset = 0

    def _content(self, text: str, *, delta: bool) -> dict[str, Any]:
        return {"text": text}

    def _logprobs(self, entries: Sequence[TokenLogprobs]) -> dict[str, Any] | None:
        if not self.with_logprobs:
            return None
        offsets = []
        for entry in entries:
            offsets.append(self._offset)
            self._offset += len(entry.token)
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [dict(e.top) for e in entries],
            "text_offset": offsets,
        }


class ChatShape(Shape):
    """``chat.completion`` answers and ``chat.completion.chunk`` streams: a first chunk with
    the assistant's role (and the prompt's ids), then content deltas; logprobs as
    ``{"content": [...]}``.

    With `tools` (a request whose engine calls tools) the generated text goes through the
    tool-call parser: content and ``tool_calls`` deltas, the finish reason it gives. A
    chunk whose text it holds back is not sent; its tokens' logprobs and ids go with the
    next chunk that is."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    prompt_ids_in_choice = False

    def __init__(self, model: str, *, tools: ToolCallParser | None = None, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self._tools = tools

    def _whole(self, text: str, finish_reason: str) -> tuple[dict[str, Any], str]:
        tools = self._tools
        if tools is None:
            return super()._whole(text, finish_reason)
        return {"message": tools.message(text, finish_reason)}, tools.finish_reason(finish_reason)

    def _delta(
        self, text: str, finish_reason: str | None
    ) -> tuple[dict[str, Any], str | None] | None:
        """Through the tool-call parser when there is one: None while it holds the text back."""
        tools = self._tools
        if tools is None:
            return super()._delta(text, finish_reason)
        delta = tools.feed(text, finish_reason)
        if finish_reason is not None:
            return {"delta": delta or {}}, tools.finish_reason(finish_reason)
        if delta is None:
            return None
        return {"delta": delta}, None

    def _content(self, text: str, *, delta: bool) -> dict[str, Any]:
        if delta:
            return {"delta": {"content": text}}
        return {"message": {"role": "assistant", "content": text}}

    def _logprobs(self, entries: Sequence[TokenLogprobs]) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        top = self.logprobs
        return {
            "content": [
                {
                    **_chat_logprob(e.token, e.logprob),
                    "top_logprobs": [_chat_logprob(t, lp) for t, lp in e.top[:top]],
                }
                for e in entries
            ]
        }

    def start(self) -> bytes:
        event: dict[str, Any] = {
            **self._head(self.chunk_object),
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        }
        if self._first() and self.with_token_ids:
            event["prompt_token_ids"] = self.prompt_token_ids
        return sse_event(event)


def _chat_logprob(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def shape_for(
    req: ApiRequest,
    served_model: str,
    request_id: str | None,
    prompt_tokens: Sequence[int],
    tools: ToolUse | None = None,
) -> Shape:
    """The answer's shape for `req` (its API, logprobs and token ids; `tools`: the chat's
    tool use, for an engine that calls tools)."""
    kwargs: dict[str, Any] = {
        "request_id": request_id,
        "logprobs": req.logprob_count,
        "prompt_token_ids": prompt_tokens if req.return_token_ids else None,
    }
    if isinstance(req, ChatCompletionRequest):
        parser = (
            None if tools is None else ToolCallParser(prompt_tokens, named=tools.name is not None)
        )
        return ChatShape(
            req.model or served_model, id_prefix=Api.CHAT.id_prefix, tools=parser, **kwargs
        )
    return CompletionShape(req.model or served_model, **kwargs)
