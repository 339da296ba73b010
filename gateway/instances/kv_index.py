"""The fleet's KV-block index: which prefill holds which blocks of a model's prompts, as the
engines themselves report it.

Each engine publishes what its prefix cache stores and evicts (vLLM's KV events, which the
sim engine publishes too; gateway/instances/kv_events.py reads them). Every gateway
subscribes to every engine, so each holds the same index without any traffic between
gateways; docs/kv-events.md has the measurement behind that choice.

Keys are the gateway's own, not the engine's: an engine's block hash depends on its hash
function and seed (vLLM draws a random seed unless ``PYTHONHASHSEED`` is set), but every
`BlockStored` event carries the block's token ids, so the index chains its own 64-bit hash
over them, ``key_i = H(key_{i-1}, tokens of block i)``, seeded by the model and block size.
The keys stay in the process that made them, so H is Python's own hash of the tuple.
A request's prompt, tokenized here with the model's tokenizer, yields the same keys, and
the longest run of leading keys an instance holds is the prefix its cache would give it.
Per instance the index keeps the engine hash -> key map that removals and the next store's
parent need.

Until an engine's event arrives (a prefill stores blocks as it computes them), the gateway's
own routing stands in: `record` marks the prompt's blocks as held by the prefill it was sent
to, for `pending_s`; the engine's event confirms it, or the mark lapses. An eviction
(`BlockRemoved`) takes the instance off the block at once.

Instances that publish no events are judged by the character-block history
(`PrefixIndex`), which this index keeps for them.

Bounded: at most `max_blocks` keys (least recently stored first out), at most
`max_instances_per_block` holders per key, and each instance's hash map at most
`max_blocks` entries.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from hashlib import blake2b

from pdgate.config.kv_events import MEDIUM_ENGINE, BlockRemoved, BlockStored, EngineHash
from pdgate.gateway.instances.affinity import PrefixIndex, PromptBlocks
from pdgate.gateway.instances.prompt_tokens import PromptTokenizers
from pdgate.policies.base import RequestInfo

__all__ = ["KvBlockIndex", "KvEventCounts", "chain_keys"]


def _seed(model: str, block_size: int) -> int:
    digest = blake2b(f"{model}\0{block_size}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _next_key(parent: int, tokens: Sequence[int]) -> int:
    # Keys never leave this process (each gateway keys events and prompts alike itself), so
    # Python's hash of a tuple of ints serves: deterministic, 64-bit, and much cheaper than a
    # cryptographic digest per block (docs/results/kv-events/).
    return hash((parent, *tokens))


def chain_keys(model: str, block_size: int, tokens: Sequence[int]) -> list[int]:
    """The index's keys of the full blocks of `tokens` (what `BlockStored` events yield)."""
    keys: list[int] = []
    key = _seed(model, block_size)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        key = _next_key(key, tokens[start : start + block_size])
        keys.append(key)
    return keys


@dataclass(slots=True)
class KvEventCounts:
    """What the index did with the events (for metrics and /admin)."""

    stored: int = 0  # blocks added by BlockStored
    removed: int = 0  # blocks taken off by BlockRemoved
    cleared: int = 0  # AllBlocksCleared (and gaps in an engine's sequence)
    orphaned: int = 0  # stored blocks whose parent this gateway never saw: not indexed
    ignored: int = 0  # blocks of another tier, or keyed by more than tokens (LoRA, salt)


class _Engine:
    """What the index knows of one publishing instance."""

    __slots__ = ("block_size", "hashes", "model")

    def __init__(self, model: str) -> None:
        self.model = model
        self.block_size = 0  # learned from its first BlockStored
        # engine hash -> key, oldest stored first (a plain dict: one per block per holder)
        self.hashes: dict[EngineHash, int] = {}


