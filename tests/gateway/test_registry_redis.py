"""Gateway + shims registering in a real Redis, as separate processes."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any

import httpx
import redis

from tests._cluster import (
    Processes,
    Subprocess,
    ThreadedCluster,
    gateway_url,
    get_instances,
    registry_env,
    start,
    wait_for,
    wait_instances,
)
from tests._redis import record_ttl_ms

BODY = {"model": "sim-llama-3.1-8b", "prompt": "registry test", "max_tokens": 3}


def ids(url: str) -> set[str]:
    return {r["id"] for r in get_instances(url)}


def test_join_is_seen_through_pubsub_and_clean_leave_at_once(
    redis_url: str, registry_prefix: str, procs: list[Subprocess]
) -> None:
    # A 30 s poll: only pub/sub can explain a view change within the 5 s waited for.
    env = registry_env(redis_url, registry_prefix, poll=30.0)
    gw = gateway_url(start(procs, ["gateway", "--port", "0"], env))
    assert ids(gw) == set()
    shim = start(
        procs, ["shim", "--role", "prefill", "--port", "0", "--instance-id", "p-join"], env
    )
    wait_for(lambda: "p-join" in ids(gw), timeout=5, what="join")
    assert shim.terminate() == 0
    wait_for(lambda: "p-join" not in ids(gw), timeout=5, what="leave")


def test_killed_shim_expires_within_the_ttl(
    redis_url: str, registry_prefix: str, procs: list[Subprocess]
) -> None:
    ttl, poll = 1.0, 0.25
    env = registry_env(redis_url, registry_prefix, ttl=ttl, poll=poll)
    gw = gateway_url(start(procs, ["gateway", "--port", "0"], env))
    shim = start(procs, ["shim", "--role", "decode", "--port", "0", "--instance-id", "d-kill"], env)
    wait_for(lambda: "d-kill" in ids(gw), timeout=5, what="registration")
    # A record lives at most one TTL past its last heartbeat ...
    assert 0 < record_ttl_ms(redis_url, registry_prefix, "d-kill") <= ttl * 1000
    shim.proc.kill()  # SIGKILL: no deregistration, only the TTL can remove it
    # ... and the gateway sees it gone at a poll.
    wait_for(lambda: "d-kill" not in ids(gw), timeout=10, what="expiry")


def test_whole_path_across_processes(
    redis_url: str, registry_prefix: str, procs: list[Subprocess]
) -> None:
    env = registry_env(redis_url, registry_prefix)
    gw = gateway_url(start(procs, ["gateway", "--port", "0"], env))
    start(procs, ["shim", "--role", "prefill", "--port", "0"], env)
    start(procs, ["shim", "--role", "decode", "--port", "0"], env)
    wait_for(lambda: len(ids(gw)) == 2, timeout=5)
    resp = httpx.post(gw + "/v1/completions", json={**BODY, "stream": True}, timeout=10)
    assert resp.status_code == 200
    assert resp.text.rstrip().endswith("data: [DONE]")


def test_gateway_keeps_serving_while_redis_is_down(
    private_redis: Any, registry_prefix: str
) -> None:
    registry = {
        "url": private_redis.url,
        "key_prefix": registry_prefix,
        "ttl_s": 1.0,
        "heartbeat_interval_s": 0.25,
        "poll_interval_s": 0.25,
        "connect_timeout_s": 0.3,
    }
    with ThreadedCluster(prefills=1, decodes=1, registry=registry) as c:
        assert httpx.post(c.url + "/v1/completions", json=BODY, timeout=10).status_code == 200
        private_redis.stop()
        c.wait_for(
            lambda: httpx.get(c.url + "/health").json()["registry"] != "ok",
            timeout=5,
            what="outage seen",
        )
        for _ in range(5):  # the last known view keeps serving
            resp = httpx.post(c.url + "/v1/completions", json=BODY, timeout=10)
            assert resp.status_code == 200, resp.text
        assert len(c.instances()) == 2
        private_redis.start()  # empty: every record must be re-registered by its heartbeat
        c.wait_for(
            lambda: httpx.get(c.url + "/health").json()["registry"] == "ok",
            timeout=10,
            what="recovery",
        )
        c.wait_for(lambda: len(c.instances()) == 2, timeout=5)
        assert httpx.post(c.url + "/v1/completions", json=BODY, timeout=10).status_code == 200


def test_a_redis_that_comes_back_empty_costs_clients_nothing(
    private_redis: Any, procs: list[Subprocess]
) -> None:
    """Read as every instance leaving, an empty Redis (restarted without persistence) gave
    clients 503s ("no instances are registered") and 400s until the shims' next heartbeats.
    The gateway keeps what the registry forgot (and the decode the prefills it may pull
    from) until they write their records again. FLUSHALL empties it as a restart does, but
    with the connections up, so the shims' next heartbeats come a whole interval later,
    every time."""
    env = registry_env(private_redis.url, "pdgate-empty", ttl=3.0, heartbeat=1.0, poll=0.1)
    processes = Processes(procs, env)
    processes.shim("prefill", "--capacity", "4")
    processes.shim("decode", "--capacity", "16")
    url = processes.gateway()
    wait_instances(url, 2)
    stop = threading.Event()
    codes: list[int] = []
    bodies: list[str] = []

    def client(i: int) -> None:
        while not stop.is_set():
            body = {**BODY, "prompt": f"across the reset {i} {len(codes)}"}
            resp = httpx.post(url + "/v1/completions", json=body, timeout=30)
            codes.append(resp.status_code)
            if resp.status_code != 200:
                bodies.append(resp.text[:300])

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        jobs = [pool.submit(client, i) for i in range(4)]
        time.sleep(1.0)
        admin = redis.Redis.from_url(private_redis.url)
        admin.flushall()
        admin.close()
        time.sleep(4.0)  # past the hold (the record TTL): the shims registered again
        stop.set()
        for job in jobs:
            job.result()
    assert len(codes) > 20 and set(codes) == {200}, (sorted(set(codes)), bodies[:3])
    assert len(get_instances(url)) == 2
