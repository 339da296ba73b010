"""Queue-less prefills: 429 at once, the gateway retries elsewhere or until the deadline."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator

import httpx
import pytest

from tests._cluster import ThreadedCluster, hold_prefill_slot, release_prefill_slot, shim_load

BODY = {"model": "sim-llama-3.1-8b", "prompt": "a request", "max_tokens": 4}


def no_leaks(c: ThreadedCluster) -> bool:
    return all(r["open_streams"] == 0 and r["inflight"] == 0 for r in c.instances())


@pytest.fixture
def one_slot_prefill() -> Iterator[ThreadedCluster]:
    with ThreadedCluster(prefills=1, decodes=1, shim={"capacity": 1, "kv_hold_timeout_s": 30}) as c:
        yield c


def test_prefill_with_one_slot_rejects_the_second_request_at_once(
    one_slot_prefill: ThreadedCluster,
) -> None:
    assert one_slot_prefill.info is not None
    prefill = one_slot_prefill.info.prefill_urls[0]
    held = hold_prefill_slot(prefill)
    resp = httpx.post(
        prefill + "/v1/completions",
        json={**BODY, "kv_transfer_params": {"do_remote_decode": True}},
        timeout=10,
    )
    # Rejected, not queued: a queued request would wait for the held slot (30 s) and time out.
    assert resp.status_code == 429
    assert "retry-after" in resp.headers
    # OpenAI's error object, with the wait it tells (the header's, to the millisecond).
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code", "retry_after"}
    assert round(error["retry_after"] * 1000) == int(resp.headers["retry-after-ms"])
    release_prefill_slot(held)  # else the cluster's shutdown waits out the 30 s hold


def test_gateway_retries_until_the_slot_frees(one_slot_prefill: ThreadedCluster) -> None:
    c = one_slot_prefill
    assert c.info is not None
    held = hold_prefill_slot(c.info.prefill_urls[0])
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(httpx.post, c.url + "/v1/completions", json=BODY, timeout=30)
        c.wait_for(
            lambda: {r["role"]: r for r in c.instances()}["prefill"]["rejected"] >= 1,
            what="the prefill refusing the gateway's first try",
        )
        assert not future.done()  # refused, the request waits at the gateway: no answer yet
        release_prefill_slot(held)
        resp = future.result()
    assert resp.status_code == 200, resp.text
    c.wait_for(lambda: no_leaks(c), what="open-stream counts back to 0")


def test_two_concurrent_requests_on_one_slot_both_succeed(
    one_slot_prefill: ThreadedCluster,
) -> None:
    c = one_slot_prefill
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [
            pool.submit(httpx.post, c.url + "/v1/completions", json=BODY, timeout=30)
            for _ in range(4)
        ]
        statuses = [f.result().status_code for f in futures]
    assert statuses == [200] * 4
    c.wait_for(lambda: no_leaks(c))
    assert c.info is not None
    assert shim_load(c.info.prefill_urls[0])["used"] == 0


def test_rejected_request_is_routed_to_the_idle_prefill() -> None:
    with ThreadedCluster(prefills=2, decodes=1, shim={"capacity": 1, "kv_hold_timeout_s": 5}) as c:
        assert c.info is not None
        busy, idle = c.info.prefill_urls
        hold_prefill_slot(busy)
        ids = {r["url"]: r["id"] for r in c.instances()}
        for _ in range(3):
            resp = httpx.post(c.url + "/v1/completions", json=BODY, timeout=10)
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-pdgate-prefill"] == ids[idle]
        c.wait_for(lambda: no_leaks(c))


def test_deadline_gives_503_with_retry_after_and_leaks_nothing() -> None:
    with ThreadedCluster(prefills=1, decodes=1, shim={"capacity": 1, "kv_hold_timeout_s": 10}) as c:
        assert c.info is not None
        hold_prefill_slot(c.info.prefill_urls[0])
        start = time.monotonic()
        resp = httpx.post(
            c.url + "/v1/completions",
            json=BODY,
            headers={"x-pdgate-ttft-timeout-ms": "300"},
            timeout=10,
        )
        elapsed = time.monotonic() - start
        assert resp.status_code == 503
        assert 1 <= int(resp.headers["retry-after"]) <= 120
        err = resp.json()["error"]
        assert err["code"] == "ttft_deadline_exceeded"
        assert set(err) == {"message", "type", "param", "code", "retry_after"}
        assert elapsed >= 0.3  # at its deadline (the code: not at a socket timeout)
        c.wait_for(lambda: no_leaks(c))
        health = httpx.get(c.url + "/health").json()
        assert health["pending"] == 0


def test_no_instances_means_503_not_a_hang() -> None:
    with ThreadedCluster(prefills=1, decodes=1) as c:
        resp = httpx.post(
            c.url + "/v1/completions", json={**BODY, "model": "not-served"}, timeout=10
        )
        assert resp.status_code == 404
        assert resp.json()["error"]["code"] == "model_not_found"
