from __future__ import annotations

import hashlib
import os
import tracemalloc

import pytest

from pdgate.gateway.instances.affinity import ENTRY_BYTES, PrefixIndex, prefix_hashes
from pdgate.policies import load_policy
from pdgate.policies.base import InstanceLoad, RequestInfo

SYSTEM = "You are a helpful assistant for the travel desk. " * 8  # ~400 chars


def test_hashes_are_chained_and_skip_the_partial_block() -> None:
    a = prefix_hashes("x" * 130, 64, 100)
    assert len(a) == 2
    b = prefix_hashes("y" + "x" * 129, 64, 100)
    assert a[0] != b[0] and a[1] != b[1]  # a different first block changes every later hash
    assert prefix_hashes("x" * 1000, 64, 3) == prefix_hashes("x" * 5000, 64, 3)


def test_match_counts_leading_blocks_per_instance() -> None:
    idx = PrefixIndex(block_chars=64)
    idx.record_hashes(idx.hashes(SYSTEM + "question one"), "p1")
    idx.record_hashes(idx.hashes(SYSTEM[:200]), "p2")
    hits = idx.match_hashes(idx.hashes(SYSTEM + "another question"))
    assert hits["p1"] == len(SYSTEM) // 64
    assert hits["p2"] == 200 // 64
    assert idx.match_hashes(idx.hashes("unrelated " * 40)) == {}


def test_departed_instances_are_forgotten() -> None:
    idx = PrefixIndex(block_chars=64)
    idx.record_hashes(idx.hashes(SYSTEM), "p1")
    idx.record_hashes(idx.hashes(SYSTEM), "p2")
    idx.drop_instances({"p1"})
    assert set(idx.match_hashes(idx.hashes(SYSTEM))) == {"p2"}
    idx.drop_instances({"p2"})
    assert len(idx) == 0


def test_index_is_bounded_in_entries_and_owners() -> None:
    idx = PrefixIndex(block_chars=8, max_bytes=100 * ENTRY_BYTES, max_instances_per_block=2)
    for i in range(1000):
        idx.record_hashes(idx.hashes(f"prompt number {i:06d} padding"), f"p{i % 7}")
    assert len(idx) <= 100
    idx.record_hashes(idx.hashes("shared-prefix-xx"), "a")
    idx.record_hashes(idx.hashes("shared-prefix-xx"), "b")
    idx.record_hashes(idx.hashes("shared-prefix-xx"), "c")
    # The oldest owner was evicted.
    assert set(idx.match_hashes(idx.hashes("shared-prefix-xx"))) == {"b", "c"}


def test_lru_keeps_recently_prefilled_prefixes() -> None:
    idx = PrefixIndex(block_chars=8, max_bytes=4 * ENTRY_BYTES)
    idx.record_hashes(idx.hashes("hot-hot-"), "p1")
    for i in range(3):
        idx.record_hashes(idx.hashes(f"cold{i:04d}"), "p2")
    idx.record_hashes(idx.hashes("hot-hot-"), "p1")  # refreshed
    idx.record_hashes(idx.hashes("new-new-"), "p2")
    assert idx.match_hashes(idx.hashes("hot-hot-")) == {"p1": 1}
    assert idx.match_hashes(idx.hashes("cold0000")) == {}


def test_byte_bound_holds_for_real_memory() -> None:
    """The bound an operator sets is in bytes: measure what a full index really costs."""
    ids = [f"prefill-10.0.0.{i}-8100-a1b2c3" for i in range(4)]
    budget = 2 * 1024 * 1024
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        idx = PrefixIndex(block_chars=8, max_bytes=budget)
        for i in range(3 * budget // ENTRY_BYTES):  # three times what fits: LRU must evict
            block = hashlib.blake2b(os.urandom(8), digest_size=12).digest()
            idx.record_hashes([block], ids[i % 4])
            idx.record_hashes([block], ids[(i + 1) % 4])
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(idx) == budget // ENTRY_BYTES
    assert used <= budget * 1.1, f"{used} bytes for a {budget}-byte index"


AFFINITY = load_policy("affinity_sse")


def inst(i: str, streams: int, busy: bool = False) -> InstanceLoad:
    return InstanceLoad(
        id=i, url=i, group="g", capacity=8, open_streams=streams, inflight=0, busy=busy
    )


def req(hits: dict[str, int]) -> RequestInfo:
    return RequestInfo(
        model="m", group=None, prompt="p", prompt_chars=1, max_tokens=1, cached_chars=hits
    )


def test_affinity_beats_a_few_more_streams() -> None:
    ranked = load_policy("affinity_sse", {"prefix_affinity": {"load_guard": 4}}).rank(
        req({"warm": 5}), [inst("cold", 0), inst("warm", 3)]
    )
    assert [c.id for c in ranked] == ["warm", "cold"]


def test_load_guard_stops_affinity_from_piling_up() -> None:
    ranked = load_policy("affinity_sse", {"prefix_affinity": {"load_guard": 4}}).rank(
        req({"warm": 5}), [inst("cold", 0), inst("warm", 5)]
    )
    assert [c.id for c in ranked] == ["cold", "warm"]


def test_longer_match_wins_and_busy_is_not_tried() -> None:
    ranked = AFFINITY.rank(
        req({"a": 2, "b": 6, "c": 9}), [inst("a", 0), inst("b", 0), inst("c", 0, busy=True)]
    )
    assert [c.id for c in ranked] == ["b", "a"]


def test_without_hits_the_prefix_hash_picks_the_same_prefill_everywhere() -> None:
    cands = [inst("a", 3), inst("b", 1), inst("c", 2)]
    first = {load_policy("affinity_sse").rank(req({}), cands)[0].id for _ in range(3)}
    assert len(first) == 1  # a fresh policy object (another gateway) agrees
    ranked = AFFINITY.rank(req({}), cands)
    rest = [c for c in ranked[1:]]
    assert [c.open_streams for c in rest] == sorted(c.open_streams for c in rest)
    plain = load_policy(
        "affinity_sse", {"scorers": {"prefix_affinity": 1.0, "open_streams": 0.1}}
    ).rank(req({}), cands)
    assert [c.id for c in plain] == ["b", "c", "a"]  # without the hash: least open streams


def test_the_prefix_hash_is_guarded_against_piling_up() -> None:
    hashed = load_policy("least_sse", {"scorers": {"prefix_hash": 1.0}})
    cands = [inst("a", 0), inst("b", 0)]
    winner = hashed.rank(req({}), cands)[0].id
    loaded = [inst(c.id, 9 if c.id == winner else 0) for c in cands]
    assert hashed.rank(req({}), loaded)[0].id != winner


def test_bad_options_are_rejected() -> None:
    with pytest.raises(ValueError, match="load_guard"):
        load_policy("affinity_sse", {"prefix_affinity": {"load_guard": -1}})
