"""The prefix-affinity index costs memory per request: a gateway builds it only for a policy
that scores prefix affinity. Checked on a running gateway through ``GET /health``
(``affinity_index``: null, or the index's entries and bound)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests._cluster import ThreadedCluster

SYSTEM = "You are the travel desk of ACME Corp. Answer briefly and politely. " * 4


def _health_after_traffic(policy: str | None) -> dict[str, Any]:
    gateway = {} if policy is None else {"prefill_policy": policy}
    with ThreadedCluster(gateway=gateway, prefills=2, decodes=1) as cluster:
        for i in range(4):
            resp = httpx.post(
                cluster.url + "/v1/completions",
                json={"model": "sim-llama-3.1-8b", "prompt": SYSTEM + f"Q{i}?", "max_tokens": 2},
                timeout=30,
            )
            assert resp.status_code == 200, resp.text
        health: dict[str, Any] = httpx.get(cluster.url + "/health", timeout=5).json()
        return health


@pytest.mark.parametrize("policy", [None, "least_sse", "round_robin"])
def test_no_index_under_a_policy_without_prefix_affinity(policy: str | None) -> None:
    health = _health_after_traffic(policy)
    assert health["prefill_policy"]["name"] == (policy or "least_sse")
    assert health["affinity_index"] is None


def test_affinity_sse_builds_and_fills_a_bounded_index() -> None:
    index = _health_after_traffic("affinity_sse")["affinity_index"]
    assert index is not None
    # Each ~270-character prompt has 4 whole 64-character blocks, all shared but the last.
    assert 4 <= index["entries"] <= index["max_entries"]
