"""Cache affinity from the engines' own KV events, across a fleet (real processes: two
gateways with the precise_sse policy, one Redis, three sim prefills that publish their
prefix caches' events over ZeroMQ, one decode).

A prefix routed through one gateway lands on the same prefill through the other, which never
routed it (it learned where it is from the engine's events, not from its own history); and
once the engine evicts it, the prefix stops attracting requests as soon as the eviction's
event arrives. The prefix-hash scorer is off here, so nothing else could agree by chance."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from pdgate.config.wire import kv_release_url
from tests._cluster import (
    Processes,
    complete,
    hold_prefill_slot,
    instances_by_id,
    metric_by_label,
    prefills_at_rest,
    wait_for,
)
from tests._redis import free_port

POLICY = {
    "PDGATE_GATEWAY_PREFILL_POLICY": "precise_sse",
    # Without the prefix hash: the first choice of a new prefix is the least loaded prefill.
    "PDGATE_GATEWAY_PREFILL_POLICY_OPTIONS": (
        '{"scorers": {"precise_prefix": 1.0, "open_streams": 0.1, "inflight": 0.001}}'
    ),
}
# Topics far apart, ~250 tokens each: 15 blocks of 16 in the sim's prefix cache.
PREFIXES = [
    " ".join(f"{topic}{i % 37} notes" for i in range(120))
    for topic in ("harbour", "glacier", "orchard")
]


def _value(url: str, name: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    return None


def _events(url: str) -> dict[str, float]:
    return metric_by_label(url, "pdgate_kv_events_total", "kind")


@pytest.mark.timeout(120)
def test_a_prefix_routed_through_one_gateway_is_found_through_the_other(
    processes: Processes,
) -> None:
    for name in ("a", "b", "c"):
        events = {
            "PDGATE_SHIM_KV_EVENTS_PORT": str(free_port()),
            "PDGATE_SHIM_SIM_PREFIX_CACHE_BLOCKS": "120",
        }
        processes.shim("prefill", "--capacity", "1", "--instance-id", name, env=events)
    processes.shim("decode", "--capacity", "64")
    gateways = processes.gateways(2, 4, POLICY)
    for url in gateways:
        wait_for(
            lambda url=url: _value(url, "pdgate_kv_event_subscriptions") == 3,
            what="every gateway follows the three prefills' events",
        )
    rows = instances_by_id(gateways[0])
    assert all(rows[n]["kv_events"].startswith("tcp://127.0.0.1:") for n in ("a", "b", "c"))
    time.sleep(0.3)  # ZeroMQ subscriptions connect asynchronously

    # Through gateway 0, at once: one slot each, so the three prefixes spread out.
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        first = list(pool.map(complete, [gateways[0]] * 3, [p + " first" for p in PREFIXES]))
    placed = [r.headers["x-pdgate-prefill"] for r in first]
    assert sorted(placed) == ["a", "b", "c"], placed
    wait_for(
        lambda: _events(gateways[1]).get("stored", 0) >= 3 * 15,
        what="gateway 1 applied the prefills' stored blocks",
    )

    # Through gateway 1, one at a time (all idle: without the events, each would go to "a").
    for prefix, where in zip(PREFIXES, placed, strict=True):
        wait_for(lambda: prefills_at_rest(gateways[1]), what="every prefill free at gateway 1")
        resp = complete(gateways[1], prefix + " second")
        assert resp.headers["x-pdgate-prefill"] == where
    # Each time the engine found the prefix gateway 1 predicted it would, to the token.
    outcomes = metric_by_label(gateways[1], "pdgate_prefix_predictions_total", "outcome")
    assert outcomes == {"exact": 3.0}, outcomes
    tokens = metric_by_label(gateways[1], "pdgate_prefix_cached_tokens_total", "source")
    assert tokens["predicted"] == tokens["reported"] >= 3 * 14 * 16

    # The prefill holding a prefix that idle ties would not pick evicts it.
    victim = next(i for i, where in enumerate(placed) if where != "a")
    holder = placed[victim]
    url = rows[holder]["url"]
    removed = _events(gateways[1]).get("removed", 0)
    for i in range(10):  # 10 x ~19 blocks through a 120-block cache
        params = hold_prefill_slot(url, " ".join(f"flood{i}x{j}" for j in range(150)))
        httpx.delete(kv_release_url(url, params["remote_request_id"]), timeout=5)
    wait_for(
        lambda: _events(gateways[1]).get("removed", 0) > removed,
        what="gateway 1 saw the eviction",
    )
    wait_for(lambda: prefills_at_rest(gateways[1]), what="every prefill free at gateway 1")
    resp = complete(gateways[1], PREFIXES[victim] + " third")
    assert resp.headers["x-pdgate-prefill"] == "a"  # nothing attracts it to `holder` now
