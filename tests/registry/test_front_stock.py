"""pdgate in front of servers that are not pdgate shims: real ``pdgate gateway`` processes with
static ``--prefill``/``--decode`` URLs, and real ``pdgate announce`` sidecars in a real Redis,
all in front of `_stock_server` processes (vLLM's handshake, no batch endpoint, never a 429).

The queue-less rule: a stock prefill queues instead of refusing, so the gateway must never
have more requests in it than its declared slots, counted across gateways. The stock server
records the most prefill legs it ever held at once; with capacity 1 that must stay 1.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import orjson
import pytest

from pdgate.config import Role
from pdgate.registry import InstanceRecord, InstanceState, RedisRegistry
from tests._cluster import (
    Subprocess,
    gateway_url,
    get_instances,
    instances_by_id,
    refused,
    registry_env,
    start,
    wait_for,
)
from tests._redis import record_ttl_ms
from tests.gateway.placement._vllm_connectors import ConnectorServer
from tests.registry._stock_server import FAST_PROBES, StockServer, completion_text

PROBES = {
    **FAST_PROBES,
    "PDGATE_GATEWAY_STATIC_DOWN_AFTER": "2",
    "PDGATE_GATEWAY_TTFT_TIMEOUT_S": "30",
}


@pytest.fixture
def model() -> str:
    return f"stock-{uuid.uuid4().hex[:8]}"


def _serve(servers: list[StockServer], model: str, *, prefill_s: float = 0.05) -> StockServer:
    server = StockServer(model, prefill_s=prefill_s).start()
    servers.append(server)
    return server


def _complete(url: str, model: str, prompt: str, *, stream: bool, max_tokens: int = 5) -> str:
    """The completion's text through the gateway (asserting a clean answer)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    if not stream:
        resp = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        text: str = resp.json()["choices"][0]["text"]
        return text
    parts: list[str] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        events = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    for line in events[:-1]:
        event = orjson.loads(line.removeprefix("data: "))
        assert "error" not in event, event
        parts += [c["text"] for c in event["choices"]]
    return "".join(parts)


def _burst(urls: list[str], model: str, clients: int) -> list[str]:
    """`clients` concurrent streaming requests on each gateway; their texts."""
    jobs = [(url, f"burst {i} via {url}") for url in urls for i in range(clients)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(_complete, u, model, p, stream=True) for u, p in jobs]
        texts = [f.result() for f in futures]
    assert texts == [completion_text(p, 5) for _, p in jobs]
    return texts


def _pair(
    servers: list[StockServer], model: str, *, prefill_s: float = 0.05
) -> tuple[StockServer, StockServer]:
    """A stock prefill (each prefill leg takes `prefill_s`) and a stock decode."""
    return _serve(servers, model, prefill_s=prefill_s), _serve(servers, model)


@dataclass(frozen=True)
class Shared:
    """The Redis registry of a test's processes: their settings for it, and what is in it."""

    url: str
    prefix: str

    def env(self, **timing: float) -> dict[str, str]:
        return registry_env(self.url, self.prefix, **timing)

    def records(self) -> dict[str, InstanceRecord]:
        async def read() -> dict[str, InstanceRecord]:
            reg = RedisRegistry(self.url, key_prefix=self.prefix, connect_timeout_s=1.0)
            try:
                return {r.id: r for r in await reg.snapshot()}
            finally:
                await reg.aclose()

        return asyncio.run(read())


@pytest.fixture
def shared(redis_url: str, registry_prefix: str) -> Shared:
    return Shared(redis_url, registry_prefix)


# --- static --prefill / --decode -------------------------------------------------------------


def test_static_gateway_serves_a_stock_pair_with_the_model_from_v1_models(
    procs: list[Subprocess], servers: list[StockServer], model: str
) -> None:
    prefill, decode = _pair(servers, model)
    gw = start(
        procs, ["gateway", "--port", "0", "--prefill", prefill.url, "--decode", decode.url], PROBES
    )
    url = gateway_url(gw)
    # Both live servers are in the first view: start-up waited for the first probe round.
    rows = instances_by_id(url)
    assert {r["id"]: (r["role"], r["model"], r["capacity"], r["state"]) for r in rows.values()} == {
        f"prefill@127.0.0.1:{prefill.port}": ("prefill", model, 8, "ready"),
        f"decode@127.0.0.1:{decode.port}": ("decode", model, 64, "ready"),
    }
    assert [m["id"] for m in httpx.get(url + "/v1/models", timeout=5).json()["data"]] == [model]
    for stream in (False, True):
        prompt = f"hello stock, stream={stream}"
        assert _complete(url, model, prompt, stream=stream) == completion_text(prompt, 5)
    stats = decode.stats()
    # The decode got the prefill's kv_transfer_params on every request (the handshake).
    assert stats["decode_legs"] == stats["decode_with_kv"] == 2
    assert prefill.stats()["prefill_legs"] == 2


