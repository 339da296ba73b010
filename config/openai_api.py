"""The OpenAI HTTP API as both sides of the wire see it: the request schemas, one error type.

Neutral ground like `pdgate.config.wire` (nothing of pdgate's is imported): the gateway
validates client requests and the shims validate the legs they are sent with the same
schemas (`CompletionRequest`, `ChatCompletionRequest`), so the two can never disagree about
a field.

Only what pdgate acts on is typed; every other field is kept (``extra="allow"``) so the
gateway forwards new vLLM sampling parameters without a release. Error messages never echo
request content: it may be a prompt.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Any, Literal, TypeVar

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from pdgate.config.wire import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    DEFAULT_MAX_TOKENS,
    MAX_CHAT_MESSAGES,
    MAX_STOP_SEQUENCES,
)

__all__ = [
    "MAX_JSON_DEPTH",
    "SAMPLING_FIELDS",
    "Api",
    "ApiRequest",
    "ChatCompletionRequest",
    "ChatMessage",
    "ClientGone",
    "CompletionRequest",
    "OpenAIError",
    "chat_from_object",
    "error_body",
    "error_json",
    "load_object",
    "parse_api",
    "parse_chat",
    "parse_completion",
    "read_body",
    "sse_event",
    "validate",
]

# -- errors --------------------------------------------------------------------------------


def error_body(
    message: str, type_: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """An OpenAI error object (``code`` a string or null, as OpenAI's clients expect)."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_json(
    message: str, type_: str, *, param: str | None = None, code: str | None = None
) -> bytes:
    return orjson.dumps(error_body(message, type_, param=param, code=code))


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class OpenAIError(Exception):
    """A failure with its HTTP status and OpenAI error body: `response()` before anything was
    sent, `sse()` in-band once a stream has begun."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        retry_after: float | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.retry_after = retry_after  # seconds
        self.extra_headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        body = error_body(self.message, self.type, param=self.param, code=self.code)
        if self.retry_after is not None:
            body["error"]["retry_after"] = self.retry_after
        return body

    def headers(self) -> dict[str, str]:
        """``Retry-After`` in whole seconds (rounded up: HTTP has no fractions), the same in
        milliseconds as ``retry-after-ms`` (which the OpenAI clients read first), and any
        headers of the error's own (a rate limit's ``x-ratelimit-*``)."""
        headers = dict(self.extra_headers)
        if self.retry_after is not None:
            headers["Retry-After"] = str(math.ceil(self.retry_after))
            headers["retry-after-ms"] = str(round(self.retry_after * 1000))
        return headers

    def response(self) -> Response:
        return Response(
            orjson.dumps(self.body()),
            status_code=self.status,
            headers=self.headers(),
            media_type="application/json",
        )

    def sse(self) -> bytes:
        return sse_event(self.body())


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


class ClientGone(Exception):
    """The client disconnected; nothing can be sent to it any more."""


# -- reading a body ------------------------------------------------------------------------


async def read_body(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """The request body, never holding more than `limit` bytes: a declared Content-Length over
    the limit is refused before reading, a chunked upload as soon as it passes it. An upload
    that is not whole within `timeout_s` gets 408: a client that sends headers and then stalls
    must not hold a connection (or anything counted against it) for ever."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise OpenAIError(400, "invalid Content-Length header") from None
        if size > limit:
            raise OpenAIError(
                413, f"request body of {size} bytes exceeds {limit} bytes", code="payload_too_large"
            )
    chunks: list[bytes] = []
    total = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                total += len(chunk)
                if total > limit:
                    raise OpenAIError(
                        413, f"request body exceeds {limit} bytes", code="payload_too_large"
                    )
                chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone from None
    except TimeoutError:
        raise OpenAIError(
            408, f"request body not received within {timeout_s:g} s", code="request_timeout"
        ) from None
    return b"".join(chunks)


# -- the completions request ---------------------------------------------------------------

Number = StrictFloat | StrictInt
_M = TypeVar("_M", bound=BaseModel)

