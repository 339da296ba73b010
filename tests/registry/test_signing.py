"""Signed registry records: with a cluster token, a record written straight into Redis (by
anyone with write access but without the token) is never listed, so it can receive nothing."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from pdgate.config import RegistrySettings, Role
from pdgate.registry import InstanceRecord, RedisRegistry, open_registry
from pdgate.registry.signing import RecordSigner
from tests._cluster import Subprocess, gateway_url, get_instances, registry_env, start, wait_for
from tests._tools import free_port

RECORD = InstanceRecord(id="p1", role=Role.PREFILL, url="http://10.0.0.1:8100", model="m")


def test_signatures_survive_json_and_catch_any_change() -> None:
    signer = RecordSigner("token-a")
    signed = signer.sign(RECORD)
    assert signer.verify(InstanceRecord.from_json(signed.to_json()))
    assert not signer.verify(RECORD)  # unsigned
    from dataclasses import replace

    assert not signer.verify(replace(signed, url="http://evil:80"))
    assert not RecordSigner("token-b").verify(signed)
    # Declared extensions are signed too: nobody can make a stock server look like a shim.
    shim = signer.sign(replace(RECORD, extensions=("batch_prefill",)))
    assert shim.extensions == ("batch_prefill",)
    assert signer.verify(InstanceRecord.from_json(shim.to_json()))
    assert not signer.verify(replace(shim, extensions=()))
    # So is the declared hardware, which the ratio advice trusts; a record without it signs
    # as records did before the field existed.
    l40s = signer.sign(replace(RECORD, hardware="l40s/tp2"))
    assert signer.verify(InstanceRecord.from_json(l40s.to_json()))
    assert not signer.verify(replace(l40s, hardware="h100"))
    assert signed.signature == signer.sign(replace(RECORD, hardware="")).signature
    # And where its KV events are: a forged endpoint would feed the gateways a false cache.
    events = signer.sign(replace(RECORD, kv_events="tcp://10.0.0.5:5557"))
    assert signer.verify(InstanceRecord.from_json(events.to_json()))
    assert not signer.verify(replace(events, kv_events="tcp://10.6.6.6:5557"))
    assert signed.signature == signer.sign(replace(RECORD, kv_events="")).signature
    # And what the engine reports of its model: a forged adapter list would draw requests
    # for an adapter to a server that does not hold it; a forged limit would refuse prompts.
    served = signer.sign(
        replace(RECORD, max_model_len=2048, adapters=("m-lora",), endpoints=("/tokenize",))
    )
    again = InstanceRecord.from_json(served.to_json())
    assert again == served and signer.verify(again)
    assert not signer.verify(replace(served, max_model_len=4096))
    assert not signer.verify(replace(served, adapters=("m-lora", "other")))
    assert not signer.verify(replace(served, endpoints=("/tokenize", "/v1/embeddings")))
    unset = replace(RECORD, max_model_len=0, adapters=(), endpoints=())
    assert signed.signature == signer.sign(unset).signature


def test_records_written_before_the_model_fields_parse() -> None:
    raw = RECORD.to_dict()
    for later in ("max_model_len", "adapters", "endpoints"):
        del raw[later]
    old = InstanceRecord.from_dict(raw)
    assert (old.max_model_len, old.adapters, old.endpoints) == (0, (), ())


def test_bad_model_fields_are_refused() -> None:
    raw = RECORD.to_dict()
    for bad in (-1, 1.5, "2048", True, 1 << 40):
        with pytest.raises(ValueError, match="max_model_len"):
            InstanceRecord.from_dict({**raw, "max_model_len": bad})
    for bad in ("m-lora", ["x"] * 257, [""], ["y" * 257], [3]):
        with pytest.raises(ValueError, match="adapters"):
            InstanceRecord.from_dict({**raw, "adapters": bad})
    for bad in ("/tokenize", ["tokenize"], ["/x"] * 33, ["/" + "y" * 64]):
        with pytest.raises(ValueError, match="endpoint"):
            InstanceRecord.from_dict({**raw, "endpoints": bad})


def test_the_connector_fields_are_signed_and_older_records_parse() -> None:
    from dataclasses import replace

    signer = RecordSigner("token-a")
    # A forged connector or bootstrap server would send decodes to pull KV from elsewhere.
    mooncake = signer.sign(
        replace(
            RECORD,
            connector="mooncake",
            kv_bootstrap="http://10.0.0.1:8998",
            kv_engines=("engine-a", "engine-b"),
        )
    )
    again = InstanceRecord.from_json(mooncake.to_json())
    assert again == mooncake and signer.verify(again)
    assert not signer.verify(replace(mooncake, connector="nixl"))
    assert not signer.verify(replace(mooncake, kv_bootstrap="http://10.6.6.6:8998"))
    assert not signer.verify(replace(mooncake, kv_engines=("engine-x", "engine-b")))
    unset = replace(RECORD, connector="", kv_bootstrap="", kv_engines=())
    assert signer.sign(RECORD).signature == signer.sign(unset).signature
    raw = RECORD.to_dict()
    for later in ("connector", "kv_bootstrap", "kv_engines"):
        del raw[later]
    old = InstanceRecord.from_dict(raw)
    assert (old.connector, old.kv_bootstrap, old.kv_engines) == ("", "", ())


def test_what_a_record_names_as_its_connector() -> None:
    from dataclasses import replace

    # Named: as named, even one this version does not know (it pairs only with its kind).
    assert replace(RECORD, connector="nixl_push").kv_connector == "nixl_push"
    assert InstanceRecord.from_dict({**RECORD.to_dict(), "connector": "moriio"}).kv_connector
    # Unnamed: a shim from before the field (it declares extensions), else a stock server.
    assert replace(RECORD, extensions=("batch_prefill",)).kv_connector == "pdgate"
    assert RECORD.kv_connector == ""


def test_bad_connector_fields_are_refused() -> None:
    raw = RECORD.to_dict()
    for bad in ("NIXL", "x" * 33, "a-b", 3):
        with pytest.raises(ValueError, match="connector"):
            InstanceRecord.from_dict({**raw, "connector": bad})
    for bad in ("10.0.0.1:8998", "ftp://x", "http://" + "x" * 256, 5):
        with pytest.raises(ValueError, match="kv_bootstrap"):
            InstanceRecord.from_dict({**raw, "kv_bootstrap": bad})
    for bad in ("engine", [""], ["e"] * 65, ["x" * 129], ["bad\n"]):
        with pytest.raises(ValueError, match="kv_engines"):
            InstanceRecord.from_dict({**raw, "kv_engines": bad})


def test_bad_extension_lists_are_refused() -> None:
    raw = RECORD.to_dict()
    for bad in ("batch_prefill", ["x"] * 17, [""], ["y" * 65]):
        with pytest.raises(ValueError, match="extension"):
            InstanceRecord.from_dict({**raw, "extensions": bad})
    for hardware in ("H100", "a" * 65, "l40s tp2", 3):
        with pytest.raises(ValueError, match="hardware"):
            InstanceRecord.from_dict({**raw, "hardware": hardware})
    for endpoint in ("tcp://*:5557", "redis://x:1", 5557):
        with pytest.raises(ValueError, match="kv_events"):
            InstanceRecord.from_dict({**raw, "kv_events": endpoint})


async def test_a_reader_with_the_token_drops_records_without_it(
    redis_url: str, registry_prefix: str
) -> None:
    settings = RegistrySettings(url=redis_url, key_prefix=registry_prefix, cluster_token="tok")
    signed_writer, reader = open_registry(settings), open_registry(settings)
    forger = RedisRegistry(redis_url, key_prefix=registry_prefix)
    try:
        events = reader.events()
        await events.wait_subscribed()  # type: ignore[attr-defined]
        await forger.put(InstanceRecord(id="forged", role=Role.PREFILL, url="x", model="m"), 10,
                         announce=True)  # fmt: skip
        await signed_writer.put(RECORD, 10, announce=True)
        assert [r.id for r in await reader.snapshot()] == ["p1"]
        first = await asyncio.wait_for(events.__anext__(), 2)
        assert first.instance_id == "p1"  # the forged JOIN was filtered out
        await events.aclose()  # type: ignore[attr-defined]
    finally:
        for r in (signed_writer, reader, forger):
            await r.aclose()


@pytest.fixture
def collector() -> Iterator[tuple[str, list[str]]]:
    """A server that would gladly 'prefill' other clients' prompts (it records them)."""
    seen: list[str] = []

    async def completions(request: Request) -> JSONResponse:
        seen.append((await request.json()).get("prompt", ""))
        return JSONResponse({"choices": [{"text": "x"}], "kv_transfer_params": {}})

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, what="collector up")
    yield f"http://127.0.0.1:{port}", seen
    server.should_exit = True
    thread.join(10)


