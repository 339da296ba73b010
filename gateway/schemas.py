"""Validation of client requests (``POST /v1/completions``).

Only what the gateway must understand is typed; every other OpenAI/vLLM sampling field is
kept and forwarded unchanged, so new engine parameters need no gateway release.
"""

from __future__ import annotations

from typing import Annotated, Any

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
)

from gateway.errors import BadRequest

# Fields the P/D path cannot honour; rejecting them beats silently ignoring them.
_UNSUPPORTED = {
    "echo": "echo is not supported by the disaggregated path",
    "suffix": "suffix is not supported",
    "kv_transfer_params": "kv_transfer_params is set by the gateway, not by clients",
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    model: StrictStr | None = None
    prompt: StrictStr | list[StrictStr]
    max_tokens: StrictInt | None = None
    temperature: Annotated[StrictFloat | StrictInt, Field(ge=0, le=2)] | None = None
    top_p: Annotated[StrictFloat | StrictInt, Field(gt=0, le=1)] | None = None
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=4)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    n: Annotated[StrictInt, Field(ge=1, le=1)] = 1
    best_of: Annotated[StrictInt, Field(ge=1, le=1)] | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and len(v) != 1:
            raise ValueError("exactly one prompt per request is supported")
        text = v if isinstance(v, str) else v[0]
        if not text:
            raise ValueError("prompt must not be empty")
        return v

    @property
    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


def parse_completion(
    body: bytes, *, max_tokens_limit: int, default_max_tokens: int
) -> tuple[CompletionRequest, dict[str, Any]]:
    """Validate `body`; return the typed request and the dict to forward upstream."""
    try:
        raw = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise BadRequest("request body must be a JSON object")
    for key, why in _UNSUPPORTED.items():
        if raw.get(key) is not None and raw.get(key) is not False:
            raise BadRequest(why, param=key)
    try:
        req = CompletionRequest.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors(include_url=False, include_input=False)[0]
        # loc[0] is the field; deeper parts name pydantic's union branches, not client fields.
        param = str(err["loc"][0]) if err["loc"] else None
        # Never echo the input back: it may be a prompt.
        raise BadRequest(f"invalid request: {param or 'body'}: {err['msg']}", param=param) from exc
    if req.max_tokens is not None and not 1 <= req.max_tokens <= max_tokens_limit:
        raise BadRequest(f"max_tokens must be between 1 and {max_tokens_limit}", param="max_tokens")
    if req.stream_options is not None and not req.stream:
        raise BadRequest(
            "stream_options is only allowed when stream is true", param="stream_options"
        )
    forward = dict(raw)
    forward["max_tokens"] = req.max_tokens or default_max_tokens
    return req, forward
