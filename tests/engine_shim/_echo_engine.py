"""An engine backend that lives outside pdgate, in one file: the worked example of
docs/extending.md, loaded by name in tests/engine_shim/test_engines.py.

    pdgate shim --role prefill --engine tests.engine_shim._echo_engine:make_backend
    pdgate shim --role decode  --engine tests.engine_shim._echo_engine:make_backend

A factory takes the shim's settings and returns the backend for its role: a
`PrefillBackend` (tokenize, compute a prompt, hand over its KV as one buffer) or a
`DecodeBackend` (receive that buffer, generate tokens). The shim in front of it does
everything else: HTTP, 429 admission, the KV hand-off, streaming, registration.

The echo engine "generates" the prompt back, one character per token; its "KV cache" is the
prompt's token ids, so the decode can check it received the KV of this very prompt. It
produces no logprobs, so the shim refuses requests that ask for them (400) instead of
answering with less than was asked.
"""

from __future__ import annotations

import array
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from hashlib import blake2b

from pdgate.config import Role, ShimSettings
from pdgate.engine_shim.backend import (
    DecodeJob,
    EngineStats,
    Generated,
    KvSink,
    PrefillOutput,
    Prompt,
    Sampling,
)

_MAX_CODE_POINT = 0x110000


def _tokenize(prompt: Prompt) -> list[int]:
    if isinstance(prompt, str):
        return [ord(c) for c in prompt]  # a token per character: ids are code points
    ids = list(prompt)
    if any(not 0 <= t < _MAX_CODE_POINT for t in ids):
        raise ValueError("token ids of the echo engine are Unicode code points")
    return ids


def _pack(tokens: Sequence[int]) -> bytes:
    return array.array("I", tokens).tobytes()


class EchoKv:
    """`KvSource`: the prompt's ids as one buffer."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self._data = _pack(tokens)
        self._tokens = len(tokens)

    @property
    def tokens(self) -> int:
        return self._tokens

    @property
    def nbytes(self) -> int:
        return len(self._data)

    @property
    def digest(self) -> str:
        return blake2b(self._data, digest_size=16).hexdigest()

    async def chunks(self, chunk_bytes: int) -> AsyncIterator[bytes]:
        for start in range(0, len(self._data), chunk_bytes):
            yield self._data[start : start + chunk_bytes]

    def release(self) -> None:
        self._data = b""


class EchoSink:
    """`KvSink`: collects the buffer and checks it is this prompt's."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self._expected = _pack(tokens)
        self._received = bytearray()
        self.committed = False

    def write(self, chunk: bytes) -> None:
        self._received += chunk

    async def commit(self) -> None:
        if bytes(self._received) != self._expected:
            raise ValueError("the KV received is not this prompt's")
        self.committed = True

    def discard(self) -> None:
        self._received = bytearray()


class EchoPrefill:
    """`PrefillBackend` of the echo engine."""

    def tokenize(self, prompt: Prompt) -> list[int]:
        return _tokenize(prompt)

    async def prefill(
        self, tokens: Sequence[int], sampling: Sampling | None = None
    ) -> PrefillOutput:
        return PrefillOutput(
            first_token=chr(tokens[0]),
            prompt_tokens=len(tokens),
            cached_tokens=0,
            kv=EchoKv(tokens),
        )

    def stats(self) -> EngineStats:
        return EngineStats(running=0, waiting=0, prefix_hit_tokens=0, prefix_query_tokens=0)

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        return None


class EchoDecode:
    """`DecodeBackend` of the echo engine."""

    def __init__(self) -> None:
        self._running = 0

    def tokenize(self, prompt: Prompt) -> list[int]:
        return _tokenize(prompt)

    def kv_sink(self, tokens: Sequence[int], nbytes: int) -> KvSink:
        return EchoSink(tokens)

    async def generate(self, job: DecodeJob) -> AsyncGenerator[Generated, None]:
        # Ending before max_tokens is the engine's end of sequence (finish_reason "stop").
        if not isinstance(job.kv, EchoSink) or not job.kv.committed:
            raise ValueError("generate needs a committed KV sink of this engine")
        self._running += 1
        try:
            for token in job.tokens[: job.max_tokens]:
                yield Generated(chr(token))
        finally:
            self._running -= 1

    def stats(self) -> EngineStats:
        return EngineStats(
            running=self._running, waiting=0, prefix_hit_tokens=0, prefix_query_tokens=0
        )

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        return None


def make_backend(settings: ShimSettings) -> EchoPrefill | EchoDecode:
    """The factory pdgate calls, with the shim's settings, for the shim's role."""
    return EchoPrefill() if settings.role == Role.PREFILL else EchoDecode()
