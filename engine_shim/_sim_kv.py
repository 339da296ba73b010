"""KV bytes of the sim engine: the prefill's contiguous buffer and the decode's receiving end.

The buffer's content is the prompt's token ids (little-endian uint32) repeated to the wire
size, so every prompt has distinct bytes and a digest to verify, while nothing of that size
is ever held in memory: chunks are cut on demand from one tile. Its digest is computed once
when the prefill completes (in a worker thread for large buffers; hashlib releases the GIL).

On the decode, `KvLink` models the full-size transfer over the instance's NIC: transfers share
the link first come first served (P/D-Serve: "concurrent transmissions share the D2D
bandwidth"), each also pays the fixed metadata exchange.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from hashlib import blake2b

from pdgate.engine_shim._sim_text import pack_tokens
from pdgate.engine_shim.sim_profile import SimProfile

# Above this size the digest is computed off the event loop.
_THREAD_DIGEST_BYTES = 1 << 20
_DIGEST_CHUNK = 1 << 20


def _tile(pattern: bytes, span: int) -> bytes:
    """`pattern` repeated to at least `span` + len(pattern) bytes, so any window of `span`
    bytes starting at any offset modulo len(pattern) is one slice."""
    return pattern * (span // len(pattern) + 2)


def _windows(nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    return [(off, min(chunk_bytes, nbytes - off)) for off in range(0, nbytes, chunk_bytes)]


def _digest(pattern: bytes, nbytes: int) -> str:
    h = blake2b(digest_size=16)
    tile = memoryview(_tile(pattern, min(nbytes, _DIGEST_CHUNK)))
    period = len(pattern)
    for off, size in _windows(nbytes, _DIGEST_CHUNK):
        start = off % period
        h.update(tile[start : start + size])
    return h.hexdigest()


class SimKvBuffer:
    """`KvSource` of the sim engine."""

    __slots__ = ("_pattern", "digest", "nbytes", "tokens")

    def __init__(self, pattern: bytes, tokens: int, nbytes: int, digest: str) -> None:
        self._pattern = pattern
        self.tokens = tokens
        self.nbytes = nbytes
        self.digest = digest

    @classmethod
    async def build(cls, tokens: Sequence[int], nbytes: int) -> SimKvBuffer:
        """The buffer of `tokens`, `nbytes` long."""
        pattern = pack_tokens(tokens) or b"\x00"
        if nbytes >= _THREAD_DIGEST_BYTES:
            digest = await asyncio.to_thread(_digest, pattern, nbytes)
        else:
            digest = _digest(pattern, nbytes)
        return cls(pattern, len(tokens), nbytes, digest)

    async def chunks(self, chunk_bytes: int) -> AsyncIterator[bytes]:
        pattern = self._pattern
        period = len(pattern)
        tile = memoryview(_tile(pattern, min(self.nbytes, chunk_bytes)))
        for off, size in _windows(self.nbytes, chunk_bytes):
            start = off % period
            yield bytes(tile[start : start + size])

    def release(self) -> None:
        self._pattern = b"\x00"


class KvLink:
    """The decode's incoming KV link, shared first come first served."""

    def __init__(self, profile: SimProfile) -> None:
        self._profile = profile
        self._free_at = 0.0

    async def transfer(self, tokens: int) -> None:
        """Sleep for the modelled full-size transfer of `tokens` tokens of KV."""
        profile = self._profile
        if tokens <= 0 or profile.kv_transfer_s(tokens) <= 0:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        busy = profile.kv_bytes(tokens) / profile.kv_bandwidth_bytes_s
        start = max(now, self._free_at)
        end = start + busy
        self._free_at = end
        try:
            await asyncio.sleep(end - now + profile.kv_transfer_latency_s)
        except asyncio.CancelledError:
            if self._free_at == end:  # nobody queued behind us: give the link time back
                self._free_at = max(loop.time(), start)
            raise


class SimKvSink:
    """`KvSink` of the sim engine: counts the bytes (a real engine would scatter them into
    its paged KV blocks) and adds the modelled transfer time on commit."""

    __slots__ = ("_discarded", "_link", "committed", "expected", "received", "tokens")

    def __init__(self, tokens: int, nbytes: int, link: KvLink) -> None:
        self.tokens = tokens
        self.expected = nbytes
        self.received = 0
        self.committed = False
        self._discarded = False
        self._link = link

    def write(self, chunk: bytes) -> None:
        self.received += len(chunk)

    async def commit(self) -> None:
        if self._discarded:
            raise RuntimeError("KV sink was discarded")
        if self.received != self.expected:
            raise ValueError(f"received {self.received} KV bytes, expected {self.expected}")
        await self._link.transfer(self.tokens)
        self.committed = True

    def discard(self) -> None:
        self._discarded = True
        self.committed = False
