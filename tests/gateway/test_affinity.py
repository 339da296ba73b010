from __future__ import annotations

import pytest

from gateway.affinity import PrefixIndex, prefix_hashes
from policies.affinity_sse import AffinitySSE
from policies.base import InstanceLoad, RequestInfo

SYSTEM = "You are a helpful assistant for the travel desk. " * 8  # ~400 chars


def test_hashes_are_chained_and_skip_the_partial_block() -> None:
    a = prefix_hashes("x" * 130, 64, 100)
    assert len(a) == 2
    b = prefix_hashes("y" + "x" * 129, 64, 100)
    assert a[0] != b[0] and a[1] != b[1]  # a different first block changes every later hash
    assert prefix_hashes("x" * 1000, 64, 3) == prefix_hashes("x" * 5000, 64, 3)


def test_match_counts_leading_blocks_per_instance() -> None:
    idx = PrefixIndex(block_chars=64)
    idx.record(idx.hashes(SYSTEM + "question one"), "p1")
    idx.record(idx.hashes(SYSTEM[:200]), "p2")
    hits = idx.match(idx.hashes(SYSTEM + "another question"))
    assert hits["p1"] == len(SYSTEM) // 64
    assert hits["p2"] == 200 // 64
    assert idx.match(idx.hashes("unrelated " * 40)) == {}


def test_departed_instances_are_forgotten() -> None:
    idx = PrefixIndex(block_chars=64)
    idx.record(idx.hashes(SYSTEM), "p1")
    idx.record(idx.hashes(SYSTEM), "p2")
    idx.drop_instances({"p1"})
    assert set(idx.match(idx.hashes(SYSTEM))) == {"p2"}
    idx.drop_instances({"p2"})
    assert len(idx) == 0


def test_index_is_bounded_in_entries_and_owners() -> None:
    idx = PrefixIndex(block_chars=8, max_entries=100, max_instances_per_block=2)
    for i in range(1000):
        idx.record(idx.hashes(f"prompt number {i:06d} padding"), f"p{i % 7}")
    assert len(idx) <= 100
    idx.record(idx.hashes("shared-prefix-xx"), "a")
    idx.record(idx.hashes("shared-prefix-xx"), "b")
    idx.record(idx.hashes("shared-prefix-xx"), "c")
    assert set(idx.match(idx.hashes("shared-prefix-xx"))) == {"b", "c"}  # oldest owner evicted


def test_lru_keeps_recently_prefilled_prefixes() -> None:
    idx = PrefixIndex(block_chars=8, max_entries=4)
    idx.record(idx.hashes("hot-hot-"), "p1")
    for i in range(3):
        idx.record(idx.hashes(f"cold{i:04d}"), "p2")
    idx.record(idx.hashes("hot-hot-"), "p1")  # refreshed
    idx.record(idx.hashes("new-new-"), "p2")
    assert idx.match(idx.hashes("hot-hot-")) == {"p1": 1}
    assert idx.match(idx.hashes("cold0000")) == {}


def inst(i: str, streams: int, busy: bool = False) -> InstanceLoad:
    return InstanceLoad(
        id=i, url=i, group="g", capacity=8, open_streams=streams, inflight=0, busy=busy
    )


def req(hits: dict[str, int]) -> RequestInfo:
    return RequestInfo(
        model="m", group=None, prompt="p", prompt_chars=1, max_tokens=1, prefix_blocks=hits
    )


def test_affinity_beats_a_few_more_streams() -> None:
    ranked = AffinitySSE(load_guard=4).rank(req({"warm": 5}), [inst("cold", 0), inst("warm", 3)])
    assert [c.id for c in ranked] == ["warm", "cold"]


def test_load_guard_stops_affinity_from_piling_up() -> None:
    ranked = AffinitySSE(load_guard=4).rank(req({"warm": 5}), [inst("cold", 0), inst("warm", 5)])
    assert [c.id for c in ranked] == ["cold", "warm"]


def test_longer_match_wins_and_busy_goes_last() -> None:
    policy = AffinitySSE()
    ranked = policy.rank(
        req({"a": 2, "b": 6, "c": 9}), [inst("a", 0), inst("b", 0), inst("c", 0, busy=True)]
    )
    assert [c.id for c in ranked] == ["b", "a", "c"]


def test_without_hits_it_is_least_sse() -> None:
    ranked = AffinitySSE().rank(req({}), [inst("a", 3), inst("b", 1), inst("c", 2)])
    assert [c.id for c in ranked] == ["b", "c", "a"]


def test_bad_options_are_rejected() -> None:
    with pytest.raises(ValueError, match="load_guard"):
        AffinitySSE(load_guard=-1)
