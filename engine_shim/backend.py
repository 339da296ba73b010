"""The engine backend seam: what the HTTP layer (prefill.py, decode.py) needs from an engine.

The shims own HTTP, admission (slots, 429s), KV hand-off over the wire, registration and
streaming; a backend owns tokenization, compute and the KV bytes. ``sim`` (sim_engine.py)
and ``vllm`` (vllm_engine.py) implement these protocols; another engine plugs in by name
(``engine = "package.module:factory"``, see `pdgate.engine_shim.app.make_backend`) without
touching the HTTP layer.

Prefill side: `PrefillBackend.prefill` computes a prompt and returns its first token and a
`KvSource`, the contiguous KV buffer (P/D-Serve's block-free transfer: one buffer per
prompt, sent as a whole). The shim keeps the source until a decode has pulled it, then calls
`KvSource.release`.

Decode side: the shim pulls the bytes and feeds them to a `KvSink` (a real engine scatters
them into its paged blocks: P/D-Serve's RecvScatter), then `DecodeBackend.generate` joins the
running batch and yields one `Generated` per generated token. Closing the generator
(``aclose``) removes the sequence from the batch at once.

A decode backend that can also compute a prompt itself implements `LocalPrefill`: its
`local_kv` is a sink that receives nothing and is committed from the start, and `generate`
given it prefills the prompt in the running batch (conditional disaggregation: the gateway
skips the prefill leg for prompts with few uncached tokens).

Chat requests reach an engine as a `ChatPrompt`: a backend that serves
``/v1/chat/completions`` also implements `ChatTemplate` (render the conversation with the
model's chat template and tokenize it); the shims refuse chat for one that does not.

Function tools: a backend whose model calls them implements `ToolCalling`. A chat request
with ``tools`` (and ``tool_choice`` other than ``"none"``) then reaches it with a `ToolUse`
in its `Sampling` under `TOOL_USE`, the way vLLM's structured outputs reach vLLM's engine in
its sampling params; the engine *generates* the call as text tokens in pdgate's tool-call
syntax (`tool_call_text`: ``<tool_call>NAME\n{arguments}</tool_call>``) and ends the
sequence, and the shims' chat layer parses that text into OpenAI ``tool_calls``
(engine_shim/_tool_calls.py), as vLLM's ``--tool-call-parser`` does on its chat layer. Any
other backend never sees `TOOL_USE`, and the shims refuse a ``tool_choice`` that forces a
call for it.

Every generated token carries its id (`Generated.token_id`, `PrefillOutput.first_token_id`)
when the engine knows it, for vLLM's ``return_token_ids``: an engine that does not gets the
field refused (400), like ``logprobs``.

A backend that knows its model's context length or serves LoRA adapters on top of it says
so (`ReportsModel`): the shim lists them at ``GET /v1/models`` and in its registry record,
takes requests for an adapter by its name, and gives the adapter to `PrefillBackend.prefill`
and `DecodeJob`. One that implements `Tokenization` serves ``/tokenize`` and
``/detokenize`` in vLLM's shapes.

Sampling fields come as the client sent them (`Sampling`); an engine applies the ones it
can. ``logprobs`` is one an engine must honour: asked for k, it attaches a `TokenLogprobs` to
every token (the prefill's first token included); the shim refuses a request whose engine
does not, rather than answer with less than was asked.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "TOOL_USE",
    "ChatPrompt",
    "ChatTemplate",
    "DecodeBackend",
    "DecodeJob",
    "EngineBusy",
    "EngineStats",
    "Generated",
    "InvalidRequest",
    "KvSink",
    "KvSource",
    "LocalKv",
    "LocalPrefill",
    "PrefillBackend",
    "PrefillOutput",
    "Prompt",
    "ReportsModel",
    "Sampling",
    "ServedModel",
    "TokenLogprobs",
    "Tokenization",
    "ToolCalling",
    "ToolUse",
    "tool_call_text",
]

# A prompt as the OpenAI API carries it: text, or token ids.
Prompt = str | Sequence[int]
# The client's sampling fields (temperature, top_p, seed, logprobs, ...) as sent; engines that
# sample (vllm) apply them, the sim derives deterministic logprobs and ignores the rest.
Sampling = Mapping[str, Any]


class EngineBusy(Exception):
    """The engine has no room for another sequence (the shim's admission should prevent it)."""


class InvalidRequest(ValueError):
    """The engine refused the request's parameters (the client gets a 400)."""


@dataclass(frozen=True, slots=True)
class EngineStats:
    running: int  # sequences in the engine's current batch (prefill) or running batch (decode)
    waiting: int  # sequences handed to the engine that have not started
    prefix_hit_tokens: int  # cumulative prompt tokens served from the prefix cache
    prefix_query_tokens: int  # cumulative prompt tokens looked up
    kv_cache_usage: float = 0.0  # fraction of the engine's KV blocks in use (0 when unknown)
    aborted: int = 0  # cumulative requests withdrawn from the engine because their client left


class KvSource(Protocol):
    """The KV cache of one computed prompt, as one contiguous byte buffer."""

    @property
    def tokens(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def digest(self) -> str:
        """blake2b (16-byte) hex digest of the whole buffer."""
        ...

    def chunks(self, chunk_bytes: int) -> AsyncIterator[bytes]:
        """The buffer, in order, in pieces of at most `chunk_bytes`."""
        ...

    def release(self) -> None:
        """Free the buffer; idempotent."""
        ...


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Log-probabilities of one generated token, as OpenAI's completions ``logprobs`` carry them."""

    token: str  # the sampled token as text
    logprob: float  # of the sampled token
    # The most likely tokens at this position, best first: the `logprobs` asked for, and the
    # sampled token among them (vLLM adds it when it is not one of the top ones).
    top: tuple[tuple[str, float], ...]


@dataclass(frozen=True, slots=True)
class Generated:
    """One generated token."""

    # Its piece of the completion's text; may be empty when an engine's text for several
    # tokens arrives in one piece (the text is then on the first of them).
    text: str
    logprobs: TokenLogprobs | None = None  # set when the request asked for logprobs
    token_id: int | None = None  # None: the engine does not say


@dataclass(frozen=True, slots=True)
class PrefillOutput:
    first_token: str  # text of the first generated token
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    kv: KvSource
    logprobs: TokenLogprobs | None = None  # of the first token, when asked for
    first_token_id: int | None = None  # None: the engine does not say


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A chat request's conversation and the options that shape its rendered prompt."""

    # OpenAI messages: role, content (text), and name / tool_calls / tool_call_id when set.
    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Mapping[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: Mapping[str, Any] | None = None


@runtime_checkable
class ChatTemplate(Protocol):
    def render_chat(self, chat: ChatPrompt) -> list[int]:
        """The token ids of `chat` rendered with the model's chat template; raises
        ValueError for a conversation the template refuses."""
        ...


# The `Sampling` key of a chat's `ToolUse` (given only to engines that implement `ToolCalling`).
TOOL_USE = "tool_use"
# pdgate's tool-call syntax: what a `ToolCalling` engine generates for one call.
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


def tool_call_text(name: str, arguments: str) -> str:
    """One call in pdgate's syntax: the function's name on the opening line, then its
    arguments as a JSON object (OpenAI function names hold no newline)."""
    return f"{TOOL_CALL_OPEN}{name}\n{arguments}{TOOL_CALL_CLOSE}"


@dataclass(frozen=True, slots=True)
class ToolUse:
    """A chat request's function tools and choice, checked (engine_shim/_tool_calls.py)."""

    # OpenAI function tools as sent, each ``{"type": "function", "function": {"name": ...}}``.
    tools: Sequence[Mapping[str, Any]]
    name: str | None = None  # ``tool_choice`` names this function: the model must call it
    required: bool = False  # ``tool_choice: "required"``: the model must call a function
    last_role: str = "user"  # the role of the conversation's last message


@runtime_checkable
class ToolCalling(Protocol):
    def tool_call(self, tokens: Sequence[int], use: ToolUse) -> str | None:
        """The call the model makes after the prompt `tokens` (`tool_call_text`), or None
        when it answers with text. A function of its arguments only, so that every engine
        that computes the prompt (a prefill and its decode) decides alike: given `use` under
        ``sampling[TOOL_USE]``, `PrefillBackend.prefill` and `DecodeBackend.generate`
        generate this text's tokens and then end the sequence."""


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What an engine serves besides its model's name."""

    max_model_len: int  # prompt + max_tokens limit
    adapters: tuple[str, ...] = ()  # LoRA adapters on top of the model, by served name


@runtime_checkable
class ReportsModel(Protocol):
    def served_model(self) -> ServedModel:
        """The engine's model as it runs (called once it has started)."""
        ...


@runtime_checkable
class Tokenization(Protocol):
    """``/tokenize`` and ``/detokenize`` as vLLM serves them. The token strings are what
    vLLM's ``return_token_strs`` lists (its tokenizer's pieces)."""

    def tokenize_text(self, text: str, *, add_special_tokens: bool) -> tuple[list[int], list[str]]:
        """Token ids of `text` (with the tokenizer's special tokens, e.g. BOS, or without)
        and each one's token string."""
        ...

    def tokenize_chat(self, chat: ChatPrompt) -> tuple[list[int], list[str]]:
        """As `ChatTemplate.render_chat`, with each token's string."""
        ...

    def detokenize(self, ids: Sequence[int]) -> str:
        """The text of `ids`; raises ValueError for an id the tokenizer cannot write."""
        ...


@runtime_checkable
class PrefillBackend(Protocol):
    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids; raises ValueError for ids the model does not know."""
        ...

    async def prefill(
        self, tokens: Sequence[int], sampling: Sampling | None = None, *, adapter: str | None = None
    ) -> PrefillOutput:
        """Compute a prompt in the next batch (with the LoRA `adapter` named, one of
        `ServedModel.adapters`; the shim passes it only when set). Cancelling it withdraws
        the prompt.

        A cancelled call ends only once the prompt has left the engine: at once if it has
        not started, otherwise at the engine's next step boundary (the shim holds the
        request's admission slot until then, so it never admits work it cannot start).

        Raises `EngineBusy` when more prompts are pending than one batch can hold, and
        `InvalidRequest` when the engine refuses `sampling`.
        """
        ...

    def stats(self) -> EngineStats: ...

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...


class KvSink(Protocol):
    """Receives the KV bytes of one prompt on a decode."""

    def write(self, chunk: bytes) -> None: ...

    async def commit(self) -> None:
        """Every byte arrived and was verified; make the KV usable by `generate`."""
        ...

    def discard(self) -> None:
        """The transfer failed or was abandoned; free what was received. Idempotent."""
        ...


class LocalKv:
    """The `KvSink` of a local prefill: nothing arrives, it is committed from the start."""

    __slots__ = ()
    committed = True

    def write(self, chunk: bytes) -> None:
        raise RuntimeError("a local prefill receives no KV")

    async def commit(self) -> None:
        return None

    def discard(self) -> None:
        return None


@runtime_checkable
class LocalPrefill(Protocol):
    def local_kv(self, tokens: Sequence[int]) -> KvSink:
        """A committed sink with no KV in it (usually a `LocalKv`): `DecodeBackend.generate`
        given it computes the prompt in the engine's own running batch (its prefix cache
        first), sharing the steps with the sequences decoding there."""
        ...


@dataclass(frozen=True, slots=True)
class DecodeJob:
    """One sequence for `DecodeBackend.generate`: one argument rather than four, so a field
    added later (as vLLM's own request objects grow) does not change every engine's
    signature."""

    tokens: Sequence[int]  # the prompt (with any tokens a migrated stream already sent)
    max_tokens: int
    kv: KvSink  # committed: the prompt's KV pulled from a prefill, or `local_kv`'s
    sampling: Sampling | None = None
    adapter: str | None = None  # a LoRA adapter of `ServedModel.adapters`; None: the model


@runtime_checkable
class DecodeBackend(Protocol):
    def tokenize(self, prompt: Prompt) -> list[int]: ...

    def kv_sink(self, tokens: Sequence[int], nbytes: int) -> KvSink:
        """A sink for the `nbytes` of KV of the prompt `tokens`."""
        ...

    def generate(self, job: DecodeJob) -> AsyncGenerator[Generated, None]:
        """Join the running batch with the job's committed KV; yield each token as it is
        generated.

        Ends after ``job.max_tokens`` tokens, or earlier at an end-of-sequence token; ``aclose()``
        leaves the batch at once. Raises `EngineBusy` (on first iteration) when the batch is
        full and `InvalidRequest` when the engine refuses ``job.sampling``.
        """
        ...

    def stats(self) -> EngineStats: ...

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...
