"""Prefills on different hardware: each is ranked and estimated at its own measured pace, and
every gateway of the fleet learns the paces from the others' calls (real processes on Redis,
sim prefills of the H100 and L20 roofline profiles, about eight times apart)."""

from __future__ import annotations

import concurrent.futures

import pytest

from tests._cluster import (
    Processes,
    complete,
    instances_by_id,
    metric_by_label,
    prefills_at_rest,
    wait_for,
)

FLEET = {"PDGATE_GATEWAY_FLEET_SYNC_INTERVAL_S": "0.05"}
PROMPT = " ".join(f"word{i % 89}" for i in range(1200))  # ~2,400 tokens: 0.1 s on the H100


@pytest.mark.timeout(180)
def test_the_faster_prefill_is_preferred_once_measured_at_every_gateway(
    processes: Processes,
) -> None:
    # The slow one sorts first: alike candidates tie and go by id, so without speeds every
    # lone request below would go to it.
    for name, gpu in (("a-slow", "l20"), ("b-fast", "h100")):
        profile = ("--sim-profile", f"llama-3.1-8b@{gpu}")
        processes.shim("prefill", "--capacity", "1", "--instance-id", name, *profile)
    processes.shim("decode", "--capacity", "64", "--sim-profile", "llama-3.1-8b@h100")
    gateways = processes.gateways(2, 3, FLEET)
    rows = instances_by_id(gateways[0])
    assert (rows["a-slow"]["hardware"], rows["b-fast"]["hardware"]) == ("l20", "h100")

    # Pairs of requests through gateway 0 only: one slot each, so both prefills compute one
    # of every pair and both types get samples (16 make a type's pace known).
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for i in range(20):
            for resp in pool.map(complete, [gateways[0]] * 2, [f"{i}a {PROMPT}", f"{i}b {PROMPT}"]):
                assert resp.headers["x-pdgate-prefill"] in ("a-slow", "b-fast")
    speeds = _speeds(gateways[0])
    assert speeds["b-fast"] == 1.0 and speeds["a-slow"] < 0.3, speeds  # against the fastest

    # Lone requests, through the gateway that measured nothing itself, once the fleet's sync
    # has brought it the paces (its first request opens its queue, which reads them): the
    # fast one each time.
    complete(gateways[1], f"first {PROMPT}")
    wait_for(lambda: _speeds(gateways[1]).get("a-slow", 1.0) < 0.3, what="the paces synced")
    for i in range(6):
        wait_for(lambda: prefills_at_rest(gateways[1]), what="both prefills free at gateway 1")
        assert complete(gateways[1], f"lone {i} {PROMPT}").headers["x-pdgate-prefill"] == "b-fast"
    assert _speeds(gateways[1]) == pytest.approx(speeds, rel=0.2)
    assert all(s == 1.0 for i, s in speeds.items() if i.startswith("decode"))  # prefills only


def _speeds(url: str) -> dict[str, float]:
    """Per instance, its speed as the gateway's metrics say."""
    return metric_by_label(url, "pdgate_instance_speed", "instance")
