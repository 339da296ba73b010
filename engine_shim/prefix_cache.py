"""An LRU prefix cache of KV blocks, keyed like vLLM's automatic prefix caching.

A prompt is cut into blocks of `block_size` tokens. Block i is identified by a hash chained
over every block before it (``h_i = H(h_{i-1}, tokens of block i)``), so a block hash names
the whole prefix up to and including that block: two prompts share cached KV exactly as far
as their leading full blocks are equal. Only full blocks are cached (a partial last block is
always recomputed), and at least one prompt token is always recomputed, because the engine
needs the logits of the last position to sample the first output token.

The cache stores hashes only (the sim has no real KV); its capacity is counted in blocks
and the least recently used block is evicted first. With `events` on, it keeps what it
stored and evicted as vLLM's KV events (config/kv_events.py) until `take_events`.
`block_hashes` is a public, stable (blake2b-based) function so other processes can compute
the same chain.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from hashlib import blake2b

from pdgate.config.kv_events import BlockRemoved, BlockStored, KvEvent

__all__ = ["BLOCK_SIZE", "PrefixCache", "block_hashes"]

BLOCK_SIZE = 16  # vLLM's default block size on GPUs


def block_hashes(tokens: Sequence[int], block_size: int = BLOCK_SIZE) -> list[int]:
    """Chained 64-bit hashes of the full blocks of `tokens`."""
    out: list[int] = []
    prev = b"\x00" * 8
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = array("Q", tokens[start : start + block_size]).tobytes()
        prev = blake2b(prev + block, digest_size=8).digest()
        out.append(int.from_bytes(prev, "little"))
    return out


class PrefixCache:
    def __init__(
        self, capacity_blocks: int, block_size: int = BLOCK_SIZE, *, events: bool = False
    ) -> None:
        if capacity_blocks < 0 or block_size <= 0:
            raise ValueError("capacity_blocks must be >= 0 and block_size > 0")
        self._capacity = capacity_blocks
        self._block_size = block_size
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._events: list[KvEvent] | None = [] if events else None
        self.hit_tokens = 0  # cumulative, for /load and metrics
        self.query_tokens = 0

    @property
    def capacity_blocks(self) -> int:
        return self._capacity

    @property
    def block_size(self) -> int:
        return self._block_size

    def __len__(self) -> int:
        return len(self._blocks)

    def lookup_and_insert(self, tokens: Sequence[int]) -> int:
        """Tokens of `tokens` whose KV is already cached; then cache all of its full blocks."""
        hashes = block_hashes(tokens, self._block_size)
        blocks = self._blocks
        hits = 0
        for h in hashes:
            if h not in blocks:
                break
            blocks.move_to_end(h)
            hits += 1
        # Blocks past the first miss that are not cached either (only events need them).
        new = []
        if self._events is not None:
            new = [i for i in range(hits, len(hashes)) if hashes[i] not in blocks]
        for h in hashes[hits:]:
            blocks[h] = None
        # Evicting a parent before its children only makes the children unreachable, which
        # is what a real engine's cache does too; LRU order makes it rare (children are newer).
        evicted: list[int] = []
        while len(blocks) > self._capacity:
            evicted.append(blocks.popitem(last=False)[0])
        if self._events is not None:
            self._note(tokens, hashes, new, evicted)
        cached = min(hits * self._block_size, max(0, len(tokens) - 1))
        self.hit_tokens += cached
        self.query_tokens += len(tokens)
        return cached

    def take_events(self) -> list[KvEvent]:
        """The events since the last call (empty when events are off)."""
        if not self._events:
            return []
        out, self._events = self._events, []
        return out

    def _note(
        self, tokens: Sequence[int], hashes: list[int], new: list[int], evicted: list[int]
    ) -> None:
        assert self._events is not None
        size = self._block_size
        # One BlockStored per run of consecutive new blocks (its parent: the block before).
        run: list[int] = []
        for i in [*new, -1]:
            if run and i != run[-1] + 1:
                first = run[0]
                self._events.append(
                    BlockStored(
                        [hashes[j] for j in run],
                        hashes[first - 1] if first else None,
                        list(tokens[first * size : (run[-1] + 1) * size]),
                        size,
                    )
                )
                run = []
            if i >= 0:
                run.append(i)
        if evicted:
            self._events.append(BlockRemoved(evicted))
