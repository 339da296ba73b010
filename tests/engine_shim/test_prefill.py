"""The prefill shim on a real socket: admission, KV hand-off, hold timeout, bad input."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import orjson
import pytest

from pdgate.config import Role, ShimSettings
from pdgate.config import sim_tokenizer as tokenizer
from pdgate.config.server import bind_socket, bound_port, serving
from pdgate.config.wire import KV_DIGEST_HEADER, KV_ID_HEADER, KV_TOKENS_HEADER, kv_url
from pdgate.engine_shim._kv_store import HoldTimes
from pdgate.engine_shim.app import build_shim_app
from pdgate.registry.memory import MemoryRegistry
from tests.engine_shim.conftest import (
    MODEL,
    REGISTRY_SETTINGS,
    Shim,
    StartShim,
    assert_openai_error,
    prefill_body,
    wait_load,
)


async def test_prefill_answers_first_token_and_kv_params(start_shim: StartShim) -> None:
    shim = await start_shim(Role.PREFILL, capacity=2)
    status, body, _ = await shim.post(prefill_body("Hello there, general Kenobi."))
    assert status == 200, body
    assert body["object"] == "text_completion"
    assert body["model"] == MODEL
    assert body["id"].startswith("cmpl-")
    assert isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["index"] == 0
    assert choice["finish_reason"] == "length"
    assert choice["logprobs"] is None
    assert isinstance(choice["text"], str)
    assert choice["text"]
    n = tokenizer.count("Hello there, general Kenobi.")
    assert body["usage"]["prompt_tokens"] == n
    assert body["usage"]["completion_tokens"] == 1
    assert body["usage"]["total_tokens"] == n + 1
    params = body["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    assert params["do_remote_decode"] is False
    assert params["remote_host"] == "127.0.0.1"
    assert params["remote_port"] == shim.settings.port
    assert params["remote_engine_id"] == (await shim.load())["instance_id"]
    assert params["remote_block_ids"] == list(range(-(-n // 16)))
    assert params["tp_size"] == 1
    assert isinstance(params["remote_request_id"], str)


async def test_capacity_one_rejects_at_once_and_kv_get_frees_the_slot(
    start_shim: StartShim,
) -> None:
    shim = await start_shim(Role.PREFILL, capacity=1)
    status, first, _ = await shim.post(prefill_body("first"))
    assert status == 200
    status, body, headers = await shim.post(prefill_body("second"))
    assert status == 429
    err = assert_openai_error(body)
    assert err["code"] == "no_free_slot"
    assert headers["Retry-After"] == "1"
    load = await shim.load()
    assert (load["used"], load["free"], load["kv_held"], load["rejected"]) == (1, 0, 1, 1)

    url = kv_url(first["kv_transfer_params"])
    assert url is not None
    async with shim.http.get(url) as resp:
        assert resp.status == 200
        assert resp.headers["content-type"] == "application/octet-stream"
        kv = await resp.read()
        assert int(resp.headers[KV_TOKENS_HEADER]) == first["usage"]["prompt_tokens"]
        assert resp.headers[KV_DIGEST_HEADER] == hashlib.blake2b(kv, digest_size=16).hexdigest()
    # Default wire fraction 1/64 of 128 KiB/token.
    assert len(kv) == first["usage"]["prompt_tokens"] * 2048
    load = await wait_load(shim, "used", 0)
    assert load["kv_held"] == 0
    assert load["kv_fetched"] == 1
    async with shim.http.get(url) as resp:  # single consumer
        assert resp.status == 404
        assert_openai_error(await resp.json())
    status, _, _ = await shim.post(prefill_body("third"))
    assert status == 200


async def test_delete_frees_the_slot(start_shim: StartShim) -> None:
    shim = await start_shim(Role.PREFILL, capacity=1)
    _, body, _ = await shim.post(prefill_body())
    assert await shim.kv("DELETE", body) == 204
    load = await shim.load()
    assert load["used"] == 0
    assert load["kv_released"] == 1
    assert await shim.kv("DELETE", body) == 404
    assert await shim.kv("GET", body) == 404


async def test_hold_timeout_drops_unfetched_kv(start_shim: StartShim) -> None:
    shim = await start_shim(Role.PREFILL, capacity=1, kv_hold_timeout_s=0.3)
    _, body, _ = await shim.post(prefill_body())
    assert (await shim.load())["used"] == 1
    await asyncio.sleep(0.15)
    assert (await shim.load())["used"] == 1  # still held before the timeout
    load = await wait_load(shim, "used", 0, within=2)
    assert load["kv_expired"] == 1
    assert load["kv_held"] == 0
    assert await shim.kv("GET", body) == 404


async def test_kv_reader_leaving_midway_frees_the_slot(start_shim: StartShim) -> None:
    shim = await start_shim(Role.PREFILL, capacity=1, sim_kv_wire_fraction=1.0)
    # ~1000 tokens x 128 KiB: far more than the socket buffers hold.
    _, body, _ = await shim.post(prefill_body("word " * 1000))
    url = kv_url(body["kv_transfer_params"])
    assert url is not None
    resp = await shim.http.get(url)
    assert resp.status == 200
    await resp.content.readexactly(1024)
    resp.close()
    load = await wait_load(shim, "used", 0)
    assert load["kv_lost"] == 1
    assert load["kv_sending"] == 0


async def test_queue_admission_waits_fifo_and_rejects_when_full(start_shim: StartShim) -> None:
    shim = await start_shim(Role.PREFILL, capacity=1, admission="queue", local_queue_size=3)
    _, held, _ = await shim.post(prefill_body("holder"))
    order: list[int] = []

    async def queued(i: int) -> dict[str, Any]:
        status, body, _ = await shim.post(prefill_body(f"queued {i}"))
        assert status == 200, body
        order.append(i)
        return body

    tasks = []
    for i in range(3):
        tasks.append(asyncio.create_task(queued(i)))
        await wait_load(shim, "queued", i + 1)
    status, body, headers = await shim.post(prefill_body("one too many"))
    assert status == 429
    assert headers["Retry-After"] == "1"
    assert assert_openai_error(body)["code"] == "queue_full"

    release = held
    for i in range(3):
        assert await shim.kv("DELETE", release) == 204
        release = await tasks[i]
        assert order == list(range(i + 1))
    load = await shim.load()
    assert (load["used"], load["queued"], load["admitted"], load["rejected"]) == (1, 0, 4, 1)


async def test_client_leaving_during_prefill_frees_the_slot_when_the_engine_is_done(
    start_shim: StartShim,
) -> None:
    shim = await start_shim(Role.PREFILL, capacity=1)
    # ~8k tokens: a ~0.5 s prefill on the H100 profile.
    long_prompt = "disaggregated " * 4000
    assert tokenizer.count(long_prompt) > 7000
    task = asyncio.create_task(shim.post(prefill_body(long_prompt)))
    await wait_load(shim, "running", 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The engine is still computing the abandoned prompt: the shim must not claim a free
    # slot (it would admit a request that cannot start), so newcomers are still rejected.
    load = await wait_load(shim, "cancelled", 1)
    assert (load["used"], load["running"]) == (1, 1)
    status, body, _ = await shim.post(prefill_body("newcomer"))
    assert status == 429, body
    # The slot comes back when the batch ends, never before it.
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5.0
    while True:
        load = await shim.load()
        assert not (load["used"] == 0 and load["running"] == 1), load
        if load["used"] == 0:
            break
        assert loop.time() < deadline, load
        await asyncio.sleep(0.005)
    assert (load["kv_held"], load["completed"]) == (0, 0)
    status, body, _ = await shim.post(prefill_body("after the batch"))
    assert status == 200, body


async def test_queued_prompt_withdrawn_at_once(start_shim: StartShim) -> None:
    # Two slots, batch of one prompt computing: a second prompt waits in the engine for the
    # next batch, and its caller leaving frees its slot at once (it never started).
    shim = await start_shim(Role.PREFILL, capacity=2)
    first = asyncio.create_task(shim.post(prefill_body("disaggregated " * 4000)))
    await wait_load(shim, "running", 1)
    second = asyncio.create_task(shim.post(prefill_body("waiting " * 100)))
    await wait_load(shim, "waiting", 1)
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
    load = await wait_load(shim, "used", 1, within=0.3)
    assert (load["running"], load["waiting"], load["cancelled"]) == (1, 0, 1)
    status, _, _ = await first
    assert status == 200


async def test_prefix_cache_hits_are_reported(start_shim: StartShim) -> None:
    shim = await start_shim(Role.PREFILL, capacity=4)
    prompt = "A long shared system prompt for the scenario. " * 20
    _, first, _ = await shim.post(prefill_body(prompt))
    _, second, _ = await shim.post(prefill_body(prompt))
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"] - 16
    load = await shim.load()
    assert load["prefix_cache_hit_tokens"] == cached
    assert load["prefix_cache_total_tokens"] == 2 * first["usage"]["prompt_tokens"]
    # A token-id prompt is the same prompt.
    ids = tokenizer.encode(prompt)
    _, third, _ = await shim.post(prefill_body(ids))
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    assert third["choices"][0]["text"] == first["choices"][0]["text"]


async def test_health_load_metrics_and_registration(
    start_shim: StartShim, registry: MemoryRegistry
) -> None:
    shim = await start_shim(Role.PREFILL, capacity=3, group="chat")
    async with shim.http.get(shim.url + "/health") as resp:
        assert resp.status == 200
        assert await resp.json() == {"status": "ok"}
    load = await shim.load()
    for key in (
        "role",
        "instance_id",
        "capacity",
        "used",
        "free",
        "queued",
        "running",
        "retrieving",
        "kv_held",
        "prefix_cache_hit_tokens",
        "prefix_cache_total_tokens",
    ):
        assert key in load
    assert load["role"] == "prefill"
    assert load["capacity"] == 3
    assert load["free"] == 3
    (record,) = await registry.snapshot()
    assert record.id == load["instance_id"]
    assert record.role == Role.PREFILL
    assert record.url == shim.url
    assert record.capacity == 3
    assert record.group == "chat"
    assert record.model == MODEL
    async with shim.http.get(shim.url + "/metrics") as resp:
        text = await resp.text()
        assert resp.status == 200
        assert "pdgate_shim_capacity" in text
        assert 'role="prefill"' in text

    runtime = shim.app.state.shim
    assert await runtime.drain(timeout_s=1.0)
    async with shim.http.get(shim.url + "/health") as resp:
        assert resp.status == 503
    status, body, headers = await shim.post(prefill_body())
    assert status == 503
    assert headers["Retry-After"] == "1"
    assert_openai_error(body)
    (record,) = await registry.snapshot()
    assert record.state == "draining"


def _big_body() -> bytes:
    return orjson.dumps(prefill_body("x" * (9 * 1024 * 1024)))


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (orjson.dumps({"model": MODEL, "max_tokens": 1}), 400, "prompt"),
        (orjson.dumps(prefill_body(42)), 400, "prompt"),
        (orjson.dumps(prefill_body("")), 400, "prompt"),
        (orjson.dumps(prefill_body(["a", "b"])), 400, "prompt"),
        (orjson.dumps(prefill_body([1, 2, 10**9])), 400, "prompt"),
        (orjson.dumps(prefill_body(max_tokens=0)), 400, "max_tokens"),
        (orjson.dumps(prefill_body(max_tokens=10**9)), 400, "max_tokens"),
        (orjson.dumps(prefill_body(max_tokens="5")), 400, "max_tokens"),
        (orjson.dumps(prefill_body(stream="yes")), 400, "stream"),
        (orjson.dumps(prefill_body(stop=["a", "b", "c", "d", "e"])), 400, "stop"),
        (orjson.dumps(prefill_body(stop=7)), 400, "stop"),
        (orjson.dumps(prefill_body(temperature="hot")), 400, "temperature"),
        (orjson.dumps(prefill_body(n=2)), 400, "n"),
        (orjson.dumps(prefill_body(kv_transfer_params="yes")), 400, "kv_transfer_params"),
        (
            orjson.dumps({**prefill_body(max_tokens=5), "kv_transfer_params": None}),
            400,
            "kv_transfer_params",
        ),
        (orjson.dumps(prefill_body(model="some-other-model")), 404, "model"),
        (orjson.dumps(prefill_body("word " * 600)), 400, "prompt"),  # > max_model_len
        (_big_body(), 413, None),
    ],
)
async def test_bad_input_gets_an_openai_error(
    start_shim: StartShim, body: bytes, status: int, param: str | None
) -> None:
    shim = await start_shim(Role.PREFILL, capacity=1, max_model_len=512)
    async with shim.http.post(
        shim.url + "/v1/completions", data=body, headers={"content-type": "application/json"}
    ) as resp:
        assert resp.status == status
        err = assert_openai_error(await resp.json())
        assert err["param"] == param
    assert (await shim.load())["used"] == 0


async def test_missing_kv_params_explains_this_is_a_prefill(start_shim: StartShim) -> None:
    shim = await start_shim(Role.PREFILL)
    status, body, _ = await shim.post({"model": MODEL, "prompt": "hi", "max_tokens": 4})
    assert status == 400
    assert "prefill instance" in assert_openai_error(body)["message"]


async def test_queued_client_leaving_takes_no_slot(start_shim: StartShim) -> None:
    shim = await start_shim(Role.PREFILL, capacity=1, admission="queue", local_queue_size=2)
    _, held, _ = await shim.post(prefill_body("holder"))
    task = asyncio.create_task(shim.post(prefill_body("impatient")))
    await wait_load(shim, "queued", 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    load = await wait_load(shim, "queued", 0)
    assert load["cancelled"] == 1
    assert load["used"] == 1
    assert await shim.kv("DELETE", held) == 204
    assert (await shim.load())["used"] == 0


async def test_unknown_route_gets_an_openai_error(start_shim: StartShim) -> None:
    shim = await start_shim(Role.PREFILL)
    async with shim.http.get(shim.url + "/v1/nothing-here") as resp:
        assert resp.status == 404
        assert_openai_error(await resp.json())
    async with shim.http.get(shim.url + "/v1/completions") as resp:
        assert resp.status == 405
        assert_openai_error(await resp.json())


async def test_shutdown_deregisters(registry: MemoryRegistry) -> None:
    sock = bind_socket("127.0.0.1", 0)
    settings = ShimSettings(role=Role.PREFILL, port=bound_port(sock), instance_id="p-1")
    app = build_shim_app(settings, registry, REGISTRY_SETTINGS)
    events = registry.events()
    async with serving(app, sock):
        assert [r.id for r in await registry.snapshot()] == ["p-1"]
    assert await registry.snapshot() == []
    seen = []
    async for event in events:
        seen.append((event.kind.value, event.record.state.value if event.record else None))
        if event.kind.value == "leave":
            break
    assert seen == [("join", "ready"), ("join", "draining"), ("leave", None)]


# -- KV ids ---------------------------------------------------------------------------------


async def _post_with_kv_id(
    shim: Shim, body: dict[str, Any], kv_id: str
) -> tuple[int, dict[str, Any]]:
    async with shim.http.post(
        shim.url + "/v1/completions", data=orjson.dumps(body), headers={KV_ID_HEADER: kv_id}
    ) as resp:
        return resp.status, orjson.loads(await resp.read())


async def test_duplicate_kv_id_is_a_409_that_holds_nothing(start_shim: StartShim) -> None:
    shim = await start_shim(Role.PREFILL, capacity=3)
    kv_id = "dup0" * 4
    # The first request is still computing (~0.5 s) when the second arrives with its id.
    first = asyncio.create_task(_post_with_kv_id(shim, prefill_body("long " * 4000), kv_id))
    await wait_load(shim, "running", 1)
    status, body = await _post_with_kv_id(shim, prefill_body("second"), kv_id)
    assert status == 409, body
    err = assert_openai_error(body)
    assert err["code"] == "duplicate_kv_id"
    load = await shim.load()
    assert (load["used"], load["admitted"]) == (1, 1)  # the 409 took no slot

    status, body = await first
    assert status == 200, body
    assert body["kv_transfer_params"]["remote_request_id"] == kv_id
    # Held, not yet fetched: still in use.
    status, body = await _post_with_kv_id(shim, prefill_body("third"), kv_id)
    assert status == 409, body
    load = await shim.load()
    assert (load["used"], load["kv_held"], load["completed"]) == (1, 1, 1)

    # Once let go, the id may name a new request.
    async with shim.http.delete(f"{shim.url}/v1/kv/{kv_id}") as resp:
        assert resp.status == 204
    status, body = await _post_with_kv_id(shim, prefill_body("fourth"), kv_id)
    assert status == 200, body
    async with shim.http.delete(f"{shim.url}/v1/kv/{kv_id}") as resp:
        assert resp.status == 204
    load = await shim.load()
    assert (load["used"], load["kv_held"]) == (0, 0)


@pytest.mark.parametrize("kv_id", ["short", "x" * 65, "not-alnum-id", "caf\u00e9" * 3])
async def test_malformed_kv_id_is_a_400(start_shim: StartShim, kv_id: str) -> None:
    shim = await start_shim(Role.PREFILL, capacity=1)
    async with shim.http.post(
        shim.url + "/v1/completions",
        data=orjson.dumps(prefill_body()),
        headers={KV_ID_HEADER: kv_id.encode().decode("latin-1")},
    ) as resp:
        assert resp.status == 400
        assert KV_ID_HEADER in assert_openai_error(await resp.json())["message"]
    assert (await shim.load())["used"] == 0


# -- logprobs -------------------------------------------------------------------------------


async def test_prefill_returns_logprobs_of_its_token(start_shim: StartShim) -> None:
    shim = await start_shim(Role.PREFILL, capacity=2)
    status, body, _ = await shim.post(prefill_body(logprobs=3))
    assert status == 200, body
    (choice,) = body["choices"]
    lp = choice["logprobs"]
    assert lp["tokens"] == [choice["text"]]
    assert lp["text_offset"] == [0]
    ((token, top),) = zip(lp["tokens"], lp["top_logprobs"], strict=True)
    assert len(top) == 3
    assert list(top.values()) == sorted(top.values(), reverse=True)
    # The sim is greedy: its token is the most likely one.
    assert next(iter(top)) == token
    assert top[token] == lp["token_logprobs"][0] < 0
    # Deterministic.
    _, again, _ = await shim.post(prefill_body(logprobs=3))
    assert again["choices"][0]["logprobs"] == lp


# -- the KV hold, measured ------------------------------------------------------------------


async def test_kv_hold_times_are_recorded_by_outcome(start_shim: StartShim) -> None:
    shim = await start_shim(Role.PREFILL, capacity=2, kv_hold_timeout_s=1.0)
    load = await shim.load()
    assert (load["kv_hold_max_s"], load["kv_hold_over_5s"]) == (0, 0)

    _, fetched, _ = await shim.post(prefill_body("fetched"))
    await asyncio.sleep(0.1)
    assert await shim.kv("GET", fetched) == 200
    load = await wait_load(shim, "used", 0)
    assert 0.1 <= load["kv_hold_max_s"] < 1.0

    await shim.post(prefill_body("expires"))
    load = await wait_load(shim, "kv_expired", 1, within=3.0)
    assert 1.0 <= load["kv_hold_max_s"] < 3.0
    assert load["kv_hold_over_5s"] == 0

    async with shim.http.get(shim.url + "/metrics") as resp:
        text = await resp.text()
    counts = {
        outcome: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("pdgate_shim_kv_hold_seconds_count")
        for outcome in ("fetched", "expired", "released")
        if f'outcome="{outcome}"' in line
    }
    assert counts == {"fetched": 1.0, "expired": 1.0, "released": 0.0}
    assert "pdgate_shim_kv_hold_seconds_bucket{" in text
    assert "pdgate_shim_kv_hold_max_s" in text
    assert "pdgate_shim_kv_hold_over_5s_total" in text


def test_hold_times_count_holds_over_five_seconds() -> None:
    holds = HoldTimes()
    for seconds, outcome in ((0.2, "fetched"), (5.0, "released"), (31.0, "expired")):
        holds.observe(seconds, outcome)
    assert (holds.max_s, holds.long) == (31.0, 1)  # over 5 s, not at 5 s
    expired = holds.by_outcome["expired"]
    assert (expired.count, expired.sum) == (1, 31.0)
    assert expired.cumulative()[-2:] == [("60.0", 1.0), ("+Inf", 1.0)]
    assert expired.cumulative()[0] == ("0.005", 0.0)


async def test_a_plain_one_token_request_is_a_prefill_leg(pair: tuple[Shim, Shim]) -> None:
    """As SMG sends vLLM's P/D: the prefill leg without kv_transfer_params (max_tokens 1),
    then the decode with the parameters the prefill answered."""
    prefill, decode = pair
    body = {k: v for k, v in prefill_body(max_tokens=1).items() if k != "kv_transfer_params"}
    status, answer, _ = await prefill.post(body)
    assert status == 200, answer
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    events = await decode.stream({**body, "max_tokens": 4, "kv_transfer_params": params})
    assert events[-1] == "[DONE]" and len(events) > 2
    assert (await wait_load(prefill, "kv_held", 0))["kv_fetched"] == 1
