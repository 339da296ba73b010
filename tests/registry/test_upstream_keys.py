"""Credentials towards instances, with real processes: stock OpenAI servers that require an
API key (as ``vllm serve --api-key``), pdgate shims that require the cluster token, and one
gateway fronting them all.

- ``upstream_api_key``: the bearer token sent to every instance (probes included).
- A mixed fleet: shims get the cluster token; a stock server announced by ``pdgate announce``
  is started with the cluster token as its key (one secret for the fleet); a static stock
  server that keeps its own key is declared with ``api_key_env=VAR`` and gets that key, read
  from the gateway's environment. No key is ever written to Redis.
"""

from __future__ import annotations

import time
import uuid

import httpx
import pytest
import redis

from tests._cluster import (
    Subprocess,
    gateway_url,
    get_instances,
    refused,
    registry_env,
    start,
    wait_for,
)
from tests.registry._stock_server import FAST_PROBES, StockServer, completion_text

PROBES = {**FAST_PROBES, "PDGATE_GATEWAY_TTFT_TIMEOUT_S": "20"}
SIM_MODEL = "sim-llama-3.1-8b"


def _keyed(servers: list[StockServer], key: str) -> StockServer:
    server = StockServer(f"stock-{uuid.uuid4().hex[:8]}", api_key=key).start()
    servers.append(server)
    return server


def _complete(url: str, model: str, prompt: str, *, stream: bool = False) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 3, "stream": stream}
    return httpx.post(url + "/v1/completions", json=body, timeout=30)


def test_upstream_api_key_reaches_a_stock_server_that_requires_one(
    procs: list[Subprocess], servers: list[StockServer]
) -> None:
    server = _keyed(servers, "sk-stock-123")
    args = ["gateway", "--port", "0", "--prefill", server.url, "--decode", server.url]
    keyed = start(procs, args, {**PROBES, "PDGATE_GATEWAY_UPSTREAM_API_KEY": "sk-stock-123"})
    url = gateway_url(keyed)
    assert len(get_instances(url)) == 2  # probed with the key: /v1/models answered
    for stream in (False, True):
        resp = _complete(url, server.model, "hello", stream=stream)
        assert resp.status_code == 200, resp.text
    assert server.stats()["unauthorized"] == 0
    assert "sk-stock-123" not in "".join(keyed.lines)  # never logged

    # Without the key the server refuses the gateway, which never lists it.
    bare = gateway_url(start(procs, args, PROBES))
    time.sleep(0.6)
    assert get_instances(bare) == []
    assert server.stats()["unauthorized"] > 0


def test_a_fleet_of_shims_and_keyed_stock_servers_authenticates_each_its_own_way(
    procs: list[Subprocess],
    servers: list[StockServer],
    redis_url: str,
    registry_prefix: str,
) -> None:
    token = f"tok-{uuid.uuid4().hex}"
    env = {**registry_env(redis_url, registry_prefix), "PDGATE_REGISTRY_CLUSTER_TOKEN": token}
    # pdgate shims: they accept the cluster token only.
    shim = ["shim", "--host", "127.0.0.1", "--port", "0"]
    start(procs, [*shim, "--role", "prefill"], env)
    start(procs, [*shim, "--role", "decode"], env)
    # A stock server keyed with the cluster token, announced into the registry.
    announced = _keyed(servers, token)
    for role in ("prefill", "decode"):
        start(
            procs,
            ["announce", "--url", announced.url, "--role", role, "--probe-interval-s", "0.2"],
            {**env, "VLLM_API_KEY": token},
        )
    # A stock server with a key of its own, declared static with the variable that holds it.
    own = _keyed(servers, "sk-own-456")
    spec = f"{own.url} api_key_env=OWN_STOCK_KEY"
    gw = start(
        procs,
        ["gateway", "--port", "0", "--prefill", spec, "--decode", spec],
        {**env, **PROBES, "OWN_STOCK_KEY": "sk-own-456"},
    )
    url = gateway_url(gw)
    wait_for(lambda: len(get_instances(url)) == 6, timeout=15, what="every instance listed")

    for model in (SIM_MODEL, announced.model, own.model):
        for stream in (False, True):
            resp = _complete(url, model, f"to {model}", stream=stream)
            assert resp.status_code == 200, (model, resp.text)
    resp = _complete(url, own.model, "whole")
    assert resp.json()["choices"][0]["text"] == completion_text("whole", 3)
    assert announced.stats()["unauthorized"] == 0
    assert own.stats()["unauthorized"] == 0
    # No secret in the registry: records are signed with the token, never carry a key.
    client = redis.Redis.from_url(redis_url)
    try:
        for key in client.scan_iter(match=f"{registry_prefix}:*"):
            if client.type(key) == b"string":
                value = client.get(key) or b""
                assert token.encode() not in value and b"sk-own-456" not in value
            elif client.type(key) == b"hash":
                for value in client.hvals(key):
                    assert token.encode() not in value and b"sk-own-456" not in value
    finally:
        client.close()


@pytest.mark.parametrize(
    ("spec", "env", "message"),
    [
        ("http://127.0.0.1:9 api_key_env=NOT_SET_ANYWHERE", {}, "NOT_SET_ANYWHERE"),
        ("http://127.0.0.1:9 api_key_env=bad-name", {}, "name of an environment variable"),
    ],
)
def test_a_missing_or_bad_api_key_env_is_one_line_and_exit_2(
    spec: str, env: dict[str, str], message: str
) -> None:
    refused(
        ["gateway", "--port", "0", "--prefill", spec], message, {"PATH": "/usr/bin:/bin", **env}
    )
