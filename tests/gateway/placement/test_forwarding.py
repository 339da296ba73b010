"""On-demand forwarding through real shims: the gateway-held queue, batch forwarding,
capacity feedback, affinity, and the paper's baseline (direct) mode."""

from __future__ import annotations

import collections
import concurrent.futures
import random
import socket
import time
from typing import Any

import httpx
import orjson

from tests._cluster import (
    ThreadedCluster,
    hold_prefill_slot,
    queued_heads,
    release_prefill_slot,
    shim_load,
)

BODY: dict[str, Any] = {"model": "sim-llama-3.1-8b", "prompt": "a question", "max_tokens": 4}


def health(c: ThreadedCluster) -> dict[str, Any]:
    data: dict[str, Any] = httpx.get(c.url + "/health").json()
    return data


def no_leaks(c: ThreadedCluster) -> bool:
    rows = c.instances()
    return (
        all(r["open_streams"] == 0 and r["inflight"] == 0 for r in rows)
        and health(c)["pending"] == 0
    )


def post_all(url: str, n: int, **kw: Any) -> list[httpx.Response]:
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        futures = [
            pool.submit(httpx.post, url + "/v1/completions", json={**BODY, **kw}, timeout=30)
            for _ in range(n)
        ]
        return [f.result() for f in futures]


def test_batch_forwarding_spreads_a_backlog_over_the_idle_prefills() -> None:
    shim = {"capacity": 4, "kv_hold_timeout_s": 30}
    # A long back-off (and busy hold) keeps the forwarder asleep while the test frees both
    # prefills, so it wakes to two idle prefills and a backlog of four; long enough that a
    # loaded machine frees both before it wakes.
    gateway = {"batch_forwarding": True, "backoff_initial_s": 3.0, "backoff_max_s": 3.0}
    with ThreadedCluster(prefills=2, decodes=1, shim=shim, gateway=gateway) as c:
        assert c.info is not None
        held = [
            hold_prefill_slot(url, f"hold {i}") for url in c.info.prefill_urls for i in range(4)
        ]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [
                pool.submit(httpx.post, c.url + "/v1/completions", json=BODY, timeout=30)
                for _ in range(4)
            ]
            c.wait_for(lambda: health(c)["queued"] == 4, what="4 requests queued at the gateway")
            time.sleep(0.1)  # the rejections that queued them are done: the forwarder sleeps
            list(pool.map(release_prefill_slot, held))  # both prefills become idle at once
            responses = [f.result() for f in futures]
        assert [r.status_code for r in responses] == [200] * 4
        used = collections.Counter(r.headers["x-pdgate-prefill"] for r in responses)
        # Each idle prefill gets its share of the backlog: two batches of two, not one batch
        # of four on the first prefill while the second idles (a batch of prompts takes
        # about as long as the prompts one after another, and each waits for all of them).
        assert sorted(used.values()) == [2, 2]
        c.wait_for(lambda: no_leaks(c))


def test_queued_requests_expire_at_their_own_deadlines() -> None:
    shim = {"capacity": 1, "kv_hold_timeout_s": 30}
    with ThreadedCluster(prefills=1, decodes=1, shim=shim) as c:
        assert c.info is not None
        held = hold_prefill_slot(c.info.prefill_urls[0])

        def post(ms: int) -> httpx.Response:
            headers = {"x-pdgate-ttft-timeout-ms": str(ms)}
            return httpx.post(c.url + "/v1/completions", json=BODY, headers=headers, timeout=30)

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            # Each waits with its own deadline (the gateway's is 10 s), the queue's head
            # (first in, first out) before the other.
            short = pool.submit(post, 1000)
            assert max(queued_heads(c.url, 1)) <= 1000
            long = pool.submit(post, 3000)
            c.wait_for(lambda: health(c)["queued"] == 2, what="both queued")
            # The short one expires at its own deadline while the long one still waits.
            answers = [short.result()]
            assert not long.done() and max(queued_heads(c.url, 1)) <= 3000
            answers.append(long.result())
        for answer in answers:
            assert answer.status_code == 503
            assert answer.json()["error"]["message"] == (
                "no prefill instance accepted the request before its TTFT deadline"
            )
        assert health(c)["queued"] == 0
        release_prefill_slot(held)
        c.wait_for(lambda: no_leaks(c))


def test_direct_mode_is_one_try_without_retries() -> None:
    shim = {"capacity": 1, "kv_hold_timeout_s": 30}
    with ThreadedCluster(prefills=1, decodes=1, shim=shim, gateway={"dispatch": "direct"}) as c:
        assert c.info is not None
        held = hold_prefill_slot(c.info.prefill_urls[0])
        resp = httpx.post(c.url + "/v1/completions", json=BODY, timeout=30)
        # The one prefill's refusal, not the deadline, answers it.
        assert resp.status_code == 503
        assert resp.json()["error"]["message"] == "the prefill instance is busy"
        prefill = next(r for r in c.instances() if r["role"] == "prefill")
        assert prefill["rejected"] == 1
        release_prefill_slot(held)
        assert httpx.post(c.url + "/v1/completions", json=BODY, timeout=30).status_code == 200
        c.wait_for(lambda: no_leaks(c))


