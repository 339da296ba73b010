"""Shim credentials and KV sources, through real ``pdgate`` processes on a real Redis.

* With the registry's cluster token set, a shim answers its request paths (completions,
  chat, batch, ``GET``/``DELETE /v1/kv/{id}``) only to callers that present it (401 with an
  OpenAI error body otherwise); ``/health``, ``/load`` and ``/metrics`` stay open. A gateway
  with the token serves completions and chat through them; the decode's KV pulls carry it.
* A decode pulls KV only from prefills registered in its registry: ``kv_transfer_params``
  naming any other host and port get 400 (``unknown_kv_source``) and no connection is made;
  the same params once that address is a registered prefill are pulled from.
* ``pdgate up`` gives its shims a generated token; a shim on a non-loopback address without
  a token refuses to start unless ``allow_unauthenticated``.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from pdgate.config import Role
from pdgate.registry import InstanceRecord, RedisRegistry
from pdgate.registry.signing import RecordSigner, SigningRegistry
from tests._cluster import Subprocess, gateway_url, get_instances, registry_env, wait_for

TOKEN = "cluster-secret-for-tests"
MODEL = "sim-llama-3.1-8b"
PROMPT = "Tell me about prefill and decode disaggregation."


def _shim_url(proc: Subprocess) -> str:
    line = next(line for line in proc.lines if line.startswith("pdgate shim"))
    return line.rsplit(" ", 1)[1].strip()


@dataclass
class Fleet:
    gateway: str
    prefill: str
    decode: str
    env: dict[str, str]


@pytest.fixture
def fleet(redis_url: str, registry_prefix: str, procs: list[Subprocess]) -> Fleet:
    env = {**registry_env(redis_url, registry_prefix), "PDGATE_REGISTRY_CLUSTER_TOKEN": TOKEN}
    prefill = Subprocess(["shim", "--role", "prefill", "--port", "0"], env=env)
    procs.append(prefill)
    decode = Subprocess(["shim", "--role", "decode", "--port", "0"], env=env)
    procs.append(decode)
    gateway = Subprocess(["gateway", "--port", "0"], env=env)
    procs.append(gateway)
    url = gateway_url(gateway)
    wait_for(lambda: len(get_instances(url)) == 2, what="both shims registered")
    return Fleet(url, _shim_url(prefill), _shim_url(decode), env)


def _prefill_body(**extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
        **extra,
    }


def _auth(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def _assert_401(resp: httpx.Response) -> None:
    assert resp.status_code == 401, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "invalid_api_key"
    assert TOKEN not in resp.text


def test_shims_refuse_callers_without_the_cluster_token(fleet: Fleet) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for headers in ({}, _auth("wrong-token"), {"authorization": TOKEN}):  # none, wrong, no scheme
        _assert_401(httpx.post(fleet.prefill + "/v1/completions", json=_prefill_body(),
                               headers=headers))  # fmt: skip
        _assert_401(
            httpx.post(
                fleet.prefill + "/v1/chat/completions",
                json={**chat, "kv_transfer_params": {"do_remote_decode": True}},
                headers=headers,
            )
        )
        _assert_401(httpx.post(fleet.prefill + "/v1/completions/batch",
                               json={"requests": [_prefill_body()]}, headers=headers))  # fmt: skip
        _assert_401(httpx.post(fleet.decode + "/v1/completions", json={}, headers=headers))
        _assert_401(httpx.post(fleet.decode + "/v1/chat/completions", json=chat, headers=headers))

    # KV held for a caller with the token cannot be read or dropped without it.
    held = httpx.post(fleet.prefill + "/v1/completions", json=_prefill_body(),
                      headers=_auth(TOKEN))  # fmt: skip
    assert held.status_code == 200, held.text
    kv_id = held.json()["kv_transfer_params"]["remote_request_id"]
    _assert_401(httpx.get(f"{fleet.prefill}/v1/kv/{kv_id}"))
    _assert_401(httpx.delete(f"{fleet.prefill}/v1/kv/{kv_id}", headers=_auth("nope")))
    load = httpx.get(fleet.prefill + "/load").json()
    assert (load["kv_held"], load["used"]) == (1, 1)
    # With the token, the release goes through and frees the slot.
    assert httpx.delete(f"{fleet.prefill}/v1/kv/{kv_id}", headers=_auth(TOKEN)).status_code == 204
    assert httpx.get(fleet.prefill + "/load").json()["used"] == 0

    # Probes and scrapers need no token (they carry counts, never request content).
    for url in (fleet.prefill, fleet.decode):
        for path in ("/health", "/load", "/metrics"):
            assert httpx.get(url + path).status_code == 200, path


def test_a_gateway_with_the_token_serves_completions_and_chat(fleet: Fleet) -> None:
    client = openai.OpenAI(base_url=fleet.gateway + "/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6)
    assert out.usage is not None and out.usage.completion_tokens == 6
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=5
    )
    assert chat.choices[0].message.content
    # Both KV pulls reached the prefill, with the token: nothing was refused or left behind.
    load = httpx.get(fleet.prefill + "/load").json()
    assert (load["kv_fetched"], load["kv_held"]) == (2, 0)


class Listener:
    """A TCP server that counts connections and keeps the first request head it gets."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.heads: list[bytes] = []
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                conn.settimeout(2)
                try:
                    self.heads.append(conn.recv(65536))
                    conn.sendall(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    server = Listener()
    yield server
    server.close()


def test_the_decode_pulls_kv_only_from_registered_prefills(
    fleet: Fleet, listener: Listener, redis_url: str, registry_prefix: str
) -> None:
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_host": "127.0.0.1",
        "remote_port": listener.port,
        "remote_request_id": "0123456789abcdef",
    }
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": params}
    resp = httpx.post(fleet.decode + "/v1/completions", json=body, headers=_auth(TOKEN), timeout=10)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "unknown_kv_source"
    time.sleep(0.3)
    assert listener.connections == 0  # refused before any connection was made
    assert httpx.get(fleet.decode + "/load").json()["used"] == 0

    # Once that address is a registered prefill (signed with the cluster token), the same
    # params are pulled from: it is the registry that decides, and the pull carries the token.
    async def register() -> None:
        registry = SigningRegistry(
            RedisRegistry(redis_url, key_prefix=registry_prefix), RecordSigner(TOKEN)
        )
        record = InstanceRecord(
            id="listener", role=Role.PREFILL, url=f"http://127.0.0.1:{listener.port}", model=MODEL
        )
        try:
            await registry.put(record, ttl_s=30, announce=True)
        finally:
            await registry.aclose()

    asyncio.run(register())
    resp = httpx.post(fleet.decode + "/v1/completions", json=body, headers=_auth(TOKEN), timeout=10)
    assert resp.status_code == 502, resp.text  # the listener is no prefill: the pull failed
    assert resp.json()["error"]["code"] == "kv_transfer_failed"
    assert listener.connections >= 1
    head = listener.heads[0].decode("latin-1").lower()
    assert head.startswith("get /v1/kv/0123456789abcdef ")
    assert f"authorization: bearer {TOKEN}".lower() in head

    # Another spelling of the same endpoint is pulled from as checked, not as spelt; a port
    # Python's int() would read but that is no port is refused.
    for host in (" 127.0.0.1\t", "[127.0.0.1]"):
        seen = listener.connections
        spelt = {**body, "kv_transfer_params": {**params, "remote_host": host}}
        resp = httpx.post(fleet.decode + "/v1/completions", json=spelt, headers=_auth(TOKEN))
        assert resp.json()["error"]["code"] == "kv_transfer_failed", resp.text
        assert listener.connections > seen
    port = "_".join(str(listener.port))
    odd = {**body, "kv_transfer_params": {**params, "remote_port": port}}
    resp = httpx.post(fleet.decode + "/v1/completions", json=odd, headers=_auth(TOKEN))
    assert resp.status_code == 400, resp.text