# orjson reads 1,024 levels of nesting but writes at most 255, and every body is written again
# on its way to an instance (a batch call nests it two levels deeper): a body it could not
# write would fail there, after it was queued. No OpenAI request comes near this depth.
MAX_JSON_DEPTH = 128
# What pdgate cannot honour through the disaggregated path: refused, never silently ignored.
_UNSUPPORTED = {
    "echo": "echo is not supported by the disaggregated path",
    "suffix": "suffix is not supported",
    "prompt_logprobs": "prompt_logprobs is not supported by the disaggregated path (the decode "
    "never computes the prompt)",
}
# Sampling fields pdgate's engines apply (the sim derives deterministic values for the ones
# that shape output, e.g. logprobs); others are forwarded to stock servers unchanged.
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "seed",
    "ignore_eos",
    "logprobs",
)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)
    include_usage: StrictBool = False


class _Common(BaseModel):
    """What completions and chat share: sampling, stop, streaming, the handshake."""

    model_config = ConfigDict(extra="allow", frozen=True)

    model: StrictStr | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    top_k: StrictInt | None = None
    min_p: Annotated[Number, Field(ge=0, le=1)] | None = None
    frequency_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[Number, Field(gt=0)] | None = None
    seed: StrictInt | None = None
    ignore_eos: StrictBool | None = None
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    n: Annotated[StrictInt, Field(ge=1, le=1)] = 1
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's: the prompt's and the completion's token ids in the answer (the prefill's
    # answer carries both; a stream's first chunk the prompt's, every chunk its tokens'),
    # which is what re-submitting a broken stream as prompt + generated tokens needs.
    return_token_ids: StrictBool | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        return tuple(s for s in stops if s)

    @property
    def logprob_count(self) -> int | None:
        """How many most likely tokens to list per generated token (None: no logprobs)."""
        raise NotImplementedError

    @property
    def prompt_key(self) -> str:
        """The prompt as text for prefix hashing and length estimates."""
        raise NotImplementedError

    @property
    def prompt_ids(self) -> tuple[int, ...] | None:
        """The prompt's token ids where the client sent ids (None: text, or a chat)."""
        return None

    def sampling(self) -> dict[str, Any]:
        """The sampling fields the client set, for an engine to apply (``logprobs`` as the
        number of top logprobs per token, in both APIs)."""
        out = {
            k: v for k in SAMPLING_FIELDS if k != "logprobs" and (v := getattr(self, k)) is not None
        }
        if (count := self.logprob_count) is not None:
            out["logprobs"] = count
        return out


