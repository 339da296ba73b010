"""The engine backend seam: what the HTTP layer (prefill.py, decode.py) needs from an engine.

The shims own HTTP, admission (slots, 429s), KV hand-off over the wire, registration and
streaming; a backend owns tokenization, compute and the KV bytes. ``sim`` implements these
protocols (sim_engine.py); ``torch`` and ``vllm`` backends plug in here without touching the
HTTP layer.

Prefill side: `PrefillBackend.prefill` computes a prompt and returns its first token and a
`KvSource`, the contiguous KV buffer (P/D-Serve's block-free transfer: one buffer per
prompt, sent as a whole). The shim keeps the source until a decode has pulled it, then calls
`KvSource.release`.

Decode side: the shim pulls the bytes and feeds them to a `KvSink` (a real engine scatters
them into its paged blocks: P/D-Serve's RecvScatter), then `DecodeBackend.generate` joins the
running batch and yields one text piece per generated token. Closing the generator
(``aclose``) removes the sequence from the batch at once.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "DecodeBackend",
    "EngineBusy",
    "EngineStats",
    "InvalidRequest",
    "KvSink",
    "KvSource",
    "PrefillBackend",
    "PrefillOutput",
    "Prompt",
    "Sampling",
]

# A prompt as the OpenAI API carries it: text, or token ids.
Prompt = str | Sequence[int]
# The client's sampling fields (temperature, top_p, seed, ...) as sent; engines that sample
# (vllm) apply them, the sim ignores them.
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
class PrefillOutput:
    first_token: str  # text of the first generated token
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    kv: KvSource


@runtime_checkable
class PrefillBackend(Protocol):
    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids; raises ValueError for ids the model does not know."""
        ...

    async def prefill(
        self, tokens: Sequence[int], sampling: Sampling | None = None
    ) -> PrefillOutput:
        """Compute a prompt in the next batch. Cancelling it withdraws the prompt.

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


@runtime_checkable
class DecodeBackend(Protocol):
    def tokenize(self, prompt: Prompt) -> list[int]: ...

    def kv_sink(self, tokens: Sequence[int], nbytes: int) -> KvSink:
        """A sink for the `nbytes` of KV of the prompt `tokens`."""
        ...

    def generate(
        self,
        tokens: Sequence[int],
        max_tokens: int,
        kv: KvSink,
        sampling: Sampling | None = None,
    ) -> AsyncGenerator[str, None]:
        """Join the running batch with committed `kv`; yield one text piece per token.

        Ends after `max_tokens` tokens, or earlier at an end-of-sequence token; ``aclose()``
        leaves the batch at once. Raises `EngineBusy` (on first iteration) when the batch is
        full and `InvalidRequest` when the engine refuses `sampling`.
        """
        ...

    def stats(self) -> EngineStats: ...

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...