def test_pdgate_up_gives_its_shims_a_generated_token(procs: list[Subprocess]) -> None:
    up = Subprocess(["up", "--port", "0", "--prefills", "1", "--decodes", "1"])
    procs.append(up)
    line = next(line for line in up.lines if line.startswith("pdgate up"))
    url = next(word for word in line.split() if word.startswith("http://"))
    base = url.removesuffix("/v1")
    wait_for(lambda: len(get_instances(base)) == 2, what="shims registered")
    shims = {r["role"]: r["url"] for r in get_instances(base)}
    resp = httpx.post(shims["prefill"] + "/v1/completions", json=_prefill_body())
    assert resp.status_code == 401, resp.text
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=3
    )
    assert out.usage is not None and out.usage.completion_tokens == 3


def _run_shim(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdgate.config.cli", "shim", "--host", "0.0.0.0", "--port", "0",
         "--advertise-url", "http://10.0.0.1:1"],
        env=env, capture_output=True, text=True, timeout=30,
    )  # fmt: skip


def test_a_shim_beyond_loopback_needs_a_token_or_an_explicit_opt_out(
    procs: list[Subprocess],
) -> None:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("PDGATE_")}
    refused = _run_shim(env)
    assert refused.returncode == 2, refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "without a cluster token" in lines[0], refused.stderr

    opted_out = Subprocess(
        ["shim", "--host", "0.0.0.0", "--port", "0", "--advertise-url", "http://127.0.0.1:1"],
        env={**env, "PDGATE_SHIM_ALLOW_UNAUTHENTICATED": "true"},
    )
    procs.append(opted_out)
    assert any("WITHOUT a cluster token" in line for line in opted_out.lines), opted_out.lines
