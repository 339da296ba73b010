"""The OpenAI ``/v1/completions`` request and response shapes, as vLLM serves them.

Only the fields a shim acts on are typed and checked; the sampling fields an engine can apply
are collected in `CompletionRequest.sampling` (the sim ignores them, vllm applies them), other
fields are accepted and ignored, but a known field of the wrong type is a 400, never a 500.
Error messages never echo request content: it may be a prompt.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from engine_shim._http import ApiError, bad_request
from engine_shim.wire import sse_event

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
MAX_STOP_SEQUENCES = 4

_NUMERIC = (
    "temperature",
    "top_p",
    "top_k",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_p",
)
# Passed to the engine when present; the engine checks their ranges.
SAMPLING_FIELDS = (*_NUMERIC, "seed", "ignore_eos")


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    prompt: str | list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]
    model: str | None
    kv_transfer_params: dict[str, Any] | None
    sampling: dict[str, Any]


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _prompt(raw: object) -> str | list[int]:
    # vLLM accepts a string, token ids, or a batch of either; one prompt per request here.
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str | list):
        raw = raw[0]
    if isinstance(raw, str):
        if not raw:
            raise bad_request("prompt must not be empty", "prompt")
        return raw
    if isinstance(raw, list) and raw and all(_is_int(t) for t in raw):
        return list(raw)
    if isinstance(raw, list) and len(raw) > 1:
        raise bad_request("exactly one prompt per request is supported", "prompt")
    raise bad_request(
        "prompt must be a non-empty string or a non-empty list of token ids", "prompt"
    )


def _stop(raw: object) -> tuple[str, ...]:
    if raw is None:
        return ()
    if isinstance(raw, str):
        return (raw,) if raw else ()
    if isinstance(raw, list) and all(isinstance(s, str) for s in raw):
        if len(raw) > MAX_STOP_SEQUENCES:
            raise bad_request(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed", "stop")
        return tuple(s for s in raw if s)
    raise bad_request("stop must be a string or a list of strings", "stop")


def parse_completion(body: bytes, *, max_model_len: int) -> CompletionRequest:
    try:
        raw = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise bad_request("request body is not valid JSON") from None
    if not isinstance(raw, dict):
        raise bad_request("request body must be a JSON object")
    if "prompt" not in raw:
        raise bad_request("prompt is required", "prompt")
    prompt = _prompt(raw["prompt"])

    max_tokens = raw.get("max_tokens")
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    elif not _is_int(max_tokens):
        raise bad_request("max_tokens must be an integer", "max_tokens")
    if not 1 <= max_tokens <= max_model_len:
        raise bad_request(f"max_tokens must be between 1 and {max_model_len}", "max_tokens")

    stream = raw.get("stream")
    if stream is None:
        stream = False
    elif not isinstance(stream, bool):
        raise bad_request("stream must be a boolean", "stream")
    options = raw.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request("stream_options must be an object", "stream_options")
        if not stream:
            raise bad_request(
                "stream_options is only allowed when stream is true", "stream_options"
            )
        include_usage = options.get("include_usage") or False
        if not isinstance(include_usage, bool):
            raise bad_request("stream_options.include_usage must be a boolean", "stream_options")

    model = raw.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    for name in ("n", "best_of"):
        value = raw.get(name)
        if value is not None and (not _is_int(value) or value != 1):
            raise bad_request(f"only {name}=1 is supported", name)
    if raw.get("echo"):
        raise bad_request("echo is not supported", "echo")
    for name in _NUMERIC:
        value = raw.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise bad_request(f"{name} must be a number", name)
    seed = raw.get("seed")
    if seed is not None and not _is_int(seed):
        raise bad_request("seed must be an integer", "seed")
    ignore_eos = raw.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise bad_request("ignore_eos must be a boolean", "ignore_eos")
    params = raw.get("kv_transfer_params")
    if params is not None and not isinstance(params, dict):
        raise bad_request("kv_transfer_params must be an object", "kv_transfer_params")

    return CompletionRequest(
        prompt=prompt,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        stop=_stop(raw.get("stop")),
        model=model,
        kv_transfer_params=params,
        sampling={k: raw[k] for k in SAMPLING_FIELDS if raw.get(k) is not None},
    )


def check_model(req: CompletionRequest, served: str) -> None:
    if req.model is not None and req.model != served:
        raise ApiError(
            404, f"The model `{req.model}` does not exist.", param="model", code="model_not_found"
        )


def check_length(prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    if prompt_tokens + max_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{prompt_tokens} tokens and max_tokens is {max_tokens}.",
            "prompt",
        )


def new_completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


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


class CompletionShape:
    """Builds the JSON of one completion (whole or as SSE chunks) with a fixed id and time."""

    __slots__ = ("created", "id", "model")

    def __init__(self, model: str) -> None:
        self.id = new_completion_id()
        self.created = int(time.time())
        self.model = model

    def _choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def completion(
        self, text: str, finish_reason: str, usage_: dict[str, Any], **extra: Any
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [self._choice(text, finish_reason)],
            "usage": usage_,
            **extra,
        }

    def chunk(self, text: str, finish_reason: str | None) -> bytes:
        return sse_event(
            {
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [self._choice(text, finish_reason)],
            }
        )

    def usage_chunk(self, usage_: dict[str, Any]) -> bytes:
        return sse_event(
            {
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": usage_,
            }
        )
