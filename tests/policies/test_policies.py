from __future__ import annotations

import random
from collections import Counter

import pytest

from policies import (
    DECODE_POLICIES,
    PREFILL_POLICIES,
    ExponentialBackoff,
    InstanceLoad,
    RequestInfo,
    load_decode_policy,
    load_prefill_policy,
)
from policies.least_loaded import LeastLoaded
from policies.least_sse import LeastSSE
from policies.power_of_two import PowerOfTwo
from policies.round_robin import RoundRobin

REQ = RequestInfo(model="m", group=None, prompt="hello", prompt_chars=5, max_tokens=8)


def inst(
    i: str, streams: int = 0, inflight: int = 0, busy: bool = False, capacity: int = 4
) -> InstanceLoad:
    return InstanceLoad(
        id=i,
        url=f"http://{i}",
        group="default",
        capacity=capacity,
        open_streams=streams,
        inflight=inflight,
        busy=busy,
    )


def ids(ranked: list[InstanceLoad]) -> list[str]:
    return [c.id for c in ranked]


def test_least_sse_orders_by_open_streams_then_inflight() -> None:
    cands = [inst("a", 3), inst("b", 1, 2), inst("c", 1, 0), inst("d", 0)]
    assert ids(LeastSSE().rank(REQ, cands)) == ["d", "c", "b", "a"]


def test_least_sse_puts_recently_rejected_last_even_if_idle() -> None:
    cands = [inst("idle-but-busy", 0, busy=True), inst("loaded", 5)]
    assert ids(LeastSSE().rank(REQ, cands)) == ["loaded", "idle-but-busy"]


@pytest.mark.parametrize("name", sorted(PREFILL_POLICIES))
def test_every_prefill_policy_returns_a_permutation(name: str) -> None:
    policy = load_prefill_policy(name)
    cands = [inst(str(i), i % 3, i % 2, busy=i == 4) for i in range(7)]
    for _ in range(20):
        ranked = policy.rank(REQ, cands)
        assert sorted(ids(ranked)) == sorted(ids(cands))
    assert policy.rank(REQ, []) == []


@pytest.mark.parametrize("name", sorted(DECODE_POLICIES))
def test_every_decode_policy_returns_a_permutation(name: str) -> None:
    policy = load_decode_policy(name)
    cands = [inst(str(i), i) for i in range(5)]
    assert sorted(ids(policy.rank(REQ, cands))) == sorted(ids(cands))


def test_round_robin_rotates_the_first_choice() -> None:
    rr = RoundRobin()
    cands = [inst("a"), inst("b"), inst("c")]
    firsts = [rr.rank(REQ, cands)[0].id for _ in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]


def test_round_robin_tries_busy_instances_last() -> None:
    rr = RoundRobin()
    cands = [inst("a", busy=True), inst("b"), inst("c")]
    for _ in range(6):
        assert rr.rank(REQ, cands)[-1].id == "a"


def test_power_of_two_prefers_the_less_loaded_of_its_sample() -> None:
    p2 = PowerOfTwo(random.Random(7))
    cands = [inst("a", 4), inst("b", 0), inst("c", 2), inst("d", 1)]
    firsts = Counter(p2.rank(REQ, cands)[0].id for _ in range(400))
    # "a" is the most loaded: it can only come first if sampled with... nothing lighter, never.
    assert firsts["a"] == 0
    assert firsts["b"] > firsts["c"] > 0


def test_least_loaded_decode_prefers_free_room() -> None:
    cands = [inst("small", 1, capacity=2), inst("big", 3, capacity=16)]
    assert ids(LeastLoaded().rank(REQ, cands)) == ["big", "small"]


def test_unknown_policy_names_are_rejected_with_the_choices() -> None:
    with pytest.raises(ValueError, match="least_sse"):
        load_prefill_policy("fastest")
    with pytest.raises(ValueError, match="cannot load"):
        load_prefill_policy("nosuchmodule:Policy")


def test_policies_load_from_a_dotted_path() -> None:
    policy = load_prefill_policy("policies.least_sse:LeastSSE")
    assert policy.name == "least_sse"


def test_exponential_backoff_grows_caps_and_jitters() -> None:
    b = ExponentialBackoff(0.01, 0.08, jitter=0.0)
    assert [b.delay(i) for i in range(6)] == [0.01, 0.02, 0.04, 0.08, 0.08, 0.08]
    j = ExponentialBackoff(0.01, 1.0, jitter=0.5, rng=random.Random(1))
    delays = [j.delay(3) for _ in range(50)]
    assert all(0.04 <= d <= 0.08 for d in delays)
    assert len(set(delays)) > 1
    with pytest.raises(ValueError, match="initial"):
        ExponentialBackoff(0.0, 1.0)
