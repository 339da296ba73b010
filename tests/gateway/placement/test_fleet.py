"""Several gateway processes on one Redis and shared shims act as one fleet (two and four
gateways)."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import httpx
import pytest

from tests._cluster import (
    SIM_MODEL,
    Processes,
    Subprocess,
    instance_urls,
    instances_by_id,
    metric_by_label,
    registry_env,
    shim_load,
    wait_for,
)
from tests._redis import RedisServer

TTL_S = 0.8
GATEWAYS = pytest.mark.parametrize("n", [2, 4])
# Gateways that sync often and forget a dead one soon.
FLEET = {"PDGATE_GATEWAY_FLEET_SYNC_INTERVAL_S": "0.05", "PDGATE_GATEWAY_FLEET_TTL_S": str(TTL_S)}


def _cluster(
    processes: Processes,
    *,
    gateways: int,
    prefill_capacity: int = 2,
    prefills: int = 2,
    gateway_env: dict[str, str] | None = None,
) -> tuple[list[str], list[str]]:
    """`prefills` prefills and a decode behind `gateways` gateways; the gateways' URLs and
    the prefills'."""
    for _ in range(prefills):
        processes.shim("prefill", "--capacity", str(prefill_capacity))
    processes.shim("decode", "--capacity", "64")
    urls = processes.gateways(gateways, prefills + 1, {**FLEET, **(gateway_env or {})})
    return urls, instance_urls(urls[0], "prefill")


def _post(url: str, prompt: str, *, max_tokens: int = 4, **headers: str) -> httpx.Response:
    return httpx.post(
        url + "/v1/completions",
        json={"model": SIM_MODEL, "prompt": prompt, "max_tokens": max_tokens},
        headers=headers,
        timeout=30,
    )


@GATEWAYS
def test_gateways_never_overfill_a_prefill_and_draw_no_429s(processes: Processes, n: int) -> None:
    """With each gateway counting only its own requests, every prefill another gateway used
    looked free and was probed: 429s per request grew with the number of gateways."""
    urls, prefills = _cluster(processes, gateways=n, prefill_capacity=1)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        jobs = [pool.submit(_post, urls[i % n], f"burst {i}") for i in range(32)]
        codes = [j.result().status_code for j in jobs]
    assert codes == [200] * 32
    assert sum(shim_load(u)["rejected"] for u in prefills) == 0


@GATEWAYS
def test_counts_agree_across_gateways_and_a_killed_gateway_leaves_no_phantom_load(
    processes: Processes, n: int
) -> None:
    urls, _ = _cluster(processes, gateways=n, prefill_capacity=4)
    victim_url, survivor_urls = urls[0], urls[1:]
    victim = processes.procs[-n]  # the first gateway started
    # Long streams through the victim keep open streams counted at the instances.
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        streams = [
            pool.submit(
                httpx.post,
                victim_url + "/v1/completions",
                json={
                    "model": SIM_MODEL,
                    "prompt": f"long {i}",
                    "max_tokens": 3000,
                    "stream": True,
                },
                timeout=30,
            )
            for i in range(3)
        ]

        def agree() -> bool:
            seen = [instances_by_id(u) for u in urls]
            total = sum(r["fleet_open_streams"] for r in seen[-1].values())
            return total >= 6 and all(
                view[i]["fleet_open_streams"] == seen[0][i]["fleet_open_streams"]
                for view in seen[1:]
                for i in seen[0]
            )

        # Each stream counts at its prefill and its decode: 3 streams, 6 counts.
        wait_for(agree, timeout=5, what="both gateways see the same fleet counts")
        os.kill(victim.proc.pid, signal.SIGKILL)

        def no_phantom() -> bool:
            return all(
                r["fleet_open_streams"] == 0 and r["fleet_inflight"] == 0
                for url in survivor_urls
                for r in instances_by_id(url).values()
            )

        # Within the TTL and a few syncs, with slack for a busy box: the streams run on for
        # far longer, so only forgetting the dead gateway clears their counts this soon.
        wait_for(no_phantom, timeout=TTL_S + 3, what="the dead gateway's load vanishes")
        for s in streams:
            s.cancel()
    # The survivors serve with the whole capacity again.
    for url in survivor_urls:
        assert _post(url, "after the kill").status_code == 200


@GATEWAYS
def test_a_prefix_sent_through_one_gateway_then_another_lands_on_the_same_prefill(
    processes: Processes, n: int
) -> None:
    urls, _ = _cluster(
        processes,
        gateways=n,
        prefills=3,
        prefill_capacity=4,
        gateway_env={"PDGATE_GATEWAY_PREFILL_POLICY": "affinity_sse"},
    )
    system = "You are the travel desk of ACME Corp. Answer briefly and politely. " * 6
    for scenario in range(4):
        prefix = f"[scenario {scenario}] " + system
        first = _post(urls[0], prefix + "Where is my booking?").headers["x-pdgate-prefill"]
        for i, url in enumerate(urls[1:], start=1):
            then = _post(url, prefix + f"Can I change seats? ({i})").headers["x-pdgate-prefill"]
            assert then == first, (scenario, i)


