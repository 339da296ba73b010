"""``POST /tokenize`` and ``POST /detokenize`` on a shim, in vLLM's shapes.

vLLM's API server answers these itself, from its tokenizer and chat template, without the
engine's batch; so does a shim, from its backend (`Tokenization`). The requests are vLLM's
(vllm/entrypoints/serve/tokenize/protocol.py):

* a completion prompt, ``{"model", "prompt", "add_special_tokens": true,
  "return_token_strs": false}``;
* a conversation, ``{"model", "messages", "add_generation_prompt": true,
  "continue_final_message": false, "add_special_tokens": false, "tools",
  "chat_template_kwargs", "return_token_strs": false}``, rendered with the model's chat
  template as a chat request would be;

answered ``{"count", "max_model_len", "tokens", "token_strs"}``; ``{"model", "tokens"}`` to
``/detokenize`` is answered ``{"prompt"}``. The model may be a LoRA adapter the engine
serves (its tokenizer is the model's). Like the completion paths they need the cluster token
when one is set; they hold no slot. A gateway counts a prompt's tokens with ``/tokenize``
(gateway/admission/context.py), so it must answer as the engine would count.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pdgate.config.openai_api import ChatMessage, ClientGone, load_object, read_body, validate
from pdgate.config.wire import DETOKENIZE_PATH, MAX_CHAT_MESSAGES, TOKENIZE_PATH
from pdgate.engine_shim._completion import chat_prompt, check_model
from pdgate.engine_shim._http import ApiError, ClusterAuth, bad_request, json_response
from pdgate.engine_shim.backend import Tokenization

__all__ = ["TokenizeEndpoints"]

# Longest engine message passed on (a template's refusal, an unknown id).
_MAX_ENGINE_MESSAGE = 300


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    model: StrictStr | None = None
    return_token_strs: StrictBool | None = False


class _TokenizePrompt(_Common):
    prompt: StrictStr
    add_special_tokens: StrictBool = True


class _TokenizeChat(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_CHAT_MESSAGES)]
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False
    tools: Annotated[list[dict[str, Any]], Field(max_length=1024)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class _Detokenize(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    model: StrictStr | None = None
    tokens: list[Annotated[StrictInt, Field(ge=0, le=2**63 - 1)]]


class TokenizeEndpoints:
    """The two routes over `backend`; `model` and `adapters` are what it serves and
    `max_model_len` its context (read when asked: a vllm engine knows it once started)."""

    def __init__(
        self,
        backend: Tokenization,
        model: str,
        adapters: Callable[[], Collection[str]],
        max_model_len: Callable[[], int],
        *,
        auth: ClusterAuth,
        max_body_bytes: int,
        body_timeout_s: float,
    ) -> None:
        self._backend = backend
        self._model = model
        self._adapters = adapters
        self._max_model_len = max_model_len
        self._auth = auth
        self._max_body_bytes = max_body_bytes
        self._body_timeout_s = body_timeout_s

    def routes(self) -> list[Route]:
        return [
            Route(TOKENIZE_PATH, self.tokenize, methods=["POST"]),
            Route(DETOKENIZE_PATH, self.detokenize, methods=["POST"]),
        ]

    async def tokenize(self, request: Request) -> Response:
        try:
            raw = await self._body(request)
            if "messages" in raw:
                chat = validate(_TokenizeChat, raw)
                self._check_model(chat.model)
                if chat.continue_final_message and chat.add_generation_prompt:
                    raise bad_request(
                        "Cannot set both `continue_final_message` and `add_generation_prompt` "
                        "to True.",
                        "continue_final_message",
                    )
                if chat.add_special_tokens:
                    raise bad_request(
                        "this engine renders a conversation with its template's own special "
                        "tokens only (add_special_tokens must be false)",
                        "add_special_tokens",
                    )
                if raw.get("chat_template") is not None:
                    raise bad_request(
                        "chat_template is not accepted; the model's template is used",
                        "chat_template",
                    )
                strs_asked = chat.return_token_strs
                ids, strs = self._engine(lambda: self._backend.tokenize_chat(chat_prompt(chat)))
            else:
                if "prompt" not in raw:
                    raise bad_request("prompt or messages is required", "prompt")
                text = validate(_TokenizePrompt, raw)
                self._check_model(text.model)
                strs_asked = text.return_token_strs
                ids, strs = self._engine(
                    lambda: self._backend.tokenize_text(
                        text.prompt, add_special_tokens=text.add_special_tokens
                    )
                )
        except ApiError as exc:
            return exc.response()
        except ClientGone:
            return Response(status_code=499)  # nobody is listening; for the access log only
        return json_response(
            {
                "count": len(ids),
                "max_model_len": self._max_model_len(),
                "tokens": ids,
                "token_strs": strs if strs_asked else None,
            }
        )

    async def detokenize(self, request: Request) -> Response:
        try:
            req = validate(_Detokenize, await self._body(request))
            self._check_model(req.model)
            try:
                text = self._backend.detokenize(req.tokens)
            except ValueError as exc:
                raise bad_request(str(exc)[:_MAX_ENGINE_MESSAGE], "tokens") from None
        except ApiError as exc:
            return exc.response()
        except ClientGone:
            return Response(status_code=499)
        return json_response({"prompt": text})

    async def _body(self, request: Request) -> dict[str, Any]:
        self._auth.check(request)
        body = await read_body(request, self._max_body_bytes, self._body_timeout_s)
        return load_object(body)

    def _check_model(self, model: str | None) -> None:
        check_model(model, self._model, self._adapters())

    def _engine(
        self, run: Callable[[], tuple[list[int], list[str]]]
    ) -> tuple[list[int], list[str]]:
        try:
            return run()
        except ValueError as exc:  # a template's refusal, an unknown id: the request's fault
            raise bad_request(str(exc)[:_MAX_ENGINE_MESSAGE]) from None
