"""loadtest/gateway_cost/sorted_rankers.py prices the policy pipeline against b8cbedd's one-sort
rankers (docs/results/structure/README.md). The measurement holds only if those rankers try the same
candidates in the same order as the built-in profiles where it runs: two candidates."""

from __future__ import annotations

import itertools

from pdgate.loadtest.gateway_cost import sorted_rankers
from pdgate.policies import admit_idle, load_policy
from pdgate.policies.base import InstanceLoad, RequestInfo

REQ = RequestInfo(model="m", group=None, prompt="hello", prompt_chars=5, max_tokens=8)


def _loads() -> list[InstanceLoad]:
    """Every small combination of the signals the two rankers read."""
    out = []
    for n, (streams, inflight, own, busy, ejected, capacity) in enumerate(
        itertools.product((0, 1, 3), (0, 1, 2), (0, 1), (False, True), (False, True), (2, 8))
    ):
        load = InstanceLoad(id=f"i{n:03d}", url="u", group="g", capacity=capacity,
                            open_streams=streams, inflight=inflight, busy=busy,
                            ejected=ejected, own_inflight=min(own, inflight),
                            computing=min(own, inflight))  # fmt: skip
        out.append(load)
    return out


def test_the_sorted_rankers_rank_two_candidates_as_the_default_profiles() -> None:
    pairs = [
        (admit_idle(load_policy("least_sse")), sorted_rankers.LeastSSE()),
        (load_policy("least_loaded"), sorted_rankers.LeastLoaded()),
    ]
    loads = _loads()
    compared = 0
    for a, b in itertools.permutations(loads[::3], 2):
        for profile, sorted_ranker in pairs:
            expected = [c.id for c in profile.rank(REQ, [a, b])]
            assert [c.id for c in sorted_ranker.rank(REQ, [a, b])] == expected, (a, b)
            compared += bool(expected)
    assert compared > 1000  # most pairs leave someone to rank, so the orders were compared
