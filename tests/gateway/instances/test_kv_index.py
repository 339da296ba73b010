"""The KV-block index: fed by the engines' own events, it predicts exactly what each prefix
cache holds, evictions included; routing marks stand in until an engine's event arrives;
instances without events keep the character history; everything is bounded."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from pdgate.config import sim_tokenizer
from pdgate.config.kv_events import BlockRemoved, BlockStored
from pdgate.engine_shim.prefix_cache import PrefixCache
from pdgate.gateway.instances.affinity import PrefixIndex
from pdgate.gateway.instances.kv_index import KvBlockIndex
from pdgate.gateway.instances.prompt_tokens import PromptTokenizers, SimTokenizer
from pdgate.policies.base import RequestInfo

MODEL = "m"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _index(clock: Clock | None = None, **kw: object) -> KvBlockIndex:
    tokenizers = PromptTokenizers({MODEL: "sim"})
    return KvBlockIndex(tokenizers, PrefixIndex(block_chars=64), clock=clock or Clock(), **kw)  # type: ignore[arg-type]


def _info(prompt: str) -> RequestInfo:
    return RequestInfo(MODEL, None, prompt, len(prompt), 1)


def _feed(index: KvBlockIndex, instance_id: str, cache: PrefixCache) -> None:
    for event in cache.take_events():
        if isinstance(event, BlockStored):
            index.stored(instance_id, event)
        elif isinstance(event, BlockRemoved):
            index.removed(instance_id, event)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(
        rng.choice(("alpha", "beta", "gamma", "delta", "kv", "cache", "x1")) for _ in range(n)
    )


def test_predictions_equal_what_each_sim_cache_reports_through_evictions() -> None:
    """Three sim prefix caches too small for the traffic (so they evict all the time), fed
    shared-prefix prompts at random: before each prompt is computed, the index's prediction
    for its instance equals the cached tokens the cache then reports, every time."""
    rng = random.Random(7)
    index = _index()
    caches = {f"p{i}": PrefixCache(48, events=True) for i in range(3)}
    for instance_id in caches:
        index.publishing(instance_id, MODEL)
    prefixes = [_words(rng, rng.randint(20, 300)) for _ in range(12)]
    hits = 0
    for _ in range(600):
        prompt = rng.choice(prefixes) + " " + _words(rng, rng.randint(1, 80))
        instance_id = rng.choice(list(caches))
        blocks = index.blocks(_info(prompt))
        predicted = index.expected_cached_tokens(blocks, instance_id)
        reported = caches[instance_id].lookup_and_insert(sim_tokenizer.encode(prompt))
        assert predicted == reported
        hits += reported > 0
        _feed(index, instance_id, caches[instance_id])
    assert hits > 100  # the workload really shares prefixes
    assert index.counts.removed > 1000  # and the caches really evict


def test_match_is_in_prompt_characters_up_to_the_last_whole_block() -> None:
    index = _index()
    index.publishing("p0", MODEL)
    prompt = "The quick brown fox jumps over the lazy dog. " * 10
    tokens, ends = SimTokenizer().encode(prompt)
    cache = PrefixCache(1000, events=True)
    cache.lookup_and_insert(tokens)
    _feed(index, "p0", cache)
    held = index.match(index.blocks(_info(prompt + " and more")))
    whole = (len(tokens) // 16) * 16
    assert held == {"p0": ends[whole - 1]}
    assert index.match(index.blocks(_info("Another prompt entirely. " * 10))) == {}


def test_an_eviction_stops_the_match_at_once_and_a_clear_drops_everything() -> None:
    index = _index()
    index.publishing("p0", MODEL)
    prompt = "shared system prompt words " * 20
    cache = PrefixCache(1000, events=True)
    cache.lookup_and_insert(sim_tokenizer.encode(prompt))
    events = cache.take_events()
    (stored,) = events
    assert isinstance(stored, BlockStored)
    index.stored("p0", stored)
    blocks = index.blocks(_info(prompt))
    assert index.cached_tokens(blocks)["p0"] > 0
    # The third block goes: the match stops before it.
    index.removed("p0", BlockRemoved([stored.block_hashes[2]]))
    assert index.cached_tokens(index.blocks(_info(prompt))) == {"p0": 32}
    index.cleared("p0")
    assert index.cached_tokens(index.blocks(_info(prompt))) == {}
    assert index.stats()["entries"] == 0


def test_a_block_whose_parent_was_never_seen_is_not_indexed() -> None:
    index = _index()
    index.publishing("p0", MODEL)
    index.stored("p0", BlockStored([5], 4, list(range(16)), 16))
    assert index.counts.orphaned == 1 and index.stats()["entries"] == 0


def test_other_tiers_and_salted_blocks_are_ignored() -> None:
    index = _index()
    index.publishing("p0", MODEL)
    index.stored("p0", BlockStored([1], None, list(range(16)), 16, medium="CPU"))
    index.stored("p0", BlockStored([2], None, list(range(16)), 16, extra_keys=[("salt",)]))
    assert index.counts.ignored == 2 and index.stats()["entries"] == 0


def test_routing_marks_hold_until_the_event_or_until_they_lapse() -> None:
    clock = Clock()
    index = _index(clock, pending_s=5.0)
    index.publishing("p0", MODEL)
    index.publishing("p1", MODEL)
    warm = PrefixCache(100, events=True)
    warm.lookup_and_insert(sim_tokenizer.encode("warm up " * 30))
    _feed(index, "p1", warm)  # p1's block size is now known; p0's is not yet
    prompt = "a brand new prefix nobody has computed " * 8
    blocks = index.blocks(_info(prompt))
    index.routed(blocks, "p1")
    index.routed(blocks, "p0")  # no block size known for p0: nothing to mark
    assert set(index.cached_tokens(index.blocks(_info(prompt)))) == {"p1"}
    clock.now += 6.0
    assert index.cached_tokens(index.blocks(_info(prompt))) == {}
    # Confirmed by the engine: no lapse any more.
    index.routed(blocks, "p1")
    cache = PrefixCache(100, events=True)
    cache.lookup_and_insert(sim_tokenizer.encode(prompt))
    _feed(index, "p1", cache)
    clock.now += 60.0
    assert set(index.cached_tokens(index.blocks(_info(prompt)))) == {"p1"}


def test_instances_without_events_keep_the_character_history() -> None:
    index = _index()
    index.publishing("events", MODEL)
    prompt = "x" * 300
    blocks = index.blocks(_info(prompt))
    index.record(blocks, "plain")  # no events: the character index learns it
    index.record(blocks, "events")  # events: its own events will say
    assert index.match(index.blocks(_info(prompt + "y"))) == {"plain": 256}
    index.drop_instances({"plain"})
    assert index.match(index.blocks(_info(prompt))) == {}


def test_token_id_prompts_match_without_a_tokenizer() -> None:
    index = KvBlockIndex(PromptTokenizers(), PrefixIndex())  # no tokenizer for the model
    index.publishing("p0", MODEL)
    ids = tuple(range(100, 140))
    cache = PrefixCache(100, events=True)
    cache.lookup_and_insert(ids)
    _feed(index, "p0", cache)
    prompt = " ".join(map(str, ids))
    info = RequestInfo(MODEL, None, prompt, len(prompt), 1, prompt_ids=ids)
    held = index.match(index.blocks(info))
    assert held == {"p0": len(" ".join(map(str, ids[:32])))}
    # A text prompt of a model with no tokenizer falls back to characters: nothing here.
    assert index.match(index.blocks(_info("hello " * 40))) == {}


def test_the_index_is_bounded_in_blocks_and_holders() -> None:
    index = _index(max_blocks=500, max_instances_per_block=2)
    shared = sim_tokenizer.encode("one prefix every instance holds " * 4)[:32]
    for i in range(6):
        index.publishing(f"p{i}", MODEL)
        cache = PrefixCache(10_000, events=True)
        cache.lookup_and_insert(shared)
        rng = random.Random(i)
        for _ in range(100):
            cache.lookup_and_insert([rng.randrange(1000) for _ in range(64)])
        _feed(index, f"p{i}", cache)
    assert index.stats()["entries"] <= 500
    info = RequestInfo(MODEL, None, "", 0, 1, prompt_ids=(*shared, 1))
    holders = index.cached_tokens(index.blocks(info))
    assert len(holders) <= 2


@pytest.mark.parametrize("instances", [64])
def test_memory_per_block_at_scale(instances: int) -> None:
    """100k distinct blocks over `instances` publishing prefills (each block held by two):
    what docs/kv-events.md quotes per block, kept under a bound here."""
    index = _index(max_blocks=200_000)
    for i in range(instances):
        index.publishing(f"prefill-{i:02d}", MODEL)
    rng = random.Random(1)
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for n in range(100_000 // 8):
        tokens = [rng.randrange(128_000) for _ in range(8 * 16)]
        hashes = [rng.getrandbits(63) for _ in range(8)]
        for holder in (n % instances, (n + 1) % instances):
            index.stored(f"prefill-{holder:02d}", BlockStored(hashes, None, tokens, 16))
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    assert index.stats()["entries"] == 100_000
    per_block = grown / 100_000
    print(f"{per_block:.0f} bytes per block")
    assert per_block < 700, per_block