class CompletionRequest(_Common):
    """``POST /v1/completions`` as vLLM accepts it, one prompt per request."""

    # vLLM accepts text, token ids, or a one-element batch of either.
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    best_of: Annotated[StrictInt, Field(ge=1, le=1)] | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(
        cls, v: str | list[int] | list[str] | list[list[int]]
    ) -> str | list[int] | list[str] | list[list[int]]:
        one: object = v
        if isinstance(v, list) and v and isinstance(v[0], str | list):
            if len(v) != 1:
                raise ValueError("exactly one prompt per request is supported")
            one = v[0]
        if not one:
            raise ValueError("prompt must not be empty")
        return v

    @property
    def one_prompt(self) -> str | list[int]:
        """The prompt as text or token ids (a one-element batch unwrapped)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            first = p[0]
            return first if isinstance(first, str) else list(first)
        return p if isinstance(p, str) else [int(t) for t in p]  # type: ignore[arg-type]

    @property
    def prompt_key(self) -> str:
        """The prompt as text for prefix hashing and length estimates (ids as a string)."""
        p = self.one_prompt
        return p if isinstance(p, str) else " ".join(map(str, p))

    @property
    def prompt_ids(self) -> tuple[int, ...] | None:
        p = self.one_prompt
        return None if isinstance(p, str) else tuple(p)

    @property
    def logprob_count(self) -> int | None:
        return self.logprobs


def load_object(body: bytes, *, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """A request body that must be a JSON object nested at most `max_depth` levels (400
    otherwise)."""
    try:
        raw = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise bad_request("request body is not valid JSON") from None
    if not isinstance(raw, dict):
        raise bad_request("request body must be a JSON object")
    # Each bracket opens at most one level: most bodies are cleared by two scans in C.
    if body.count(b"[") + body.count(b"{") > max_depth and _deeper_than(raw, max_depth):
        raise bad_request(f"request body is nested more than {max_depth} levels deep")
    return raw


def _deeper_than(value: dict[str, Any], limit: int) -> bool:
    """Whether `value` nests objects and arrays more than `limit` levels deep (it is one)."""
    stack: list[tuple[dict[str, Any] | list[Any], int]] = [(value, 1)]
    while stack:
        container, depth = stack.pop()
        if depth > limit:
            return True
        for item in container.values() if isinstance(container, dict) else container:
            if isinstance(item, dict | list):
                stack.append((item, depth + 1))
    return False


def validate(model: type[_M], raw: dict[str, Any]) -> _M:
    """`raw` as `model`, or a 400 naming the first field that does not fit."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors(include_url=False, include_input=False)[0]
        # loc[0] is the field; deeper parts name pydantic's union branches, not client fields.
        param = str(err["loc"][0]) if err["loc"] else None
        raise bad_request(f"invalid request: {param or 'body'}: {err['msg']}", param) from None


def parse_completion(
    body: bytes, *, max_tokens_limit: int, default_max_tokens: int = DEFAULT_MAX_TOKENS
) -> tuple[CompletionRequest, dict[str, Any]]:
    """Validate `body`; the typed request (``max_tokens`` filled in) and the raw dict (to
    forward upstream unchanged but for ``max_tokens``). Raises `OpenAIError` (400)."""
    raw = load_object(body)
    if "prompt" not in raw:
        raise bad_request("prompt is required", "prompt")
    for key, why in _UNSUPPORTED.items():
        if raw.get(key) not in (None, False):
            raise bad_request(why, key)
    req = validate(CompletionRequest, raw)
    if req.max_tokens is None:
        req = req.model_copy(update={"max_tokens": default_max_tokens})
    elif req.max_tokens > max_tokens_limit:
        raise bad_request(f"max_tokens must be between 1 and {max_tokens_limit}", "max_tokens")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    raw["max_tokens"] = req.max_tokens
    return req, raw


# -- the chat completions request ----------------------------------------------------------

# What pdgate cannot honour through the disaggregated path in a chat request.
_CHAT_UNSUPPORTED = {
    **{k: v for k, v in _UNSUPPORTED.items() if k != "suffix"},
    "echo": "echo is not supported by the disaggregated path",
    # A template sent by the client would run in every instance's template engine.
    "chat_template": "chat_template is not accepted; instances use their model's template",
}
ROLES = ("system", "developer", "user", "assistant", "tool")


