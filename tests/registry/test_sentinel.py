"""A replicated Redis behind Sentinel: the URL, and the registry and the fleet following its
primary through a failover (real redis-server processes: a primary, a replica and three
sentinels)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from pdgate.config import RegistrySettings, Role
from pdgate.registry import open_registry
from pdgate.registry._redis_url import parse_sentinel_url
from pdgate.registry.base import InstanceRecord, RegistryUnavailable
from pdgate.registry.fleet import Candidate, RedisFleet
from pdgate.registry.redis import RedisRegistry
from tests._cluster import (
    SIM_MODEL,
    Processes,
    Subprocess,
    registry_env,
    wait_for,
    wait_instances,
)
from tests._redis import SentinelGroup


def test_a_sentinel_url_names_the_sentinels_the_service_and_the_nodes_options() -> None:
    url = (
        "redis+sentinel://:p%40ss@h1:26380,h2,[::1]:26381/main/2"
        "?sentinel_password=s3cret&socket_keepalive=true"
    )
    parsed = parse_sentinel_url(url)
    assert parsed.sentinels == (("h1", 26380), ("h2", 26379), ("::1", 26381))
    assert parsed.service == "main"
    assert parsed.node["password"] == "p@ss" and parsed.node["db"] == 2
    assert parsed.node["socket_keepalive"] is True
    assert parsed.sentinel == {"password": "s3cret"}  # the sentinels' own, not the nodes'
    tls = parse_sentinel_url("rediss+sentinel://u:pw@h/svc?ssl_ca_certs=/ca.pem")
    assert tls.node["ssl"] is True and tls.node["username"] == "u" and tls.node["db"] == 0
    assert tls.sentinel == {"ssl": True, "ssl_ca_certs": "/ca.pem"}


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+sentinel://:pw@h1:26379", "service"),
        ("redis+sentinel://:pw@/svc", "at least one sentinel"),
        ("redis+sentinel://:pw@h1:port/svc", "not a number"),
        ("redis+sentinel://:pw@h1:0/svc", "out of range"),
    ],
)
def test_a_malformed_sentinel_url_is_refused_without_its_password(url: str, says: str) -> None:
    with pytest.raises(ValueError, match=says) as caught:
        open_registry(RegistrySettings(url=url))
    assert "pw" not in str(caught.value)


async def _retry(call, timeout_s: float = 10.0):  # type: ignore[no-untyped-def]
    """`call()` until it stops raising `RegistryUnavailable` (a failover in progress)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await call()
        except RegistryUnavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def test_the_registry_and_the_fleet_follow_the_primary_through_a_failover(
    sentinel_group: SentinelGroup,
) -> None:
    registry = RedisRegistry(sentinel_group.url, key_prefix="s")
    fleet = RedisFleet(sentinel_group.url, key_prefix="s", gateway_id="g")
    record = InstanceRecord(id="p0", role=Role.PREFILL, url="http://p0", model="m", capacity=2)
    try:
        await registry.put(record, ttl_s=30)
        assert [r.id for r in await registry.snapshot()] == ["p0"]
        grant = await fleet.acquire("m|", [Candidate("p0", 2)], 1, head_in_ms=None,
                                    next_head_in_ms=None)  # fmt: skip
        assert grant.instance_id == "p0"
        old = sentinel_group.primary.port
        new = await asyncio.to_thread(sentinel_group.fail_over)
        assert new.port != old
        # The same clients, no restart: their next connections go to the new primary.
        await _retry(lambda: registry.put(record, ttl_s=30))
        assert [r.id for r in await registry.snapshot()] == ["p0"]
        again = await _retry(
            lambda: fleet.acquire(
                "m|", [Candidate("p0", 2)], 1, head_in_ms=None, next_head_in_ms=None
            )
        )
        assert again.instance_id == "p0"
    finally:
        await registry.aclose()
        await fleet.aclose()


def test_a_gateway_and_its_shims_keep_serving_through_a_failover(
    sentinel_group: SentinelGroup, procs: list[Subprocess]
) -> None:
    processes = Processes(procs, registry_env(sentinel_group.url, "pdgate-sentinel"))
    processes.shim("prefill", "--capacity", "2")
    processes.shim("decode", "--capacity", "8")
    url = processes.gateway()
    wait_instances(url, 2)

    def complete(prompt: str) -> tuple[int, str]:
        body = {"model": SIM_MODEL, "prompt": prompt, "max_tokens": 4}
        resp = httpx.post(url + "/v1/completions", json=body, timeout=30)
        return resp.status_code, resp.text

    assert complete("before")[0] == 200
    sentinel_group.fail_over()
    # Served from the gateway's last view while the sentinels promote the replica...
    status, text = complete("during")
    assert status == 200, text
    # ...and the fleet is back on the new primary, with both shims registered there.
    wait_for(
        lambda: httpx.get(url + "/health", timeout=5).json()["fleet"]["degraded"] is False,
        timeout=10,
        what="the fleet on the new primary",
    )

    async def count() -> int:
        # A client per try: each try runs on an event loop of its own, and a client's pooled
        # connections belong to the loop they were opened on.
        new = RedisRegistry(sentinel_group.url, key_prefix="pdgate-sentinel")
        try:
            return len(await new.snapshot())
        finally:
            await new.aclose()

    def registered() -> int:
        try:
            return asyncio.run(count())
        except RegistryUnavailable:
            return -1  # this fresh client's sentinels may still be agreeing on the primary

    wait_for(lambda: registered() == 2, timeout=10, what="the shims registered on the new primary")
    assert complete("after")[0] == 200