def test_a_gateway_that_loses_redis_keeps_serving_from_its_own_view(
    procs: list[Subprocess], private_redis: RedisServer
) -> None:
    processes = Processes(procs, registry_env(private_redis.url, "pdgate-fleet-down"))
    urls, _ = _cluster(processes, gateways=1, prefills=1)
    assert _post(urls[0], "before").status_code == 200
    private_redis.stop()
    time.sleep(0.5)
    resp = _post(urls[0], "while Redis is down")
    assert resp.status_code == 200, resp.text
    assert httpx.get(urls[0] + "/health").json()["fleet"]["degraded"] is True
    private_redis.start()
    wait_for(
        lambda: httpx.get(urls[0] + "/health").json()["fleet"]["degraded"] is False,
        timeout=5,
        what="fleet state recovered",
    )


# -- prefills with several slots: the fleet acts as one scheduler -------------------------

A100 = ("--sim-profile", "llama-3.1-8b-a100")  # about 0.2 ms a prompt token: time to look


def _multi_slot_cluster(processes: Processes, **gateway_env: str) -> tuple[list[str], list[str]]:
    """Two prefills of 4 slots and a decode behind two gateways."""
    for _ in range(2):
        processes.shim("prefill", "--capacity", "4", *A100)
    processes.shim("decode", "--capacity", "64", *A100)
    urls = processes.gateways(2, 3, {**FLEET, **gateway_env})
    return urls, instance_urls(urls[0], "prefill")


def _words(n: int, seed: str) -> str:
    return " ".join(f"{seed}{i % 97}" for i in range(n))


def test_a_gateway_does_not_send_into_a_batch_another_gateway_computes_while_one_idles(
    processes: Processes,
) -> None:
    """With four slots, the prefill computing gateway 0's long prompt still has room, and
    prefix hashing rates it first for gateway 1's request of the same prefix; counting only
    its own requests, gateway 1 sent it there to wait a whole batch inside the prefill while
    the other prefill idled."""
    urls, prefills = _multi_slot_cluster(processes, PDGATE_GATEWAY_PREFILL_POLICY="affinity_sse")
    prefix = "You are the support desk of ACME Corp; answer in one line. " * 6
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # ~6,000 prompt tokens: about 1.3 s of prefill on the A100 profile.
        long = pool.submit(_post, urls[0], prefix + _words(6000, "doc"))

        def computing() -> str | None:
            return next((u for u in prefills if shim_load(u)["running"]), None)

        wait_for(lambda: computing() is not None, timeout=5, what="gateway 0's prefill starts")
        busy_url = computing()
        time.sleep(0.1)  # a fleet sync or two: the old code's view had it by then
        short = _post(urls[1], prefix + "Where is my order?")
        assert short.status_code == 200, short.text
        assert not long.done()  # it came back before the batch it would have waited for
        assert long.result().status_code == 200
    rows = instances_by_id(urls[1]).values()
    busy = next(r["id"] for r in rows if r["url"] == busy_url)
    assert short.headers["x-pdgate-prefill"] != busy
    assert instances_by_id(urls[1])[busy]["accepted"] == 0
    # What it cost: each gateway took its slots in one call and told the fleet its prefill
    # answered in another (its release and syncs aside).
    for url in urls:
        calls = _fleet_calls(url)
        assert calls["acquire"] == 1 and calls["computed"] == 1, calls


def _fleet_calls(url: str) -> dict[str, float]:
    return metric_by_label(url, "pdgate_fleet_calls_total", "op")


def test_every_gateway_learns_prefill_times_from_the_whole_fleets_calls(
    processes: Processes,
) -> None:
    """Early drop's estimates are the fleet's: a gateway that never sent a prompt of this
    length drops one that cannot make its deadline at once, as the gateway that sent them
    does, instead of trying it until the deadline passes."""
    urls, _ = _multi_slot_cluster(processes)
    # ~2,000 tokens a prompt: about 0.4 s each; 20 of them, sent through gateway 0 only.
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        jobs = [pool.submit(_post, urls[0], _words(2000, f"w{i}x")) for i in range(20)]
        assert [j.result().status_code for j in jobs] == [200] * 20
    time.sleep(0.3)  # a few fleet syncs
    hopeless = {"x-pdgate-ttft-timeout-ms": "150"}
    answers = []
    for url in urls:
        sent = sum(r["accepted"] for r in instances_by_id(url).values())
        resp = _post(url, _words(2000, "late"), **hopeless)
        answers.append((resp.status_code, resp.json()["error"]["message"]))
        # Dropped before any prefill was tried, not tried until the deadline passed.
        assert sum(r["accepted"] for r in instances_by_id(url).values()) == sent, answers
    assert answers[0] == answers[1]
    assert answers[0][0] == 503 and "cannot be prefilled before" in answers[0][1], answers
