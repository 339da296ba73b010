"""Tenants and priority classes in the gateway-held queue, through the real gateway: who a
request is for (key name or x-pdgate-tenant), its class (x-pdgate-priority, key and group
defaults), the 429-or-503 rule, and header validation."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdgate.gateway.admission.auth import ApiKey, digest
from pdgate.gateway.admission.tenancy import resolve_tenancy
from pdgate.gateway.errors import BadRequest, Forbidden
from tests._cluster import ThreadedCluster, hold_prefill_slot, keyed_cluster, release_prefill_slot
from tests.gateway.placement.test_forwarding import BODY, health, no_leaks

SHIM = {"capacity": 1, "kv_hold_timeout_s": 30}
# A long back-off and busy hold keep the forwarder asleep while a test fills the queue: each
# try at the held prefill takes a request out of the queue for a moment.
SLOW_RETRIES = {"reject_hold_s": 1.0, "backoff_initial_s": 1.0, "backoff_max_s": 1.0}


def post(url: str, headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
    return httpx.post(
        url + "/v1/completions", json={**BODY, **body}, headers=headers or {}, timeout=30
    )


def as_tenant(name: str) -> dict[str, str]:
    return {"x-pdgate-tenant": name}


def assert_error(resp: httpx.Response, status: int, code: str | None, param: str | None) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["code"] == code and error["param"] == param


def test_a_tenant_over_its_share_gets_429_while_another_tenants_requests_pass() -> None:
    gateway = {"queue_size": 4, **SLOW_RETRIES}
    with ThreadedCluster(prefills=1, decodes=1, shim=SHIM, gateway=gateway) as c:
        assert c.info is not None
        held = hold_prefill_slot(c.info.prefill_urls[0])
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            heavy = [pool.submit(post, c.url, as_tenant("heavy")) for _ in range(4)]
            c.wait_for(lambda: health(c)["queued"] == 4, what="the heavy tenant's backlog")
            # Alone, the heavy tenant may fill the queue; then there is room for nobody: 503.
            full = post(c.url, as_tenant("heavy"))
            assert_error(full, 503, "gateway_overloaded", None)
            # A light tenant is under its share: it takes the place of the heavy tenant's
            # newest request, which is told 429 at once.
            light = pool.submit(post, c.url, as_tenant("light"))
            c.wait_for(lambda: any(f.done() for f in heavy), what="a heavy request displaced")
            displaced = [f.result() for f in heavy if f.done()]
            assert len(displaced) == 1
            assert displaced[0].status_code == 429
            assert displaced[0].json()["error"]["code"] == "tenant_over_share"
            assert 1 <= int(displaced[0].headers["retry-after"]) <= 120
            # Now over its share with another tenant waiting: 429 at once (back off), neither
            # queued nor 503.
            over = post(c.url, as_tenant("heavy"))
            assert over.status_code == 429 and "retry-after" in over.headers
            assert over.json()["error"]["code"] == "tenant_over_share"
            assert health(c)["queued"] == 4
            assert over.json()["error"]["type"] == "rate_limit_error"
            # A second light request still gets in.
            light2 = pool.submit(post, c.url, as_tenant("light"))
            c.wait_for(lambda: sum(f.done() for f in heavy) == 2, what="a second heavy displaced")
            release_prefill_slot(held)
            assert light.result().status_code == 200
            assert light2.result().status_code == 200
            statuses = sorted(f.result().status_code for f in heavy)
            assert statuses == [200, 200, 429, 429]
        c.wait_for(lambda: no_leaks(c))


def test_a_high_priority_request_overtakes_queued_normal_ones() -> None:
    gateway = {"keyless_max_priority": "high", **SLOW_RETRIES}
    # Normal requests take the one-slot prefill about 0.3 s each (5k uncached tokens), so
    # the order they are served in shows in when they finish.
    shim = {**SHIM, "sim_prefix_cache_blocks": 0}
    with ThreadedCluster(prefills=1, decodes=1, shim=shim, gateway=gateway) as c:
        assert c.info is not None
        held = hold_prefill_slot(c.info.prefill_urls[0])
        finished: dict[str, float] = {}

        def timed(name: str, priority: str, prompt: str) -> int:
            resp = post(c.url, {"x-pdgate-priority": priority}, prompt=prompt)
            finished[name] = time.monotonic()
            return resp.status_code

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = []
            for i in range(3):
                futures.append(pool.submit(timed, f"normal{i}", "normal", " ab" * 5000))
                queued = i + 1
                c.wait_for(lambda: health(c)["queued"] == queued)  # noqa: B023 - waited at once
            futures.append(pool.submit(timed, "high", "high", "a short one"))
            c.wait_for(lambda: health(c)["queued"] == 4)
            release_prefill_slot(held)
            assert [f.result() for f in futures] == [200] * 4
        # Queued last, served first.
        assert finished["high"] < min(finished[f"normal{i}"] for i in range(3))
        c.wait_for(lambda: no_leaks(c))


def test_bad_tenant_and_priority_headers_get_an_openai_error(tmp_path: Path) -> None:
    with keyed_cluster(tmp_path, "sk-alice name=alice priority=high\nsk-bob name=bob\n") as c:
        alice = {"authorization": "Bearer sk-alice"}
        bob = {"authorization": "Bearer sk-bob"}
        for value in ("urgent", "", "3", "-1"):
            resp = post(c.url, {**bob, "x-pdgate-priority": value})
            assert_error(resp, 400, None, "x-pdgate-priority")
            assert resp.json()["error"]["type"] == "invalid_request_error"
        for value in ("two words", "x" * 65, "semi;colon"):
            resp = post(c.url, {**bob, "x-pdgate-tenant": value})
            assert_error(resp, 400, None, "x-pdgate-tenant")
        # A key may not raise its class above what it allows, nor act as another tenant.
        assert_error(
            post(c.url, {**bob, "x-pdgate-priority": "high"}), 403, "forbidden", "x-pdgate-priority"
        )
        assert_error(
            post(c.url, {**bob, "x-pdgate-tenant": "alice"}), 403, "forbidden", "x-pdgate-tenant"
        )
        # What it may do passes.
        assert post(c.url, {**alice, "x-pdgate-priority": "high"}).status_code == 200
        assert post(c.url, {**bob, "x-pdgate-priority": "low"}).status_code == 200
        assert post(c.url, {**bob, "x-pdgate-tenant": "bob"}).status_code == 200


def test_without_keys_a_client_may_only_lower_its_priority_by_default() -> None:
    with ThreadedCluster(prefills=1, decodes=1) as c:
        resp = post(c.url, {"x-pdgate-priority": "high"})
        assert_error(resp, 403, "forbidden", "x-pdgate-priority")
        assert "normal" in resp.json()["error"]["message"]
        assert post(c.url, {"x-pdgate-priority": "low", **as_tenant("team-a")}).status_code == 200


# -- the precedence, unit by unit ------------------------------------------------------------


def key(name: str, priority: int = 1, weight: float = 1.0) -> ApiKey:
    return ApiKey(name=name, digest=digest(name), priority=priority, weight=weight)


def resolve(
    k: ApiKey | None, group: int | None = None, keyless_max: int = 1, **headers: str
) -> tuple[str, int, float]:
    found = resolve_tenancy(
        k,
        {f"x-pdgate-{h}": v for h, v in headers.items()},
        group_priority=group,
        keyless_max_priority=keyless_max,
    )
    return found.tenant, found.priority, found.weight


def test_tenant_and_weight_come_from_the_key_else_the_header() -> None:
    assert resolve(None) == ("anonymous", 1, 1.0)
    assert resolve(None, tenant="team-a") == ("team-a", 1, 1.0)
    assert resolve(key("alice", weight=3.0)) == ("alice", 1, 3.0)
    assert resolve(key("alice"), tenant="alice")[0] == "alice"
    with pytest.raises(Forbidden):
        resolve(key("alice"), tenant="bob")


def test_priority_precedence() -> None:
    high, normal, low = 0, 1, 2
    # Default: the group's, else the key's, else normal.
    assert resolve(None)[1] == normal
    assert resolve(key("k", priority=low))[1] == low
    assert resolve(key("k", priority=low), group=high)[1] == high
    assert resolve(None, group=low)[1] == low
    # The header lowers freely.
    assert resolve(key("k", priority=high), priority="low")[1] == low
    assert resolve(None, group=high, priority="normal")[1] == normal
    # And raises up to the most urgent of the default and what the key allows.
    assert resolve(key("k", priority=high), group=low, priority="high")[1] == high
    assert resolve(key("k", priority=normal), group=high, priority="high")[1] == high
    with pytest.raises(Forbidden):
        resolve(key("k", priority=normal), group=low, priority="high")
    # Without keys: up to keyless_max_priority (or the group's default, if more urgent).
    with pytest.raises(Forbidden):
        resolve(None, priority="high")
    assert resolve(None, keyless_max=high, priority="high")[1] == high
    assert resolve(None, group=high, priority="0")[1] == high
    with pytest.raises(BadRequest):
        resolve(None, priority="asap")