class TextPart(BaseModel):
    """One part of a message's content; only text goes through the disaggregated path."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant: the calls it made
    tool_call_id: StrictStr | None = None  # tool: the call this answers

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self

    @property
    def text(self) -> str:
        """The content as one string (text parts joined)."""
        content = self.content
        if content is None:
            return ""
        if isinstance(content, str):
            return content
        return "".join(part.text for part in content)


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions`` as vLLM accepts it, text only, one choice.

    ``tools``, ``tool_choice`` and ``response_format`` are forwarded as they are (a stock vLLM
    applies them; pdgate's shims give ``tools`` to the chat template and refuse what they
    cannot honour); so are vLLM's ``add_generation_prompt``, ``continue_final_message`` and
    ``chat_template_kwargs``, which shape the rendered prompt."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_CHAT_MESSAGES)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=1024)] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def prompt_key(self) -> str:
        """A stable text rendering of the conversation, in order: an earlier turn's key is a
        prefix of a later turn's, so prefix affinity sends a conversation back to the prefill
        that holds its cache (tools first: templates put them before the messages)."""
        parts: list[str] = []
        if self.tools:
            parts.append("<tools>" + orjson.dumps(self.tools, option=orjson.OPT_SORT_KEYS).decode())
        for message in self.messages:
            parts.append(f"<{message.role}>{message.text}")
            if message.tool_calls:
                parts.append(orjson.dumps(message.tool_calls, option=orjson.OPT_SORT_KEYS).decode())
        return "\n".join(parts)


def parse_chat(
    body: bytes, *, max_tokens_limit: int, default_max_tokens: int = DEFAULT_MAX_TOKENS
) -> tuple[ChatCompletionRequest, dict[str, Any]]:
    """Validate a chat body; the typed request and the raw dict to forward. The output limit
    (``max_completion_tokens``, else ``max_tokens``, else the default) is forwarded as
    ``max_tokens`` alone, so the gateway's ``max_tokens = 1`` on the prefill leg is the only
    limit there. Raises `OpenAIError` (400)."""
    return chat_from_object(
        load_object(body), max_tokens_limit=max_tokens_limit, default_max_tokens=default_max_tokens
    )


def chat_from_object(
    raw: dict[str, Any], *, max_tokens_limit: int, default_max_tokens: int = DEFAULT_MAX_TOKENS
) -> tuple[ChatCompletionRequest, dict[str, Any]]:
    """`parse_chat` of a body already read as a JSON object (`load_object`): the gateway's
    translations of other APIs build one (gateway/translate/). `raw` is the dict forwarded."""
    if "messages" not in raw:
        raise bad_request("messages is required", "messages")
    for key, why in _CHAT_UNSUPPORTED.items():
        if raw.get(key) not in (None, False):
            raise bad_request(why, key)
    messages = raw["messages"]
    if isinstance(messages, list):
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list) and any(
                not isinstance(part, dict) or part.get("type") != "text" for part in content
            ):
                raise bad_request(
                    "only text content parts are supported by the disaggregated path",
                    "messages",
                )
    req = validate(ChatCompletionRequest, raw)
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise bad_request(
                "add_generation_prompt and continue_final_message cannot both be true "
                "(add_generation_prompt is true unless set to false)",
                "continue_final_message",
            )
        if req.messages[-1].role != "assistant":
            raise bad_request(
                "continue_final_message needs an assistant message last", "continue_final_message"
            )
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs = true", "top_logprobs")
    limit = req.max_completion_tokens or req.max_tokens
    if limit is None:
        limit = default_max_tokens
    elif limit > max_tokens_limit:
        param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        raise bad_request(f"{param} must be between 1 and {max_tokens_limit}", param)
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    req = req.model_copy(update={"max_tokens": limit, "max_completion_tokens": None})
    raw.pop("max_completion_tokens", None)
    raw["max_tokens"] = limit
    return req, raw


# -- the APIs ------------------------------------------------------------------------------

ApiRequest = CompletionRequest | ChatCompletionRequest


class Api(StrEnum):
    """The OpenAI APIs that go through the two legs."""

    COMPLETIONS = "completions"
    CHAT = "chat"

    @property
    def path(self) -> str:
        return CHAT_PATH if self is Api.CHAT else COMPLETIONS_PATH

    @property
    def id_prefix(self) -> str:
        """The prefix of a response id, as OpenAI's (``cmpl-``, ``chatcmpl-``)."""
        return "chatcmpl" if self is Api.CHAT else "cmpl"


def parse_api(
    api: Api, body: bytes, *, max_tokens_limit: int, default_max_tokens: int = DEFAULT_MAX_TOKENS
) -> tuple[ApiRequest, dict[str, Any]]:
    """`parse_chat` or `parse_completion`, by `api`."""
    parse = parse_chat if api is Api.CHAT else parse_completion
    return parse(body, max_tokens_limit=max_tokens_limit, default_max_tokens=default_max_tokens)
