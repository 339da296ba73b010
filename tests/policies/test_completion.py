"""Hold or go by expected completion (policies/completion.py), the profiles that use it and
the token-work profile."""

from __future__ import annotations

import pytest

from pdgate.policies import HOLDERS, load_policy
from pdgate.policies.base import Option, Policy
from pdgate.policies.completion import ExpectedCompletion
from pdgate.policies.scorers import InflightTokens
from tests.policies.test_policies import REQ, ids, inst

FREE = inst("free")
HOLDER = inst("holder", inflight=4)  # full: its slots are all taken
OTHER = inst("other", inflight=4)


def go(prefill_s: float) -> Option:
    return Option(FREE, 0.0, prefill_s)


def test_holds_when_the_cache_hit_finishes_sooner_and_goes_when_the_wait_is_long() -> None:
    choose = ExpectedCompletion(min_gain=0.0).choose
    # Uncached elsewhere: 1.0 s. At the holder only 0.1 s is left to compute.
    assert choose(go(1.0), [Option(HOLDER, 0.5, 0.1)], remaining_s=5).instance is HOLDER
    # The same hit behind a longer wait: taking the free prefill is sooner.
    assert choose(go(1.0), [Option(HOLDER, 0.95, 0.1)], remaining_s=5).instance is FREE


def test_the_soonest_busy_option_wins() -> None:
    choose = ExpectedCompletion().choose
    busy = [Option(HOLDER, 0.6, 0.1), Option(OTHER, 0.2, 0.3)]
    assert choose(go(2.0), busy, remaining_s=5).instance is OTHER


def test_no_cache_advantage_never_holds() -> None:
    choose = ExpectedCompletion(min_gain=0.0).choose
    # Waiting for a prefill that computes as much as the free one can only be slower.
    assert choose(go(1.0), [Option(HOLDER, 0.0, 1.0)], remaining_s=5).instance is FREE
    assert choose(go(1.0), [], remaining_s=5).instance is FREE


def test_holding_is_bounded_by_the_deadline() -> None:
    choose = ExpectedCompletion().choose
    hold = Option(HOLDER, 0.3, 0.1)
    assert choose(go(1.0), [hold], remaining_s=0.5).instance is HOLDER
    # Expected to end after the deadline: the sure slot now, even if slower on average.
    assert choose(go(1.0), [hold], remaining_s=0.35).instance is FREE


def test_time_already_held_counts_against_holding() -> None:
    choose = ExpectedCompletion(min_gain=0.0).choose
    hold = Option(HOLDER, 0.3, 0.1)  # the estimate still says 0.4 s from now
    assert choose(go(1.0), [hold], remaining_s=5, held_s=0.5).instance is HOLDER
    # Held 0.6 s already: holding on cannot beat what going at once would have cost.
    assert choose(go(1.0), [hold], remaining_s=5, held_s=0.6).instance is FREE


def test_min_gain_ignores_small_savings() -> None:
    hold = Option(HOLDER, 0.4, 0.45)  # 0.85 s against 1.0 s: a 15 % saving
    assert ExpectedCompletion(min_gain=0.1).choose(go(1.0), [hold], remaining_s=5).instance is (
        HOLDER
    )
    assert ExpectedCompletion(min_gain=0.2).choose(go(1.0), [hold], remaining_s=5).instance is (
        FREE
    )


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="min_gain"):
        ExpectedCompletion(min_gain=1.0)
    with pytest.raises(ValueError, match="scan"):
        ExpectedCompletion(scan=-1)


def test_affinity_hold_is_affinity_sse_with_a_holder() -> None:
    policy = load_policy("affinity_hold", {"expected_completion": {"min_gain": 0.3, "scan": 2}})
    assert isinstance(policy, Policy)
    assert isinstance(policy.hold, ExpectedCompletion) and policy.hold.scan == 2
    assert policy.describe()["hold"] == "expected_completion"
    assert policy.needs == {"prefix"}
    assert load_policy("affinity_sse").describe()["hold"] is None
    # Any profile can take one, or drop it.
    added = load_policy("least_sse", {"hold": "expected_completion"})
    assert isinstance(added, Policy) and added.hold is not None
    assert added.needs == {"prefix"}  # it needs the affinity index to know of hits
    dropped = load_policy("affinity_hold", {"hold": ""})
    assert isinstance(dropped, Policy) and dropped.hold is None
    assert "expected_completion" in HOLDERS
    with pytest.raises(ValueError, match="unknown holder"):
        load_policy("least_sse", {"hold": "patience"})
    with pytest.raises(ValueError, match="bad options for holder"):
        load_policy("affinity_hold", {"expected_completion": {"min_gain": 2}})


def test_inflight_tokens_scores_the_least_prompt_work_highest() -> None:
    cands = [inst("a", tokens=3000), inst("b", tokens=0), inst("c", tokens=1500)]
    assert InflightTokens().score(REQ, cands) == [0.0, 1.0, 0.5]


def test_least_tokens_balances_prompt_work_not_connections() -> None:
    # "few" has fewer open streams but one long prompt computing; "many" several short ones.
    cands = [inst("few", streams=1, tokens=8000), inst("many", streams=4, tokens=600)]
    assert ids(load_policy("least_tokens").rank(REQ, cands)) == ["many", "few"]
    assert ids(load_policy("least_sse").rank(REQ, cands)) == ["few", "many"]
    # With no work computing anywhere, open streams decide.
    idle = [inst("x", streams=3), inst("y", streams=1)]
    assert ids(load_policy("least_tokens").rank(REQ, idle)) == ["y", "x"]
