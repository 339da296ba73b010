"""docs/extending.md's worked example, run: a scorer from outside pdgate, named in config."""

from __future__ import annotations

import httpx

from pdgate.policies import load_policy
from pdgate.policies.base import InstanceLoad, RequestInfo
from tests._cluster import ThreadedCluster

SCORER = "tests.policies._example_scorer:Headroom"
REQ = RequestInfo(model="m", group=None, prompt="p", prompt_chars=1, max_tokens=1)


def _inst(i: str, capacity: int, inflight: int) -> InstanceLoad:
    return InstanceLoad(
        id=i, url="", group="g", capacity=capacity, open_streams=inflight, inflight=inflight
    )


def test_an_outside_scorer_loads_by_name_with_its_options() -> None:
    policy = load_policy("least_sse", {"scorers": {SCORER: 1.0}, SCORER: {"floor": 0.1}})
    small, big = _inst("small", 8, 6), _inst("big", 32, 6)
    assert [c.id for c in policy.rank(REQ, [small, big])] == ["big", "small"]
    # Plain least_sse sees two equally loaded instances.
    assert load_policy("least_sse").rank(REQ, [small, big])[0].id == "big"  # (id order)
    assert load_policy("least_sse").rank(REQ, [big, _inst("a-small", 8, 6)])[0].id == "a-small"


def test_a_gateway_runs_with_the_outside_scorer() -> None:
    options = {"scorers": {SCORER: 1.0, "open_streams": 0.1}, SCORER: {"floor": 0.0}}
    with ThreadedCluster(prefills=2, decodes=1, gateway={"prefill_policy_options": options}) as c:
        health = httpx.get(c.url + "/health").json()
        assert health["prefill_policy"]["scorers"] == {"headroom": 1.0, "open_streams": 0.1}
        for i in range(4):
            resp = httpx.post(
                c.url + "/v1/completions",
                json={"model": "sim-llama-3.1-8b", "prompt": f"question {i}", "max_tokens": 2},
                timeout=10,
            )
            assert resp.status_code == 200, resp.text
