"""Prefix-affinity index: which prefills recently computed a prompt's leading blocks.

`PrefixLookup` is the seam every prefix index fills (this one, and the KV-event index of
gateway/instances/kv_index.py): it cuts a request's prompt into `PromptBlocks` once, records
where a prompt was sent, and answers which instances hold how many of its leading characters.

Blocks are fixed runs of *characters*, not tokens: the gateway must not depend on each
model's tokenizer, and equal leading text yields equal leading tokens for any tokenizer up to
the last block boundary, which is all an affinity hint needs (a block straddling a token
boundary only shortens the match by one block). Block hashes are chained, so a block matches
only if everything before it matched too, as in vLLM's prefix cache.

Bounded in bytes (`max_bytes`, LRU over block hashes) and in prefills remembered per block
(`max_instances_per_block`). Each block costs about `ENTRY_BYTES` (its 12-byte hash, the LRU
map's entry and a small tuple of instance ids, which are shared strings); measured with
tracemalloc in tests/gateway/instances/test_affinity.py.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pdgate.policies.base import RequestInfo

# Bytes one indexed block costs (see the module docstring); the entry bound is derived from it.
ENTRY_BYTES = 240


def prefix_hashes(text: str, block_chars: int, max_blocks: int) -> list[bytes]:
    """Chained hashes of the text's full leading blocks (a partial last block is skipped:
    engines cache whole blocks only)."""
    hashes: list[bytes] = []
    parent = b""
    for i in range(min(len(text) // block_chars, max_blocks)):
        block = text[i * block_chars : (i + 1) * block_chars].encode("utf-8", "surrogatepass")
        parent = hashlib.blake2b(parent + block, digest_size=12).digest()
        hashes.append(parent)
    return hashes


@dataclass(slots=True, eq=False)
class PromptBlocks:
    """A prompt cut once into what the indexes key it by (kept while the request waits)."""

    chars: list[bytes]  # chained hashes of its leading blocks of characters
    model: str = ""
    tokens: Sequence[int] = ()  # its token ids, where an index tokenized it
    # Prompt characters up to the end of each token (same length as `tokens`).
    token_ends: Sequence[int] = ()
    # Token block size -> chained keys of its full token blocks, computed on first use.
    chains: dict[int, list[int]] = field(default_factory=dict)


class PrefixLookup(Protocol):
    """A prefix index as the placement stage uses it."""

    def blocks(self, info: RequestInfo) -> PromptBlocks:
        """The request's prompt, cut for `match` and `record`."""
        ...

    def routed(self, blocks: PromptBlocks, instance_id: str) -> None:
        """The prompt is being sent to `instance_id` (it has not computed it yet)."""
        ...

    def record(self, blocks: PromptBlocks, instance_id: str) -> None:
        """`instance_id` accepted and computed the prompt (it holds its blocks)."""
        ...

    def expected_cached_tokens(self, blocks: PromptBlocks, instance_id: str) -> int | None:
        """Prompt tokens `instance_id`'s engine should report it found cached (None: this
        index does not count in tokens)."""
        ...

    def match(self, blocks: PromptBlocks) -> dict[str, int]:
        """Instance id -> leading characters of the prompt whose KV it is believed to hold
        (instances holding none are absent)."""
        ...

    def drop_instances(self, departed: Iterable[str]) -> None:
        """Forget instances that left the registry (their caches went with them)."""
        ...

    def stats(self) -> Mapping[str, int]:
        """Its size and bounds, for /admin."""
        ...


class PrefixIndex:
    def __init__(
        self,
        *,
        block_chars: int = 64,
        max_blocks: int = 512,
        max_bytes: int = 16 * 1024 * 1024,
        max_instances_per_block: int = 4,
    ) -> None:
        if block_chars <= 0 or max_blocks <= 0 or max_bytes <= 0 or max_instances_per_block <= 0:
            raise ValueError("prefix index bounds must be positive")
        self.block_chars = block_chars
        self.max_blocks = max_blocks
        self._max_entries = max(1, max_bytes // ENTRY_BYTES)
        self._per_block = max_instances_per_block
        # block hash -> instance ids, most recent last; the map itself is the LRU order
        self._blocks: OrderedDict[bytes, tuple[str, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def hashes(self, text: str) -> list[bytes]:
        return prefix_hashes(text, self.block_chars, self.max_blocks)

    def blocks(self, info: RequestInfo) -> PromptBlocks:
        return PromptBlocks(self.hashes(info.prompt))

    def routed(self, blocks: PromptBlocks, instance_id: str) -> None:
        pass  # only a prefill that accepted the prompt counts here

    def record(self, blocks: PromptBlocks, instance_id: str) -> None:
        """`instance_id` just computed these blocks (it accepted and prefilled the prompt)."""
        self.record_hashes(blocks.chars, instance_id)

    def expected_cached_tokens(self, blocks: PromptBlocks, instance_id: str) -> int | None:
        return None

    def record_hashes(self, hashes: Iterable[bytes], instance_id: str) -> None:
        blocks = self._blocks
        for h in hashes:
            owners = blocks.get(h)
            if owners is None:
                blocks[h] = (instance_id,)
                continue
            blocks.move_to_end(h)
            if owners[-1] != instance_id:
                kept = tuple(i for i in owners if i != instance_id)
                blocks[h] = (*kept[max(0, len(kept) - self._per_block + 1) :], instance_id)
        while len(blocks) > self._max_entries:
            self._blocks.popitem(last=False)

    def match(self, blocks: PromptBlocks) -> dict[str, int]:
        """Instance id -> leading characters it is believed to hold (whole blocks). Pure
        lookup: a match does not refresh recency (only a real prefill does)."""
        return {i: depth * self.block_chars for i, depth in self.match_hashes(blocks.chars).items()}

    def match_hashes(self, hashes: list[bytes]) -> dict[str, int]:
        """Instance id -> number of leading blocks it is believed to hold."""
        matched: dict[str, int] = {}
        alive: set[str] | None = None
        for depth, h in enumerate(hashes, start=1):
            owners = self._blocks.get(h)
            if owners is None:
                break
            alive = set(owners) if alive is None else alive.intersection(owners)
            if not alive:
                break
            for instance_id in alive:
                matched[instance_id] = depth
        return matched

    def drop_instances(self, departed: Iterable[str]) -> None:
        """Forget instances that left the registry (their caches went with them)."""
        gone = set(departed)
        if not gone:
            return
        for h, owners in list(self._blocks.items()):
            if gone.isdisjoint(owners):
                continue
            kept = tuple(i for i in owners if i not in gone)
            if kept:
                self._blocks[h] = kept
            else:
                del self._blocks[h]

    def stats(self) -> Mapping[str, int]:
        return {"entries": len(self._blocks), "max_entries": self._max_entries}
