"""Static instances (``--prefill URL``/``--decode URL``): the settings syntax, `StaticRegistry`
probing real servers in real processes (model discovery, dead at start-up, down and back),
and `MergedRegistry` over a real Redis registry."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from pdgate.config import GatewaySettings, Role
from pdgate.config.settings import (
    STATIC_DECODE_CAPACITY,
    STATIC_PREFILL_CAPACITY,
    StaticInstance,
)
from pdgate.config.wire import POOLING_ENDPOINTS
from pdgate.registry import (
    EventKind,
    InstanceState,
    RedisRegistry,
    RegistryError,
    RegistryEvent,
    RegistryUnavailable,
)
from pdgate.registry.static import (
    MergedRegistry,
    StaticRegistry,
    static_instance_id,
    with_static_instances,
)
from tests._redis import RedisServer, free_port
from tests.registry._stock_server import StockServer
from tests.registry._util import eventually, make_record, no_event

# --- settings --------------------------------------------------------------------------------


def test_spec_string_and_table_give_the_same_instance() -> None:
    settings = GatewaySettings(
        static_prefills=["http://10.0.0.5:8000/v1/ capacity=4 group=chat model=llama id=p1"],
        static_decodes=[{"url": "http://10.0.0.6:8000", "capacity": 32}, "https://d.example"],
    )
    assert settings.static_prefills == [
        StaticInstance(url="http://10.0.0.5:8000", capacity=4, group="chat", model="llama", id="p1")
    ]
    assert settings.static_decodes == [
        StaticInstance(url="http://10.0.0.6:8000", capacity=32),
        StaticInstance(url="https://d.example"),
    ]


def test_a_static_prefill_names_where_it_publishes_kv_events() -> None:
    settings = GatewaySettings(
        static_prefills=["http://10.0.0.5:8000 kv_events=tcp://10.0.0.5:5557"]
    )
    assert settings.static_prefills[0].kv_events == "tcp://10.0.0.5:5557"
    with pytest.raises(ValueError, match="connectable"):
        GatewaySettings(static_prefills=["http://10.0.0.5:8000 kv_events=tcp://*:5557"])


def test_a_static_instance_names_its_kv_connector() -> None:
    settings = GatewaySettings(
        static_prefills=[
            "http://10.0.0.5:8000 connector=nixl_push",
            "http://10.0.0.6:8000 connector=mooncake",
            "http://10.0.0.7:8000 connector=mooncake bootstrap=10.0.0.9:9000",
        ],
        static_decodes=["http://10.0.0.8:8000"],
    )
    push, mooncake, elsewhere = settings.static_prefills
    assert (push.connector, push.kv_bootstrap) == ("nixl_push", "")
    # vLLM's Mooncake proxy: the prefill's host, VLLM_MOONCAKE_BOOTSTRAP_PORT's default.
    assert mooncake.kv_bootstrap == "http://10.0.0.6:8998"
    assert elsewhere.kv_bootstrap == "http://10.0.0.9:9000"
    assert settings.static_decodes[0].connector is None
    for spec, message in (
        ("http://a:1 connector=p2p", "Input should be 'pdgate'"),
        ("http://a:1 connector=nixl bootstrap=b:2", "for connector=mooncake only"),
        ("http://a:1 connector=mooncake bootstrap=b:x", "Port could not be cast"),
        ("http://a:1 connector=mooncake bootstrap=b:2/path", "bootstrap is HOST:PORT"),
    ):
        with pytest.raises(ValueError, match=message):
            GatewaySettings(static_prefills=[spec])


def test_static_instances_from_env_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDGATE_GATEWAY_STATIC_PREFILLS", '["http://a:1 capacity=2"]')
    assert GatewaySettings.load().static_prefills == [StaticInstance(url="http://a:1", capacity=2)]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("ftp://a:1", "expected http://host:port"),
        ("http://a:1 cap=3", "expected key=value with key one of capacity, group, model, id"),
        ("http://a:1 capacity", "expected key=value"),
        ("http://a:1 capacity=0", "greater than 0"),
        ("http://a:1 capacity=x", "valid integer"),
        ("http://a:1 group=a group=b", "group given twice"),
        ("http://a:99999", "Port out of range"),
        ("http://a:1?x=1", "no query or fragment"),
        ("", "Field required"),
    ],
)
def test_bad_spec_is_a_clear_error(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GatewaySettings(static_prefills=[spec])


def test_credentials_in_a_url_are_refused_without_being_echoed() -> None:
    with pytest.raises(ValueError, match="credentials") as info:
        GatewaySettings(static_decodes=["http://user:s3cret@host:1 capacity=cap=x"])
    assert "s3cret" not in str(info.value)


def test_the_same_url_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="listed twice"):
        GatewaySettings(static_prefills=["http://a:1", "http://a:1/"])


def test_ids_derive_from_role_and_url() -> None:
    assert static_instance_id(Role.PREFILL, "http://10.0.0.5:8000") == "prefill@10.0.0.5:8000"
    assert static_instance_id(Role.DECODE, "https://h/x") == "decode@h/x"


def test_without_static_instances_the_registry_is_unchanged() -> None:
    registry = object()
    assert with_static_instances(registry, GatewaySettings()) is registry  # type: ignore[arg-type]


# --- probing real servers --------------------------------------------------------------------


@pytest.fixture
def model() -> str:
    return f"stock-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def servers(model: str) -> Iterator[list[StockServer]]:
    started: list[StockServer] = []
    yield started
    for server in started:
        server.kill()


def _static(
    prefills: list[StaticInstance], decodes: tuple[StaticInstance, ...] = (), down_after: int = 2
) -> StaticRegistry:
    return StaticRegistry(
        prefills, decodes, probe_interval_s=0.1, probe_timeout_s=0.5, down_after=down_after
    )


async def test_model_capacity_and_id_come_from_the_server_and_defaults(
    model: str, servers: list[StockServer]
) -> None:
    prefill = StockServer(model, loras=(f"{model}-lora",)).start()
    decode = StockServer(model).start()
    servers += [prefill, decode]
    named = StockServer(model).start()
    servers.append(named)
    reg = _static(
        [StaticInstance(url=prefill.url, kv_events="tcp://127.0.0.1:5557")],
        (
            StaticInstance(url=decode.url),
            StaticInstance(url=named.url, capacity=3, group="chat", model="alias", id="dec-x"),
        ),
    )
    try:
        records = {r.id: r for r in await reg.snapshot()}  # the first round, awaited
    finally:
        await reg.aclose()
    p = records[f"prefill@127.0.0.1:{prefill.port}"]
    d = records[f"decode@127.0.0.1:{decode.port}"]
    assert (p.kv_events, d.kv_events) == ("tcp://127.0.0.1:5557", "")
    # The first model /v1/models lists without a parent: the base model, not its adapter.
    assert (p.role, p.model, p.capacity, p.state) == (
        Role.PREFILL,
        model,
        STATIC_PREFILL_CAPACITY,
        InstanceState.READY,
    )
    assert (d.role, d.model, d.capacity, d.url) == (
        Role.DECODE,
        model,
        STATIC_DECODE_CAPACITY,
        decode.url,
    )
    x = records["dec-x"]
    assert (x.model, x.capacity, x.group) == ("alias", 3, "chat")  # given: not overwritten


async def test_what_the_server_serves_is_read_and_adapters_follow_at_run_time(
    model: str, servers: list[StockServer]
) -> None:
    """max_model_len and the adapters from GET /v1/models, at every probe (vLLM loads and
    unloads adapters at run time); the side endpoints from GET /openapi.json."""
    server = StockServer(model, max_model_len=2048, loras=(f"{model}-sql",)).start()
    pooling = StockServer(f"{model}-embed", pooling=True).start()
    servers += [server, pooling]
    reg = _static([], (StaticInstance(url=server.url), StaticInstance(url=pooling.url)))
    try:
        records = {r.model: r for r in await reg.snapshot()}
        record = records[model]
        assert (record.max_model_len, record.adapters) == (2048, (f"{model}-sql",))
        assert record.endpoints == ("/tokenize", "/detokenize")
        embed = records[f"{model}-embed"]
        assert (embed.max_model_len, embed.adapters) == (8192, ())
        assert embed.endpoints == ("/tokenize", "/detokenize", *POOLING_ENDPOINTS)
        events = reg.events()
        server.load_lora(f"{model}-poet")
        event = await _next(events, within=5)
        assert event.record is not None
        assert event.record.adapters == (f"{model}-sql", f"{model}-poet")
        server.unload_lora(f"{model}-sql")
        event = await _next(events, within=5)
        assert event.record is not None and event.record.adapters == (f"{model}-poet",)
        assert event.record.state is InstanceState.READY
        assert event.record.endpoints == ("/tokenize", "/detokenize")  # kept between reads
        await _close(events)
    finally:
        await reg.aclose()


async def test_a_mooncake_prefill_is_listed_with_the_engines_its_bootstrap_server_names(
    model: str,
) -> None:
    """vLLM's Mooncake proxy reads GET {bootstrap}/query before it sends anything: the
    decode is told the engine id of the prefill's rank. A prefill whose bootstrap server
    does not answer is not listed (its decodes could not be told whom to pull from)."""
    from tests.gateway.placement._vllm_connectors import ConnectorServer

    prefill = ConnectorServer("mooncake", "prefill", model, engine_id="engine-7").start()
    decode = ConnectorServer("mooncake", "decode", model).start()
    try:
        listed = StaticInstance.model_validate(
            f"{prefill.url} connector=mooncake bootstrap={prefill.side}"
        )
        dead = StaticInstance.model_validate(
            f"{decode.url} connector=mooncake bootstrap=127.0.0.1:{free_port()}"
        )
        as_decode = StaticInstance.model_validate(f"{decode.url} connector=mooncake")
        reg = _static([listed, dead], (as_decode,))
        try:
            records = {r.id: r for r in await reg.snapshot()}
        finally:
            await reg.aclose()
        p = records[f"prefill@127.0.0.1:{prefill.port}"]
        assert (p.connector, p.kv_bootstrap, p.kv_engines) == (
            "mooncake",
            f"http://{prefill.side}",
            ("engine-7",),
        )
        assert f"prefill@127.0.0.1:{decode.port}" not in records  # its bootstrap is dead
        # A decode pulls: it is listed without a bootstrap server of its own.
        d = records[f"decode@127.0.0.1:{decode.port}"]
        assert (d.connector, d.kv_engines) == ("mooncake", ())
        assert prefill.stats()["violations"] == []  # probes are no legs
    finally:
        prefill.kill()
        decode.kill()


async def test_a_dead_server_does_not_hold_start_up_and_joins_when_it_answers(
    model: str, servers: list[StockServer]
) -> None:
    port = free_port()
    reg = _static([StaticInstance(url=f"http://127.0.0.1:{port}")])
    events = reg.events()
    try:
        assert await reg.snapshot() == []  # not held until the server answers
        servers.append(StockServer(model, port=port).start())
        event = await _next(events, within=5)
        assert event.kind is EventKind.JOIN and event.record is not None
        assert event.record.model == model and event.record.state is InstanceState.READY
        assert [r.id for r in await reg.snapshot()] == [f"prefill@127.0.0.1:{port}"]
    finally:
        await _close(events)
        await reg.aclose()


async def test_an_unhealthy_server_drains_and_comes_back(
    model: str, servers: list[StockServer]
) -> None:
    server = StockServer(model).start()
    servers.append(server)
    reg = _static([], (StaticInstance(url=server.url),), down_after=2)
    try:
        [record] = await reg.snapshot()
        assert record.state is InstanceState.READY
        events = reg.events()
        server.set_health(False)  # the process serves on; only /health says 503
        event = await _next(events, within=5)
        assert event.record is not None and event.record.state is InstanceState.DRAINING
        [record] = await reg.snapshot()
        assert record.state is InstanceState.DRAINING  # still listed: its streams stay counted
        server.set_health(True)
        event = await _next(events, within=5)
        assert event.record is not None and event.record.state is InstanceState.READY
        # Killed outright: the same, through refused connections.
        server.kill()
        event = await _next(events, within=5)
        assert event.record is not None and event.record.state is InstanceState.DRAINING
        servers.append(StockServer(model, port=server.port).start())
        event = await _next(events, within=5)
        assert event.record is not None and event.record.state is InstanceState.READY
        await _close(events)
    finally:
        await reg.aclose()


async def test_one_failed_probe_below_down_after_keeps_it_ready(
    model: str, servers: list[StockServer]
) -> None:
    server = StockServer(model).start()
    servers.append(server)
    reg = StaticRegistry(
        [StaticInstance(url=server.url)], probe_interval_s=0.3, probe_timeout_s=0.5, down_after=3
    )
    try:
        await reg.snapshot()
        events = reg.events()
        server.set_health(False)
        # One or two failed probes, fewer than three: no change is published at all (the
        # same probes with down_after=2 drain it, test_an_unhealthy_server_drains...).
        await no_event(events, within=0.45)
        server.set_health(True)
        await no_event(events, within=0.6)
        [record] = await reg.snapshot()
        assert record.state is InstanceState.READY
        await _close(events)
    finally:
        await reg.aclose()


async def test_static_registry_is_read_only() -> None:
    reg = _static([StaticInstance(url="http://127.0.0.1:9")])
    try:
        with pytest.raises(RegistryError, match="read-only"):
            await reg.put(make_record(), 1.0)
        with pytest.raises(RegistryError, match="read-only"):
            await reg.remove("x")
    finally:
        await reg.aclose()


def test_two_declarations_with_one_id_are_refused() -> None:
    with pytest.raises(ValueError, match="same id"):
        StaticRegistry(
            [StaticInstance(url="http://a:1", id="x"), StaticInstance(url="http://b:1", id="x")]
        )


# --- merged with a real Redis registry -------------------------------------------------------


@pytest.fixture
async def merged(
    redis_url: str, registry_prefix: str, model: str, servers: list[StockServer]
) -> AsyncIterator[tuple[MergedRegistry, RedisRegistry, StockServer]]:
    server = StockServer(model).start()
    servers.append(server)
    redis = RedisRegistry(redis_url, key_prefix=registry_prefix, connect_timeout_s=0.5)
    reg = MergedRegistry(redis, _static([StaticInstance(url=server.url)]))
    yield reg, redis, server
    await reg.aclose()


async def test_merged_snapshot_has_both_and_the_declaration_wins_an_id(
    merged: tuple[MergedRegistry, RedisRegistry, StockServer],
) -> None:
    reg, redis, server = merged
    static_id = f"prefill@127.0.0.1:{server.port}"
    await redis.put(make_record("decode-1", role=Role.DECODE), 5.0)
    # An announced record under the declared id (a server both declared and announced).
    shadow = make_record(static_id, capacity=99)
    await reg.put(shadow, 5.0)  # writes go to the registry
    assert {r.id for r in await redis.snapshot()} == {"decode-1", static_id}
    records = {r.id: r for r in await reg.snapshot()}
    assert set(records) == {"decode-1", static_id}
    assert records[static_id].capacity == STATIC_PREFILL_CAPACITY  # counted once, as declared
    assert records[static_id].url == server.url


async def test_merged_events_carry_both_sources(
    merged: tuple[MergedRegistry, RedisRegistry, StockServer],
) -> None:
    reg, redis, server = merged
    await reg.snapshot()
    events = reg.events()
    try:
        await events.wait_subscribed()
        await redis.put(make_record("prefill-9"), 5.0, announce=True)
        event = await _next(events)
        assert (event.kind, event.instance_id) == (EventKind.JOIN, "prefill-9")
        # The registry's events about a declared id are dropped, as in the snapshot.
        await redis.put(make_record(f"prefill@127.0.0.1:{server.port}"), 5.0, announce=True)
        server.set_health(False)
        event = await _next(events)
        assert event.instance_id == f"prefill@127.0.0.1:{server.port}"
        assert event.record is not None and event.record.state is InstanceState.DRAINING
        assert event.record.version == "static"
    finally:
        await _close(events)


async def test_merged_snapshot_fails_while_redis_is_down(
    private_redis: RedisServer, model: str, servers: list[StockServer]
) -> None:
    server = StockServer(model).start()
    servers.append(server)
    redis = RedisRegistry(private_redis.url, key_prefix="t", connect_timeout_s=0.3)
    reg = MergedRegistry(redis, _static([StaticInstance(url=server.url)]))
    try:
        assert len(await reg.snapshot()) == 1
        private_redis.stop()
        # As without static instances: Membership keeps its last view rather than losing
        # every registered instance.
        with pytest.raises(RegistryUnavailable):
            await reg.snapshot()
        private_redis.start()
        await eventually(lambda: _snapshot_ok(reg), within=5, what="redis back")
    finally:
        await reg.aclose()


async def _snapshot_ok(reg: MergedRegistry) -> bool:
    try:
        return len(await reg.snapshot()) == 1
    except RegistryUnavailable:
        return False


async def _next(events: AsyncIterator[RegistryEvent], within: float = 3.0) -> RegistryEvent:
    async with asyncio.timeout(within):
        return await anext(events)


async def _close(events: AsyncIterator[RegistryEvent]) -> None:
    close = getattr(events, "aclose", None)
    if close is not None:
        await close()