@pytest.mark.parametrize(("capacity", "clients"), [(4, 16), (1, 8)])
def test_queueless_rule_holds_for_a_queueing_static_prefill(
    procs: list[Subprocess], servers: list[StockServer], model: str, capacity: int, clients: int
) -> None:
    """The stock server would take every request at once (it never refuses): the gateway
    keeps it to its declared slots, in batches of single calls (a new batch as soon as it
    computes nothing, into the slots the last one's KV has left)."""
    prefill, decode = _pair(servers, model, prefill_s=0.2)
    args = ["gateway", "--port", "0", "--prefill", f"{prefill.url} capacity={capacity}"]
    url = gateway_url(start(procs, [*args, "--decode", decode.url], PROBES))
    _burst([url], model, clients)
    stats = prefill.stats()
    # A stock server declares no pdgate extension: never a batch call, only vLLM's handshake.
    assert stats["not_found"] == {}
    assert stats["prefill_legs"] == clients
    assert min(capacity, 2) <= stats["prefill_max"] <= capacity


def _see_each_other(urls: list[str]) -> None:
    """Until every gateway's last sync saw the others. Alone, a gateway counts the slots
    itself (docs/fleet.md, "What it costs": until they have synced, a prefill that queues
    may get one request past its slots)."""
    for url in urls:
        wait_for(
            lambda u=url: (
                httpx.get(u + "/health", timeout=5).json()["fleet"]["gateways"] == len(urls)
            ),
            10,
            "the gateways see each other",
        )


def test_queueless_rule_holds_across_two_gateways_on_one_redis(
    procs: list[Subprocess], servers: list[StockServer], model: str, shared: Shared
) -> None:
    prefill, decode = _pair(servers, model, prefill_s=0.2)
    env = {**shared.env(), **PROBES}
    args = ["gateway", "--port", "0", "--prefill", f"{prefill.url} capacity=1"]
    args += ["--decode", decode.url]
    urls = [gateway_url(start(procs, args, env)) for _ in range(2)]
    for url in urls:
        assert httpx.get(url + "/health", timeout=5).json()["fleet"]["shared"] is True
    _see_each_other(urls)
    _burst(urls, model, 8)
    stats = prefill.stats()
    assert stats["prefill_legs"] == 16
    # The same static id on both gateways: one slot, leased fleet-wide.
    assert stats["prefill_max"] == 1


def test_a_static_instance_that_dies_leaves_the_view_and_comes_back(
    procs: list[Subprocess], servers: list[StockServer], model: str
) -> None:
    prefill, decode = _pair(servers, model)
    env = {**PROBES, "PDGATE_GATEWAY_TTFT_TIMEOUT_S": "1"}
    args = ["gateway", "--port", "0", "--prefill", prefill.url, "--decode", decode.url]
    url = gateway_url(start(procs, args, env))
    pid = f"prefill@127.0.0.1:{prefill.port}"
    assert _complete(url, model, "before", stream=False) == completion_text("before", 5)
    prefill.kill()
    wait_for(
        lambda: instances_by_id(url)[pid]["state"] == "draining", 5, "the dead prefill drained"
    )
    # No prefill takes requests now: a clean 503 (status first), not a hang or a 502.
    resp = httpx.post(
        url + "/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2}, timeout=10
    )
    assert resp.status_code == 503, resp.text
    servers.append(StockServer(model, port=prefill.port).start())
    wait_for(lambda: instances_by_id(url)[pid]["state"] == "ready", 5, "the prefill back")
    assert _complete(url, model, "after", stream=True) == completion_text("after", 5)