class KvBlockIndex:
    """`PrefixLookup` fed by the engines' KV events (see the module docstring)."""

    def __init__(
        self,
        tokenizers: PromptTokenizers,
        fallback: PrefixIndex,
        *,
        max_blocks: int = 200_000,
        max_instances_per_block: int = 8,
        pending_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_blocks <= 0 or max_instances_per_block <= 0 or pending_s < 0:
            raise ValueError("KV index bounds must be positive")
        self._tokenizers = tokenizers
        self._fallback = fallback
        self._max_blocks = max_blocks
        self._per_block = max_instances_per_block
        self._pending_s = pending_s
        self._clock = clock
        # key -> the instances whose engines reported it, oldest first (a tuple: ~100k of
        # these, and a tuple is a quarter of a dict's size)
        self._blocks: OrderedDict[int, tuple[str, ...]] = OrderedDict()
        # key -> instance id -> when its routing mark lapses (until its engine's event)
        self._pending: dict[int, dict[str, float]] = {}
        self._engines: dict[str, _Engine] = {}
        # model -> block size -> its publishing instances (rebuilt when one changes)
        self._by_size: dict[str, dict[int, list[str]]] | None = None
        self.counts = KvEventCounts()

    # -- PrefixLookup ------------------------------------------------------------------------

    def blocks(self, info: RequestInfo) -> PromptBlocks:
        chars = self._fallback.hashes(info.prompt)
        if info.prompt_ids is not None:
            ids = info.prompt_ids
            ends: list[int] = []
            end = -1
            for t in ids:
                end += len(str(t)) + 1
                ends.append(end)
            return PromptBlocks(chars, info.model, ids, ends)
        encoded = self._tokenizers.encode(info.model, info.prompt)
        if encoded is None:
            return PromptBlocks(chars, info.model)
        return PromptBlocks(chars, info.model, encoded[0], encoded[1])

    def routed(self, blocks: PromptBlocks, instance_id: str) -> None:
        """Marks the prompt's blocks held by `instance_id` until its engine's events confirm
        it or `pending_s` passes: a request for the same prefix that comes meanwhile (through
        this gateway) goes there too."""
        engine = self._engines.get(instance_id)
        if engine is None or not engine.block_size or not blocks.tokens:
            return  # nothing to key by yet: its first event will say
        lapses = self._clock() + self._pending_s
        pending = self._pending
        for key in self._keys(blocks, engine.model, engine.block_size):
            if instance_id in self._blocks.get(key, ()):
                continue
            marks = pending.pop(key, None) or {}
            marks[instance_id] = lapses
            while len(marks) > self._per_block:
                del marks[min(marks, key=marks.__getitem__)]
            pending[key] = marks  # re-inserted: the dict's order is the marks' age
        while len(pending) > self._max_blocks:
            del pending[next(iter(pending))]

    def record(self, blocks: PromptBlocks, instance_id: str) -> None:
        # A publishing instance's events say what it stored (its routing mark was set when
        # the prompt was sent); the others are judged by this history.
        if instance_id not in self._engines:
            self._fallback.record(blocks, instance_id)

    def expected_cached_tokens(self, blocks: PromptBlocks, instance_id: str) -> int | None:
        if instance_id not in self._engines or not blocks.tokens:
            return None
        return self.cached_tokens(blocks).get(instance_id, 0)

    def match(self, blocks: PromptBlocks) -> dict[str, int]:
        held: dict[str, int] = {}
        # Instances without events: the character history, for them only.
        for instance_id, chars in self._fallback.match(blocks).items():
            if instance_id not in self._engines:
                held[instance_id] = chars
        if not blocks.tokens or not self._engines:
            return held
        for instance_id, tokens in self.cached_tokens(blocks).items():
            held[instance_id] = blocks.token_ends[tokens - 1] if tokens else 0
        return held

    def drop_instances(self, departed: Iterable[str]) -> None:
        gone = set(departed)
        self._fallback.drop_instances(gone)
        for instance_id in gone:
            self.forget(instance_id)

    def stats(self) -> Mapping[str, int]:
        return {
            "entries": len(self._blocks),
            "max_entries": self._max_blocks,
            "pending_entries": len(self._pending),
            "publishing_instances": len(self._engines),
            "fallback_entries": len(self._fallback),
        }

    # -- what a request would find ------------------------------------------------------------

    def cached_tokens(self, blocks: PromptBlocks) -> dict[str, int]:
        """Publishing instance -> prompt tokens its cache would give this prompt: its
        longest run of held leading blocks, short of the last token, which an engine always
        computes (it needs that position's logits)."""
        out: dict[str, int] = {}
        sizes = self._sizes(blocks.model)
        usable = len(blocks.tokens) - 1
        now = self._clock()
        for size, instances in sizes.items():
            keys = self._keys(blocks, blocks.model, size)
            alive = set(instances)
            for depth, key in enumerate(keys[: max(0, usable) // size], start=1):
                reported = self._blocks.get(key)
                marks = self._pending.get(key)
                if reported is None and marks is None:
                    break
                here = set(reported or ())
                if marks is not None:
                    here.update(i for i, lapses in marks.items() if lapses > now)
                alive &= here
                if not alive:
                    break
                for instance_id in alive:
                    out[instance_id] = depth * size
        return out

    # -- events ---------------------------------------------------------------------------

    def publishing(self, instance_id: str, model: str) -> None:
        """`instance_id` (serving `model`) publishes events from now on: it leaves the
        character history, and what the index knew of it is cleared."""
        self.forget(instance_id)
        self._fallback.drop_instances({instance_id})
        self._engines[instance_id] = _Engine(model)
        self._by_size = None

    def stored(self, instance_id: str, event: BlockStored) -> None:
        engine = self._engines.get(instance_id)
        size = event.block_size
        if engine is None:
            return
        if (
            event.medium not in (None, MEDIUM_ENGINE)
            or not event.tokens_only
            or len(event.token_ids) < size * len(event.block_hashes)
        ):
            self.counts.ignored += len(event.block_hashes)
            return
        if engine.block_size != size:
            if engine.block_size:
                self._clear(instance_id, engine)  # the engine restarted with another size
            engine.block_size = size
            self._by_size = None
        if event.parent_block_hash is None:
            key = _seed(engine.model, size)
        else:
            parent = engine.hashes.get(event.parent_block_hash)
            if parent is None:
                self.counts.orphaned += len(event.block_hashes)
                return
            key = parent
        tokens = event.token_ids
        for i, engine_hash in enumerate(event.block_hashes):
            key = _next_key(key, tokens[i * size : (i + 1) * size])
            engine.hashes.pop(engine_hash, None)
            engine.hashes[engine_hash] = key
            holders = self._blocks.get(key)
            if holders is None:
                self._blocks[key] = (instance_id,)
            else:
                self._blocks.move_to_end(key)
                if instance_id not in holders:
                    self._blocks[key] = (*holders[-self._per_block + 1 :], instance_id)
            marks = self._pending.get(key)
            if marks is not None and marks.pop(instance_id, None) is not None and not marks:
                del self._pending[key]
        self.counts.stored += len(event.block_hashes)
        while len(engine.hashes) > self._max_blocks:
            del engine.hashes[next(iter(engine.hashes))]
        self._bound_blocks()

    def removed(self, instance_id: str, event: BlockRemoved) -> None:
        engine = self._engines.get(instance_id)
        if engine is None or event.medium not in (None, MEDIUM_ENGINE):
            return
        for engine_hash in event.block_hashes:
            key = engine.hashes.pop(engine_hash, None)
            if key is None:
                continue
            holders = self._blocks.get(key)
            if holders is not None and instance_id in holders:
                self.counts.removed += 1
                kept = tuple(i for i in holders if i != instance_id)
                if kept:
                    self._blocks[key] = kept
                else:
                    del self._blocks[key]

    def cleared(self, instance_id: str) -> None:
        """The engine dropped its whole cache (or this gateway missed some of its events,
        so nothing it reported can be trusted)."""
        engine = self._engines.get(instance_id)
        if engine is not None:
            self._clear(instance_id, engine)
            self.counts.cleared += 1

    def forget(self, instance_id: str) -> None:
        """`instance_id` stopped publishing (it left, or its stream went away)."""
        engine = self._engines.pop(instance_id, None)
        if engine is not None:
            self._by_size = None
            self._clear(instance_id, engine)

    # -- internals ------------------------------------------------------------------------

    def _sizes(self, model: str) -> dict[int, list[str]]:
        if self._by_size is None:
            by_size: dict[str, dict[int, list[str]]] = {}
            for instance_id, engine in self._engines.items():
                if engine.block_size:
                    group = by_size.setdefault(engine.model, {})
                    group.setdefault(engine.block_size, []).append(instance_id)
            self._by_size = by_size
        return self._by_size.get(model, {})

    def _keys(self, blocks: PromptBlocks, model: str, size: int) -> list[int]:
        keys = blocks.chains.get(size)
        if keys is None:
            keys = blocks.chains[size] = chain_keys(model, size, blocks.tokens)
        return keys

    def _clear(self, instance_id: str, engine: _Engine) -> None:
        for key in set(engine.hashes.values()):
            holders = self._blocks.get(key)
            if holders is not None and instance_id in holders:
                kept = tuple(i for i in holders if i != instance_id)
                if kept:
                    self._blocks[key] = kept
                else:
                    del self._blocks[key]
        engine.hashes.clear()
        for key, marks in list(self._pending.items()):
            if marks.pop(instance_id, None) is not None and not marks:
                del self._pending[key]

    def _bound_blocks(self) -> None:
        while len(self._blocks) > self._max_blocks:
            self._blocks.popitem(last=False)
