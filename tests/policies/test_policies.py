"""Policies: filters, weighted scorers, pickers, profiles and loading by name."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

import pytest

from pdgate.policies import FILTERS, PROFILES, load_policy
from pdgate.policies.base import InstanceLoad, Policy, RequestInfo
from pdgate.policies.filters import HasRoom, NotBusy, NotEjected
from pdgate.policies.pickers import MaxScore
from pdgate.policies.scorers import OpenStreams, lower_is_better

REQ = RequestInfo(model="m", group=None, prompt="hello", prompt_chars=5, max_tokens=8)


def inst(
    i: str,
    streams: int = 0,
    inflight: int = 0,
    busy: bool = False,
    capacity: int = 4,
    ejected: bool = False,
    tokens: int = 0,
) -> InstanceLoad:
    return InstanceLoad(
        id=i,
        url=f"http://{i}",
        group="default",
        capacity=capacity,
        open_streams=streams,
        inflight=inflight,
        busy=busy,
        ejected=ejected,
        inflight_tokens=tokens,
    )


def ids(ranked: list[InstanceLoad]) -> list[str]:
    return [c.id for c in ranked]


def test_least_sse_orders_by_open_streams_then_inflight() -> None:
    cands = [inst("a", 3), inst("b", 1, 2), inst("c", 1, 0), inst("d", 0)]
    assert ids(load_policy("least_sse").rank(REQ, cands)) == ["d", "c", "b", "a"]


def test_filters_drop_busy_full_and_ejected_for_every_profile() -> None:
    cands = [
        inst("busy", busy=True),
        inst("full", inflight=4),
        inst("ejected", ejected=True),
        inst("ok", streams=9),
    ]
    for name in PROFILES:
        assert ids(load_policy(name).rank(REQ, cands)) == ["ok"], name


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_profile_ranks_a_permutation_of_the_eligible(name: str) -> None:
    policy = load_policy(name)
    cands = [inst(str(i), i % 3, i % 2) for i in range(7)]
    for _ in range(20):
        assert sorted(ids(policy.rank(REQ, cands))) == sorted(ids(cands))
    assert policy.rank(REQ, []) == []


def test_round_robin_rotates_the_first_choice() -> None:
    rr = load_policy("round_robin")
    cands = [inst("a"), inst("b"), inst("c")]
    firsts = [rr.rank(REQ, cands)[0].id for _ in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]


def test_power_of_two_prefers_the_better_of_its_sample() -> None:
    p2 = load_policy("power_of_two", {"power_of_two": {"seed": 7}})
    cands = [inst("a", 4), inst("b", 0), inst("c", 2), inst("d", 1)]
    firsts = Counter(p2.rank(REQ, cands)[0].id for _ in range(400))
    # "a" is the most loaded: it can only come first if sampled with nothing lighter: never.
    assert firsts["a"] == 0
    assert firsts["b"] > firsts["c"] > 0


def test_least_loaded_decode_prefers_free_room() -> None:
    cands = [inst("small", 1, capacity=2), inst("big", 3, capacity=16)]
    assert ids(load_policy("least_loaded").rank(REQ, cands)) == ["big", "small"]


def test_weights_combine_scorers() -> None:
    # "a" has fewer streams, "b" less token work; the weights decide.
    cands = [inst("a", streams=1, tokens=900), inst("b", streams=3, tokens=100)]
    by_streams = load_policy(
        "least_sse", {"scorers": {"open_streams": 1.0, "inflight_tokens": 0.5}}
    )
    by_tokens = load_policy("least_sse", {"scorers": {"open_streams": 0.5, "inflight_tokens": 1.0}})
    assert ids(by_streams.rank(REQ, cands))[0] == "a"
    assert ids(by_tokens.rank(REQ, cands))[0] == "b"


def test_lower_is_better_normalises_to_unit_range() -> None:
    assert lower_is_better([0, 5, 10]) == [1.0, 0.5, 0.0]
    assert lower_is_better([3, 3]) == [1.0, 1.0]
    assert lower_is_better([]) == []


def test_composition_by_hand() -> None:
    policy = Policy(
        "custom", [NotEjected(), NotBusy(), HasRoom()], [(OpenStreams(), 1.0)], MaxScore()
    )
    assert ids(policy.rank(REQ, [inst("x", 2), inst("y", 1)])) == ["y", "x"]
    assert policy.describe()["scorers"] == {"open_streams": 1.0}


class _Recording:
    """A scorer and a picker that note how many candidates they were given."""

    name = "recording"
    needs = frozenset[str]()

    def __init__(self) -> None:
        self.seen: list[int] = []

    def score(self, request: RequestInfo, candidates: Sequence[InstanceLoad]) -> list[float]:
        self.seen.append(len(candidates))
        return [0.0] * len(candidates)

    def order(
        self, request: RequestInfo, candidates: Sequence[InstanceLoad], scores: Sequence[float]
    ) -> list[InstanceLoad]:
        self.seen.append(len(candidates))
        return list(candidates)


def test_scorers_and_picker_see_two_candidates_or_more() -> None:
    # The picker's contract (policies/base.py): a lone candidate is tried without scoring.
    scorer, picker = _Recording(), _Recording()
    policy = Policy("custom", [NotBusy()], [(scorer, 1.0)], picker)
    assert ids(policy.rank(REQ, [inst("x"), inst("y", busy=True)])) == ["x"]
    assert ids(policy.rank(REQ, [inst("y", busy=True)])) == []
    assert scorer.seen == picker.seen == []
    assert ids(policy.rank(REQ, [inst("x"), inst("y")])) == ["x", "y"]
    assert scorer.seen == picker.seen == [2]


def test_a_zero_weight_turns_a_scorer_off() -> None:
    scorer = _Recording()
    policy = Policy("custom", [], [(scorer, 0.0), (OpenStreams(), 1.0)], MaxScore())
    assert ids(policy.rank(REQ, [inst("x", 2), inst("y", 1)])) == ["y", "x"]
    assert scorer.seen == []


def test_max_score_orders_by_score_then_id_at_any_size() -> None:
    rng = random.Random(7)
    for n in (2, 3, 9, 64):
        cands = [inst(f"i{rng.randrange(10**6):06d}-{k}") for k in range(n)]
        scores = [rng.choice([0.0, 0.25, 0.5, 1.0]) for _ in range(n)]
        pairs = sorted(zip(scores, cands, strict=True), key=lambda x: (-x[0], x[1].id))
        expected = [c.id for _, c in pairs]
        assert ids(MaxScore().order(REQ, cands, scores)) == expected


def test_the_affinity_index_is_needed_only_by_affinity_scoring() -> None:
    assert load_policy("least_sse").needs == frozenset()
    assert load_policy("affinity_sse").needs == {"prefix"}
    assert load_policy("least_sse", {"scorers": {"prefix_affinity": 1}}).needs == {"prefix"}


def test_unknown_names_and_options_are_rejected_with_the_choices() -> None:
    with pytest.raises(ValueError, match="least_sse"):
        load_policy("fastest")
    with pytest.raises(ValueError, match="cannot load"):
        load_policy("nosuchmodule:Policy")
    with pytest.raises(ValueError, match="unknown scorer"):
        load_policy("least_sse", {"scorers": {"speed": 1}})
    with pytest.raises(ValueError, match="name no plugin"):
        load_policy("least_sse", {"load_guard": 4})
    with pytest.raises(ValueError, match="bad options for scorer 'prefix_affinity'"):
        load_policy("affinity_sse", {"prefix_affinity": {"nope": 1}})
    with pytest.raises(ValueError, match="weights must be numbers"):
        load_policy("least_sse", {"scorers": {"open_streams": "heavy"}})


def test_plugins_and_whole_policies_load_from_a_dotted_path() -> None:
    scorer = load_policy("least_sse", {"scorers": {"pdgate.policies.scorers:Inflight": 1.0}})
    assert ids(scorer.rank(REQ, [inst("a", inflight=3), inst("b", inflight=1)])) == ["b", "a"]
    with pytest.raises(ValueError, match="does not implement the policy contract"):
        load_policy("pdgate.policies.pickers:MaxScore")  # a picker is not a whole policy


class _Undeclared:
    """A scorer from before the contract: it does not say what it needs."""

    name = "undeclared"

    def score(self, request: RequestInfo, candidates: Sequence[InstanceLoad]) -> list[float]:
        return [0.0] * len(candidates)


def test_a_plugin_that_does_not_declare_its_needs_fails_at_start_naming_the_contract() -> None:
    """The gateway reads what a plugin needs from its declaration (the index is built only
    for a policy whose plugins read it): a plugin without one is refused at start-up, with
    what the contract asks for, not taken as needing nothing."""
    with pytest.raises(ValueError, match=r"scorer .*_Undeclared.* contract: name, needs"):
        load_policy("least_sse", {"scorers": {f"{__name__}:_Undeclared": 1.0}})


def test_idle_drops_a_prefill_computing_for_any_gateway_and_keeps_one_holding_kv() -> None:
    """A prefill computing a batch, ours or another gateway's, would take a new prompt into
    its next batch (a queue inside it); one whose slots only hold KV for decodes to pull
    computes nothing and can start a new batch in its free slots."""
    idle = FILTERS["idle"]()
    ours = inst("ours", inflight=1)._replace(own_inflight=1, computing=1)
    theirs = inst("theirs", inflight=2)._replace(computing=2)  # another gateway's batch
    holding = inst("holding", inflight=3)._replace(own_inflight=1)  # answered, KV not taken
    free = inst("free")
    kept = idle.filter(RequestInfo("m", None, "p", 1, 4), [ours, theirs, holding, free])
    assert ids(kept) == ["holding", "free"]


def test_a_faster_prefill_takes_more_streams_before_it_ranks_below_a_slower_one() -> None:
    fast, slow = inst("b-fast", 3)._replace(speed=2.0), inst("a-slow", 1)._replace(speed=0.5)
    # 4 streams (with this request) at twice the pace against 2 at half: 2 against 4.
    assert ids(load_policy("least_sse").rank(REQ, [slow, fast])) == ["b-fast", "a-slow"]
    assert ids(load_policy("least_sse").rank(REQ, [slow, fast._replace(open_streams=9)])) == [
        "a-slow",
        "b-fast",
    ]
    # Idle both: the faster one (alike instances tie, and go by id).
    idle = [slow._replace(open_streams=0), fast._replace(open_streams=0)]
    for name in ("least_sse", "least_inflight", "least_tokens"):
        if name in PROFILES:
            assert ids(load_policy(name).rank(REQ, idle))[0] == "b-fast", name


def test_equal_speeds_rank_exactly_as_without_them() -> None:
    rng = random.Random(7)
    for _ in range(200):
        cands = [
            inst(f"i{k}", rng.randrange(5), rng.randrange(4), tokens=rng.randrange(900))
            for k in range(5)
        ]
        same = [c._replace(speed=2.0) for c in cands]  # exact in binary: no rounding
        for name in PROFILES:
            if name.startswith("affinity") or name.startswith("prefix"):
                continue
            policy = load_policy(name, {"picker": "max_score"})
            assert ids(policy.rank(REQ, cands)) == ids(policy.rank(REQ, same)), name