def test_affinity_sends_a_known_prefix_back_to_its_prefill() -> None:
    system = "You are the assistant of the travel desk; answer politely and briefly. " * 6
    # The affinity index alone (without the prefix hash, which would place the unrelated
    # streams by their own prefixes rather than by load).
    index_only = {"scorers": {"prefix_affinity": 1.0, "open_streams": 0.1, "inflight": 0.001}}
    for policy, expect_warm in (("affinity_sse", True), ("least_sse", False)):
        gateway = {"prefill_policy": policy}
        if policy == "affinity_sse":
            gateway["prefill_policy_options"] = index_only  # type: ignore[assignment]
        with ThreadedCluster(prefills=2, decodes=1, shim={"capacity": 8}, gateway=gateway) as c:
            first = httpx.post(
                c.url + "/v1/completions", json={**BODY, "prompt": system + "Q1"}, timeout=30
            )
            warm = first.headers["x-pdgate-prefill"]
            # Three long streams make the warm prefill the busier one (2 open streams vs 1).
            streams = [open_stream(c.url, f"unrelated {i}") for i in range(3)]
            c.wait_for(
                lambda: sum(r["open_streams"] for r in c.instances() if r["role"] == "prefill") == 3
            )
            by_id = {r["id"]: r["open_streams"] for r in c.instances() if r["role"] == "prefill"}
            assert by_id[warm] == 2
            again = httpx.post(
                c.url + "/v1/completions", json={**BODY, "prompt": system + "Q2"}, timeout=30
            )
            assert (again.headers["x-pdgate-prefill"] == warm) is expect_warm
            for s in streams:
                s.close()
            c.wait_for(lambda: no_leaks(c))


def open_stream(url: str, prompt: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    payload = orjson.dumps({**BODY, "prompt": prompt, "max_tokens": 5000, "stream": True})
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    got = b""
    while b"data: " not in got:
        got += sock.recv(65536)
    return sock


def test_burst_of_cancellations_leaks_nothing() -> None:
    shim = {"capacity": 2}
    with ThreadedCluster(prefills=2, decodes=2, shim=shim) as c:
        assert c.info is not None
        rng = random.Random(5)
        socks = []
        for i in range(24):
            host, port = c.url.removeprefix("http://").split(":")
            sock = socket.create_connection((host, int(port)))
            payload = orjson.dumps(
                {
                    **BODY,
                    "prompt": f"burst {i}",
                    "max_tokens": rng.choice([5, 50, 500]),
                    "stream": True,
                }
            )
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(payload)}\r\n\r\n".encode()
                + payload
            )
            socks.append(sock)
        # Close them at random moments: some still queued, some prefilling, some streaming.
        rng.shuffle(socks)
        for sock in socks:
            time.sleep(rng.uniform(0, 0.05))
            sock.close()
        c.wait_for(lambda: no_leaks(c), timeout=10, what="every count back to 0")
        for url in c.info.prefill_urls + c.info.decode_urls:
            c.wait_for(
                lambda url=url: shim_load(url)["used"] == 0, timeout=10, what=f"{url} slots freed"
            )
        # Still serving normally afterwards.
        assert all(r.status_code == 200 for r in post_all(c.url, 4))


def test_batch_endpoint_carries_a_whole_backlog_in_one_call() -> None:
    shim = {"capacity": 4, "kv_hold_timeout_s": 30}
    gateway = {
        "batch_forwarding": True,
        "prefill_batch_endpoint": True,
        "backoff_initial_s": 1.0,
        "backoff_max_s": 1.0,
    }
    with ThreadedCluster(prefills=1, decodes=1, shim=shim, gateway=gateway) as c:
        assert c.info is not None
        prefill = c.info.prefill_urls[0]
        held = [hold_prefill_slot(prefill, f"hold {i}") for i in range(4)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [
                pool.submit(
                    httpx.post, c.url + "/v1/completions", json={**BODY, "stream": s}, timeout=30
                )
                for s in (True, False, True, False, True)
            ]
            c.wait_for(lambda: health(c)["queued"] == 5, what="5 requests queued")
            time.sleep(0.1)
            list(pool.map(release_prefill_slot, held))
            responses = [f.result() for f in futures]
        # Four fit in one batch; the fifth is rejected in that same call and served next.
        assert [r.status_code for r in responses] == [200] * 5
        assert responses[0].text.rstrip().endswith("data: [DONE]")
        assert responses[1].json()["usage"]["completion_tokens"] == 4
        c.wait_for(lambda: no_leaks(c))
        assert shim_load(prefill)["used"] == 0