def test_a_static_instance_dead_at_start_up_joins_when_it_starts(
    procs: list[Subprocess], servers: list[StockServer], model: str
) -> None:
    from tests._redis import free_port

    port = free_port()
    decode = _serve(servers, model)
    args = ["gateway", "--port", "0", "--prefill", f"http://127.0.0.1:{port}"]
    # Start-up is not held by the dead server: ready and serving without it.
    url = gateway_url(start(procs, [*args, "--decode", decode.url], PROBES))
    assert set(instances_by_id(url)) == {f"decode@127.0.0.1:{decode.port}"}
    servers.append(StockServer(model, port=port).start())
    wait_for(lambda: len(instances_by_id(url)) == 2, 5, "the late prefill listed")
    assert _complete(url, model, "late", stream=False) == completion_text("late", 5)


def test_bad_static_instance_is_one_line_and_exit_2() -> None:
    out = refused(["gateway", "--prefill", "http://a:1 size=3"], "key one of capacity, group")
    assert "size=3" in out.stderr


# --- pdgate announce -------------------------------------------------------------------------


def _announce(
    procs: list[Subprocess],
    server: StockServer | ConnectorServer,
    role: Role,
    env: dict[str, str],
    *extra: str,
) -> Subprocess:
    args = ["announce", "--url", server.url, "--role", role.value, "--probe-interval-s", "0.2"]
    return start(procs, [*args, "--probe-timeout-s", "0.5", *extra], env)


def test_announce_registers_heartbeats_drains_and_deregisters(
    procs: list[Subprocess], servers: list[StockServer], model: str, shared: Shared
) -> None:
    prefill, decode = _pair(servers, model)
    env = shared.env(ttl=1.0, heartbeat=0.25)
    p_side = _announce(procs, prefill, Role.PREFILL, env, "--capacity", "2", "--drain-s", "30")
    _announce(procs, decode, Role.DECODE, env, "--group", "default")
    pid, did = f"prefill@127.0.0.1:{prefill.port}", f"decode@127.0.0.1:{decode.port}"
    wait_for(lambda: set(shared.records()) == {pid, did}, 10, "registered")
    records = shared.records()
    assert (records[pid].model, records[pid].capacity, records[pid].version) == (
        model,
        2,
        "announced",
    )
    assert (records[did].role, records[did].capacity) == (Role.DECODE, 64)
    # Heartbeats: alive well past the 1 s TTL.
    time.sleep(1.5)
    assert set(shared.records()) == {pid, did}

    url = gateway_url(start(procs, ["gateway", "--port", "0"], env))
    wait_for(lambda: len(get_instances(url)) == 2, 5, "the gateway sees both")
    for stream in (True, False):
        assert _complete(url, model, f"hi {stream}", stream=stream) == completion_text(
            f"hi {stream}", 5
        )

    # The decode's /health fails: no more heartbeats, the record goes, and returns with it.
    decode.set_health(False)
    wait_for(lambda: did not in shared.records(), 5, "unhealthy deregistered")
    wait_for(lambda: did not in instances_by_id(url), 5, "the gateway dropped it")
    decode.set_health(True)
    wait_for(lambda: did in shared.records(), 5, "healthy registered again")

    # SIGTERM: draining (in Redis and at the gateway) while the server answers ...
    p_side.proc.send_signal(signal.SIGTERM)
    wait_for(
        lambda: shared.records()[pid].state is InstanceState.DRAINING,
        5,
        "draining",
    )
    wait_for(
        lambda: instances_by_id(url)[pid]["state"] == "draining", 5, "the gateway sees it draining"
    )
    assert p_side.proc.poll() is None
    # ... until the server stops; then the record is removed and the sidecar exits.
    prefill.kill()
    assert p_side.proc.wait(10) == 0
    assert pid not in shared.records()


def test_announce_registers_what_the_server_serves_and_follows_its_adapters(
    procs: list[Subprocess], servers: list[StockServer], model: str, shared: Shared
) -> None:
    server = StockServer(model, max_model_len=4096, loras=(f"{model}-a",)).start()
    servers.append(server)
    _announce(procs, server, Role.AGGREGATED, shared.env(ttl=1.0, heartbeat=0.25))
    sid = f"aggregated@127.0.0.1:{server.port}"
    wait_for(lambda: sid in shared.records(), 10, "registered")
    record = shared.records()[sid]
    assert (record.max_model_len, record.adapters) == (4096, (f"{model}-a",))
    assert record.endpoints == ("/tokenize", "/detokenize")
    server.load_lora(f"{model}-b")
    wait_for(lambda: shared.records()[sid].adapters == (f"{model}-a", f"{model}-b"), 5, "loaded")
    server.unload_lora(f"{model}-a")
    wait_for(lambda: shared.records()[sid].adapters == (f"{model}-b",), 5, "unloaded")


