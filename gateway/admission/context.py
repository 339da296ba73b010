"""A prompt's tokens, and the 400 for a request that cannot fit in its model's context.

`TokenCounter` is the seam: ``await count(model, body)`` is the prompt tokens of `body` as
the engine serving `model` counts them, or None when nobody can say. `body` is either

* a chat body: ``messages`` with the fields that shape the rendered prompt (``tools``,
  ``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``), as
  ``/v1/chat/completions`` takes them; or
* a completions body: ``prompt`` as text or token ids (or a one-element batch of either).

`EngineTokenCounter` counts token ids as they are, and text with the gateway's tokenizer of
the model where it has one (gateway/instances/prompt_tokens.py: configured ``tokenizers``, a
model directory, or the sim's), as the engine adds special tokens to a completion prompt. A
chat body, and text it has no tokenizer for, it asks an engine: ``POST /tokenize`` to a ready
instance of the model that declares it (gateway/instances/endpoints.py), which renders the
conversation with its own chat template, so the count is exact. Each try is bounded by
``token_count_timeout_s``, at most ``token_count_tries`` instances are tried. The
``/v1/messages/count_tokens`` endpoint calls it with its translated chat body.
`FakeTokenCounter` answers from a table, for tests.

`ContextLimit` is the 400. A request whose prompt plus ``max_tokens`` exceeds its model's
``max_model_len`` (the smallest a ready instance reports, gateway/instances/tracker.py) gets
400 ``context_length_exceeded`` naming both numbers, before it is queued, so that it never
waits for a slot or is shed with a retryable 503 (early drop) when no retry could serve it.
A request that surely fits costs nothing but arithmetic: it is counted only when the cheap
upper bound of its tokens,

    body bytes + template_tokens + message_tokens * messages + max_tokens,

exceeds the limit. Why it bounds: every token a tokenizer cuts from text covers at least one
byte of it (byte-level BPE, SentencePiece with byte fallback), and a request's texts are in
its body (JSON adds quotes, keys and escapes, never removes a byte); what a tokenizer or
template adds beyond the text (BOS, SentencePiece's leading space, role markers, a default
system prompt, tool instructions) is covered by ``context_template_tokens`` per request and
``context_message_tokens`` per message. Token ids are counted exactly (their count is the
list's length). A template that adds more than those allowances can only let through a
request that is then refused by the engine's own 400, relayed to the client. Where the
model's ``max_model_len`` is unknown, nothing is checked.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import orjson

from pdgate.config.openai_api import ApiRequest, ChatCompletionRequest, CompletionRequest
from pdgate.config.wire import TOKENIZE_PATH
from pdgate.gateway.errors import ContextLengthExceeded
from pdgate.gateway.instances.endpoints import call_first, serving
from pdgate.gateway.instances.prompt_tokens import PromptTokenizers
from pdgate.gateway.instances.tracker import InstanceTracker
from pdgate.gateway.upstream.base import Upstream

__all__ = [
    "CHAT_FIELDS",
    "ContextLimit",
    "EngineTokenCounter",
    "FakeTokenCounter",
    "TokenCounter",
]

# What of a chat body shapes its rendered prompt: what ``/tokenize`` is sent.
CHAT_FIELDS = (
    "messages",
    "tools",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
)


class TokenCounter(Protocol):
    async def count(self, model: str, body: Mapping[str, Any]) -> int | None:
        """The prompt tokens of `body` (a chat body or a completions prompt: see the module
        docstring) as the engine serving `model` (a model or a LoRA adapter) counts them;
        None when nobody can say (no tokenizer, no instance answering ``/tokenize``)."""
        ...


class FakeTokenCounter:
    """A `TokenCounter` for tests: `counts(model, body)` answers, and every call is kept."""

    def __init__(self, counts: Callable[[str, Mapping[str, Any]], int | None]) -> None:
        self._counts = counts
        self.calls: list[tuple[str, Mapping[str, Any]]] = []

    async def count(self, model: str, body: Mapping[str, Any]) -> int | None:
        self.calls.append((model, body))
        return self._counts(model, body)


def _token_ids(prompt: object) -> list[int] | None:
    """The ids of a token-id prompt (or a one-element batch of one); None for anything else."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    return None


def _text(prompt: object) -> str | None:
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None