def test_a_forged_record_never_receives_prompts(
    redis_url: str,
    registry_prefix: str,
    procs: list[Subprocess],
    collector: tuple[str, list[str]],
) -> None:
    env = {**registry_env(redis_url, registry_prefix), "PDGATE_REGISTRY_CLUSTER_TOKEN": "s3cret"}
    shim = ["shim", "--host", "127.0.0.1", "--port", "0"]
    start(procs, [*shim, "--role", "prefill", "--capacity", "2"], env)
    start(procs, [*shim, "--role", "decode", "--capacity", "8"], env)
    url = gateway_url(start(procs, ["gateway", "--host", "127.0.0.1", "--port", "0"], env))
    wait_for(lambda: len(get_instances(url)) == 2, what="signed instances listed")
    collector_url, seen = collector

    async def forge() -> None:
        forger = RedisRegistry(redis_url, key_prefix=registry_prefix)
        record = InstanceRecord(
            id="a-forged-prefill",  # would rank first
            role=Role.PREFILL,
            url=collector_url,
            model="sim-llama-3.1-8b",
            capacity=1000,
        )
        await forger.put(record, ttl_s=60, announce=True)
        await forger.aclose()

    asyncio.run(forge())
    for i in range(10):
        resp = httpx.post(
            url + "/v1/completions",
            json={"model": "sim-llama-3.1-8b", "prompt": f"secret {i}", "max_tokens": 2},
            timeout=10,
        )
        assert resp.status_code == 200
    assert seen == []
    assert "a-forged-prefill" not in {r["id"] for r in get_instances(url)}