def test_announce_names_the_connector_and_a_mooncake_prefills_engines(
    procs: list[Subprocess], model: str, shared: Shared
) -> None:
    prefill = ConnectorServer("mooncake", "prefill", model, engine_id="engine-9").start()
    decode = ConnectorServer("nixl_push", "decode", model).start()
    try:
        env = shared.env(ttl=1.0, heartbeat=0.25)
        args = ["--connector", "mooncake", "--bootstrap", prefill.side]
        _announce(procs, prefill, Role.PREFILL, env, *args)
        _announce(procs, decode, Role.DECODE, env, "--connector", "nixl_push")
        pid, did = f"prefill@127.0.0.1:{prefill.port}", f"decode@127.0.0.1:{decode.port}"
        wait_for(lambda: set(shared.records()) == {pid, did}, 10, "registered")
        records = shared.records()
        assert (records[pid].connector, records[pid].kv_engines) == ("mooncake", ("engine-9",))
        assert records[pid].kv_bootstrap == f"http://{prefill.side}"
        assert (records[did].connector, records[did].kv_bootstrap) == ("nixl_push", "")
    finally:
        prefill.kill()
        decode.kill()
    refused(
        ["announce", "--url", "http://127.0.0.1:9", "--role", "prefill", "--connector", "p2p"],
        "connector",
        env={"PATH": "/usr/bin:/bin", "PDGATE_REGISTRY_URL": "redis://127.0.0.1:9/0"},
    )


def test_a_killed_announce_sidecar_lets_the_record_expire(
    procs: list[Subprocess], servers: list[StockServer], model: str, shared: Shared
) -> None:
    server = _serve(servers, model)
    env = shared.env(ttl=1.0, heartbeat=0.25)
    side = _announce(procs, server, Role.PREFILL, env, "--instance-id", "stock-p1")
    wait_for(lambda: "stock-p1" in shared.records(), 10, "registered")
    # The record lives the TTL (1 s) past its last heartbeat, without any later clean-up.
    assert 0 < record_ttl_ms(shared.url, shared.prefix, "stock-p1") <= 1000
    side.kill()
    wait_for(lambda: not shared.records(), 5, "expired")


def test_announce_drain_ends_at_drain_s_while_the_server_keeps_answering(
    procs: list[Subprocess], servers: list[StockServer], model: str, shared: Shared
) -> None:
    server = _serve(servers, model)
    env = shared.env()
    side = _announce(procs, server, Role.DECODE, env, "--drain-s", "1", "--model", model)
    wait_for(lambda: len(shared.records()) == 1, 10, "registered")
    started = time.monotonic()
    assert side.terminate(timeout=10) == 0
    assert time.monotonic() - started >= 0.9  # it drained for its drain_s
    assert not shared.records()


def test_queueless_rule_holds_for_an_announced_prefill_across_two_gateways(
    procs: list[Subprocess], servers: list[StockServer], model: str, shared: Shared
) -> None:
    prefill, decode = _pair(servers, model, prefill_s=0.2)
    env = shared.env()
    _announce(procs, prefill, Role.PREFILL, env, "--capacity", "1")
    _announce(procs, decode, Role.DECODE, env)
    gw_env = {**env, "PDGATE_GATEWAY_TTFT_TIMEOUT_S": "30"}
    urls = [gateway_url(start(procs, ["gateway", "--port", "0"], gw_env)) for _ in range(2)]
    for url in urls:
        wait_for(lambda u=url: len(get_instances(u)) == 2, 10, "both announced servers seen")
    _see_each_other(urls)
    _burst(urls, model, 8)
    stats = prefill.stats()
    assert stats["prefill_legs"] == 16
    assert stats["prefill_max"] == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--url", "http://127.0.0.1:9", "--role", "prefill"], "needs a shared registry"),
        (["--role", "prefill", "--registry-url", "redis://127.0.0.1:9/0"], "--url and --role"),
        (
            ["--url", "ftp://x", "--role", "decode", "--registry-url", "redis://127.0.0.1:9/0"],
            "expected http://host:port",
        ),
    ],
)
def test_announce_bad_input_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    refused(["announce", *args], message, env={"PATH": "/usr/bin:/bin"})