class EngineTokenCounter:
    """`TokenCounter` from the gateway's tokenizers and the engines' ``/tokenize``."""

    def __init__(
        self,
        tracker: InstanceTracker,
        upstream: Upstream,
        tokenizers: PromptTokenizers | None = None,
        *,
        timeout_s: float = 2.0,
        tries: int = 2,
    ) -> None:
        if timeout_s <= 0 or tries < 1:
            raise ValueError("timeout_s must be positive and tries at least 1")
        self._tracker = tracker
        self._upstream = upstream
        self._tokenizers = tokenizers
        self._timeout_s = timeout_s
        self._tries = tries

    async def count(self, model: str, body: Mapping[str, Any]) -> int | None:
        if "messages" in body:
            ask = {k: body[k] for k in CHAT_FIELDS if body.get(k) is not None}
        else:
            prompt = body.get("prompt")
            ids = _token_ids(prompt)
            if ids is not None:
                return len(ids)
            text = _text(prompt)
            if text is None:
                return None
            if self._tokenizers is not None:
                # An adapter is tokenized as its model is.
                encoded = self._tokenizers.encode(self._tracker.parent(model) or model, text)
                if encoded is not None:
                    return len(encoded[0])
            ask = {"prompt": text}
        return await self._ask(model, {"model": model, **ask})

    async def _ask(self, model: str, body: dict[str, Any]) -> int | None:
        """``POST /tokenize`` to the least loaded instances of `model` that serve it."""
        candidates = serving(self._tracker, model, TOKENIZE_PATH)
        if not candidates:
            return None
        failed: list[str] = []
        for inst in candidates[: self._tries]:
            answer = await call_first(
                self._upstream,
                [inst],
                TOKENIZE_PATH,
                body,
                request_id=f"count-{secrets.token_hex(8)}",
                deadline=time.monotonic() + self._timeout_s,
                tries=1,
                failed=failed,
            )
            if answer is None:
                continue
            if answer.status != 200:
                return None  # the engine refused the request: its own error says why, later
            try:
                count = orjson.loads(answer.body)["count"]
            except (orjson.JSONDecodeError, KeyError, TypeError):
                continue
            if type(count) is int and count >= 0:
                return count
        return None


class ContextLimit:
    """The context-length 400 (see the module docstring)."""

    def __init__(
        self,
        tracker: InstanceTracker,
        counter: TokenCounter,
        *,
        template_tokens: int = 1024,
        message_tokens: int = 32,
    ) -> None:
        if template_tokens < 0 or message_tokens < 0:
            raise ValueError("the template allowances are not negative")
        self._tracker = tracker
        self._counter = counter
        self._template = template_tokens
        self._per_message = message_tokens

    @property
    def counter(self) -> TokenCounter:
        return self._counter

    def may_exceed(self, model: str, body_bytes: int, req: ApiRequest, max_tokens: int) -> bool:
        """Whether `req` (its body `body_bytes` long) might not fit: its tokens' cheap upper
        bound plus `max_tokens` exceeds the model's known context. False costs one lookup."""
        limit = self._tracker.max_model_len(model)
        if limit is None:
            return False
        messages = len(req.messages) if isinstance(req, ChatCompletionRequest) else 0
        bound = body_bytes + self._template + self._per_message * messages + max_tokens
        return bound > limit

    async def check(
        self, model: str, req: ApiRequest, forward: Mapping[str, Any], max_tokens: int
    ) -> None:
        """Raise `ContextLengthExceeded` when `req`'s prompt plus `max_tokens` exceeds the
        model's context, counted exactly (nothing when it cannot be counted)."""
        limit = self._tracker.max_model_len(model)
        if limit is None:
            return
        if isinstance(req, CompletionRequest) and req.prompt_ids is not None:
            prompt: int | None = len(req.prompt_ids)
        else:
            prompt = await self._counter.count(model, forward)
        if prompt is None or prompt + max_tokens <= limit:
            return
        chat = isinstance(req, ChatCompletionRequest)
        where = "messages" if chat else "prompt"
        raise ContextLengthExceeded(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt + max_tokens} tokens ({prompt} in the {where}, {max_tokens} in the "
            f"completion). Please reduce the length of the {where} or completion.",
            param=where if prompt >= limit else "max_tokens",
        )
