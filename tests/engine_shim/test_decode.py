"""The decode worker against a real prefill shim (and fake prefills for failures)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

import aiohttp
import orjson
import pytest
from starlette.requests import Request
from starlette.responses import Response

from pdgate.config import Role
from pdgate.config import sim_tokenizer as tokenizer
from pdgate.config.wire import EXT_QUEUELESS, TPOT_SLO_HEADER, TTFT_LEFT_HEADER
from pdgate.registry.memory import MemoryRegistry
from tests.engine_shim._fake_prefill import (
    PROMPT,
    fake_prefill,
    kv_params,
    kv_response,
    register_prefill,
    stuck_pull,
)
from tests.engine_shim.conftest import MODEL, Shim, StartShim, assert_openai_error, wait_load


def _decode_body(
    prefill_reply: dict[str, Any], prompt: str = PROMPT, **extra: Any
) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 8,
        "kv_transfer_params": prefill_reply["kv_transfer_params"],
        **extra,
    }


async def test_decode_pulls_kv_and_streams_deterministic_sse(pair: tuple[Shim, Shim]) -> None:
    prefill, decode = pair
    reply = await prefill.prefilled(PROMPT)
    assert (await prefill.load())["used"] == 1
    events = await decode.stream(_decode_body(reply, stream_options={"include_usage": True}))
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk, _ = events
    assert usage_chunk["choices"] == []
    n = tokenizer.count(PROMPT)
    assert usage_chunk["usage"] == {
        "prompt_tokens": n,
        "completion_tokens": 8,
        "total_tokens": n + 8,
    }
    ids = {c["id"] for c in [*chunks, usage_chunk]}
    assert len(ids) == 1
    assert ids.pop().startswith("cmpl-")
    for c in chunks:
        assert c["object"] == "text_completion"
        assert c["model"] == MODEL
        (choice,) = c["choices"]
        assert choice["index"] == 0
        assert choice["logprobs"] is None
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [
        "length"
    ]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    # Token 0 of the decode is the prefill's first token.
    assert text.startswith(reply["choices"][0]["text"])

    # The KV was really pulled: the prefill freed its slot on the completed GET.
    load = await wait_load(prefill, "used", 0)
    assert load["kv_fetched"] == 1
    load = await wait_load(decode, "used", 0)
    assert load["completed"] == 1
    assert load["running"] == 0
    assert load["retrieving"] == 0

    # Deterministic: the same prompt gives the same text, streamed or not.
    again = await prefill.prefilled(PROMPT)
    async with decode.http.post(
        decode.url + "/v1/completions", data=orjson.dumps(_decode_body(again))
    ) as resp:
        assert resp.status == 200
        whole = await resp.json()
    assert whole["choices"][0]["text"] == text
    assert whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == 8
    other = await prefill.prefilled("A different prompt entirely.")
    events = await decode.stream(_decode_body(other, "A different prompt entirely."))
    assert "".join(c["choices"][0]["text"] for c in events[:-1]) != text


async def test_no_usage_chunk_unless_asked(pair: tuple[Shim, Shim]) -> None:
    prefill, decode = pair
    events = await decode.stream(_decode_body(await prefill.prefilled(PROMPT), max_tokens=3))
    assert events[-1] == "[DONE]"
    assert all(e["choices"] for e in events[:-1])
    assert "usage" not in events[-2]


async def test_stop_sequence_truncates_before_the_match(pair: tuple[Shim, Shim]) -> None:
    prefill, decode = pair
    events = await decode.stream(_decode_body(await prefill.prefilled(PROMPT), max_tokens=40))
    full = "".join(e["choices"][0]["text"] for e in events[:-1])
    # A stop string spanning a token boundary, starting after the first few tokens.
    start = len(full) // 2
    stop = full[start : start + 4]
    expected = full[: full.index(stop)]

    events = await decode.stream(
        _decode_body(
            await prefill.prefilled(PROMPT),
            max_tokens=40,
            stop=[stop, "never-matches"],
            stream_options={"include_usage": True},
        ),
    )
    *chunks, usage_chunk, done = events
    assert done == "[DONE]"
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert 0 < usage_chunk["usage"]["completion_tokens"] < 40

    body = _decode_body(await prefill.prefilled(PROMPT), max_tokens=40, stop=stop)
    async with decode.http.post(decode.url + "/v1/completions", data=orjson.dumps(body)) as resp:
        whole = await resp.json()
    assert whole["choices"][0] == {
        "index": 0,
        "text": expected,
        "logprobs": None,
        "finish_reason": "stop",
    }
    await wait_load(decode, "used", 0)


async def _long_stream(start_shim: StartShim) -> tuple[Shim, Shim, aiohttp.ClientResponse]:
    """A prefill and a one-slot decode, its slot taken by a stream of 2000 tokens (open)."""
    prefill = await start_shim(Role.PREFILL, capacity=4)
    decode = await start_shim(Role.DECODE, capacity=1)
    body = _decode_body(await prefill.prefilled(PROMPT), max_tokens=2000, stream=True)
    resp = await decode.http.post(decode.url + "/v1/completions", data=orjson.dumps(body))
    return prefill, decode, resp


async def test_decode_rejects_at_once_when_full(start_shim: StartShim) -> None:
    prefill, decode, long = await _long_stream(start_shim)
    try:
        assert long.status == 200
        second = await prefill.prefilled(PROMPT)
        status, body, headers = await decode.post(_decode_body(second))
        assert status == 429
        assert headers["Retry-After"] == "1"
        assert assert_openai_error(body)["code"] == "no_free_slot"
        assert (await decode.load())["rejected"] == 1
    finally:
        long.close()
    await wait_load(decode, "used", 0)


async def test_client_disconnect_mid_stream_frees_the_decode_slot(start_shim: StartShim) -> None:
    prefill, decode, resp = await _long_stream(start_shim)
    assert resp.status == 200
    for _ in range(3):
        line = await resp.content.readline()
        assert line.startswith(b"data: {")
        await resp.content.readline()
    load = await decode.load()
    assert (load["used"], load["running"]) == (1, 1)
    resp.close()
    load = await wait_load(decode, "used", 0, within=1.0)
    # Freed because the client left: its sequence was cancelled, not finished.
    assert load["running"] == 0
    assert load["cancelled"] == 1
    # The freed slot is usable again.
    events = await decode.stream(_decode_body(await prefill.prefilled(PROMPT), max_tokens=2))
    assert events[-1] == "[DONE]"


async def _expect_inband_error(decode: Shim, params: dict[str, Any]) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": params}
    events = await decode.stream(body)
    assert len(events) == 2, events
    assert events[1] == "[DONE]"
    err = assert_openai_error(events[0])
    assert err["code"] == "kv_transfer_failed"
    async with decode.http.post(decode.url + "/v1/completions", data=orjson.dumps(body)) as resp:
        assert resp.status == 502
        assert assert_openai_error(await resp.json())["code"] == "kv_transfer_failed"
    await wait_load(decode, "used", 0)
    return err


async def test_kv_digest_mismatch_is_an_inband_error(
    start_shim: StartShim, registry: MemoryRegistry
) -> None:
    decode = await start_shim(Role.DECODE, capacity=2)
    n = tokenizer.count(PROMPT)

    async def corrupt(request: Request) -> Response:
        return kv_response(n, b"\x01" * 64, digest="0" * 32)

    async with fake_prefill(corrupt, registry) as port:
        err = await _expect_inband_error(decode, kv_params(port))
    assert "digest" in err["message"]
    assert (await decode.load())["failed"] == 2


async def test_kv_of_another_prompt_is_an_inband_error(
    start_shim: StartShim, registry: MemoryRegistry
) -> None:
    decode = await start_shim(Role.DECODE, capacity=2)

    async def wrong_prompt(request: Request) -> Response:
        return kv_response(tokenizer.count(PROMPT) + 1, b"\x01" * 64)

    async with fake_prefill(wrong_prompt, registry) as port:
        err = await _expect_inband_error(decode, kv_params(port))
    assert "tokens" in err["message"]


async def test_prefill_gone_is_an_inband_error(
    start_shim: StartShim, registry: MemoryRegistry
) -> None:
    decode = await start_shim(Role.DECODE, capacity=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    await register_prefill(registry, port)
    await _expect_inband_error(decode, kv_params(port))


async def test_kv_already_taken_is_an_inband_error(pair: tuple[Shim, Shim]) -> None:
    prefill, decode = pair
    reply = await prefill.prefilled(PROMPT)
    await decode.stream(_decode_body(reply, max_tokens=1))
    await _expect_inband_error(decode, reply["kv_transfer_params"])


async def test_full_retrieval_queue_rejects_and_abandoned_pulls_free_the_prefill(
    start_shim: StartShim, registry: MemoryRegistry
) -> None:
    prefill = await start_shim(Role.PREFILL, capacity=4)
    decode = await start_shim(
        Role.DECODE, capacity=4, kv_retrieval_workers=1, kv_retrieval_queue=1, kv_fetch_timeout_s=30
    )
    async with stuck_pull(decode, registry) as first:
        # The only worker is stuck: the next request waits in the queue...
        queued_reply = await prefill.prefilled(PROMPT)
        second = await decode.http.post(
            decode.url + "/v1/completions",
            data=orjson.dumps(_decode_body(queued_reply, stream=True)),
        )
        assert second.status == 200
        load = await wait_load(decode, "queued", 1)
        assert load["retrieving"] == 1
        assert load["used"] == 2
        # ...and with the queue full, the third is rejected at once.
        status, err, headers = await decode.post(_decode_body(await prefill.prefilled("third")))
        assert status == 429
        assert headers["Retry-After"] == "1"
        assert assert_openai_error(err)["code"] == "kv_queue_full"

        # Both clients leave: the stuck pull is cancelled, the queued one is released at the
        # prefill with DELETE when the worker reaches it.
        second.close()
        first.close()
        await wait_load(decode, "used", 0)
        await wait_load(decode, "retrieving", 0)
        load = await wait_load(prefill, "kv_released", 1)
        assert load["kv_held"] == 1  # the rejected "third" request's KV stays until its timeout


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        (None, "decode instance"),
        ({"do_remote_decode": True}, "decode instance"),
        ({"do_remote_prefill": True, "remote_host": "127.0.0.1"}, "remote_port"),
        (
            {
                "do_remote_prefill": True,
                "remote_host": "h",
                "remote_port": "x",
                "remote_request_id": "r",
            },
            "remote_port",
        ),
    ],
)
async def test_decode_needs_kv_transfer_params(
    start_shim: StartShim, params: dict[str, Any] | None, fragment: str
) -> None:
    # With local_prefill on (the default) a request without params is computed there
    # (tests/engine_shim/test_local_prefill.py).
    decode = await start_shim(Role.DECODE, local_prefill=False)
    body: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
    if params is not None:
        body["kv_transfer_params"] = params
    status, reply, _ = await decode.post(body)
    assert status == 400
    assert fragment in assert_openai_error(reply)["message"]


async def test_decode_bad_input(start_shim: StartShim) -> None:
    decode = await start_shim(Role.DECODE, max_model_len=64)
    params = kv_params(1)
    for body, status in [
        (b"nope", 400),
        (orjson.dumps({"prompt": PROMPT, "max_tokens": -1, "kv_transfer_params": params}), 400),
        (orjson.dumps({"prompt": PROMPT, "max_tokens": 60, "kv_transfer_params": params}), 400),
        (
            orjson.dumps(
                {
                    "prompt": PROMPT,
                    "stream_options": {"include_usage": True},
                    "kv_transfer_params": params,
                }
            ),
            400,
        ),
        (
            orjson.dumps(
                {
                    "prompt": PROMPT,
                    "stream": True,
                    "stream_options": {"include_usage": 1},
                    "kv_transfer_params": params,
                }
            ),
            400,
        ),
    ]:
        async with decode.http.post(decode.url + "/v1/completions", data=body) as resp:
            assert resp.status == status
            assert_openai_error(await resp.json())
    assert (await decode.load())["used"] == 0


@pytest.mark.parametrize("header", [TTFT_LEFT_HEADER, TPOT_SLO_HEADER])
async def test_a_gateway_header_beyond_any_float_sets_nothing_and_holds_no_slot(
    pair: tuple[Shim, Shim], header: str
) -> None:
    """It answered 500 after the slot was taken, and the slot stayed taken for good."""
    prefill, decode = pair
    reply = await prefill.prefilled(PROMPT)
    body = orjson.dumps(_decode_body(reply, max_tokens=3))
    headers = {header: "1" + "0" * 400}
    async with decode.http.post(decode.url + "/v1/completions", data=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["usage"]["completion_tokens"] == 3
    await wait_load(decode, "used", 0)


async def test_decode_registers_as_decode(start_shim: StartShim, registry: MemoryRegistry) -> None:
    decode = await start_shim(Role.DECODE, capacity=5)
    (record,) = await registry.snapshot()
    assert record.role == Role.DECODE
    assert record.capacity == 5
    assert record.url == decode.url
    # It answers 429 when full (above), and says so: a gateway bounds its pace by its slots.
    assert EXT_QUEUELESS in record.extensions
    load = await decode.load()
    assert load["role"] == "decode"
    assert load["capacity"] == 5
    assert load["free"] == 5


async def test_non_streaming_client_leaving_frees_the_decode_slot(start_shim: StartShim) -> None:
    prefill = await start_shim(Role.PREFILL, capacity=4)
    decode = await start_shim(Role.DECODE, capacity=1)
    body = _decode_body(await prefill.prefilled(PROMPT), max_tokens=2000)
    task = asyncio.create_task(decode.post(body))
    await wait_load(decode, "running", 1)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    load = await wait_load(decode, "used", 0, within=1.0)
    assert load["running"] == 0
    assert load["cancelled"] == 1


async def test_sequences_share_the_running_batch_in_real_time(pair: tuple[Shim, Shim]) -> None:
    prefill, decode = pair
    prompts = [f"{PROMPT} #{i}" for i in range(4)]
    replies = [await prefill.prefilled(p) for p in prompts]
    loop = asyncio.get_running_loop()
    started = loop.time()
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, (await decode.load())["running"])
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    try:
        results = await asyncio.gather(
            *(
                decode.post(_decode_body(r, p, max_tokens=30))
                for r, p in zip(replies, prompts, strict=True)
            )
        )
    finally:
        watcher.cancel()
    elapsed = loop.time() - started
    assert all(status == 200 for status, _, _ in results)
    assert all(body["usage"]["completion_tokens"] == 30 for _, body, _ in results)
    assert peak > 1  # continuous batching: they ran together
    assert elapsed >= 30 * 0.006  # 30 steps of >= 6 ms each on the H100 profile


async def test_null_profile_answers_at_once(start_shim: StartShim) -> None:
    prefill = await start_shim(Role.PREFILL, sim_profile="null")
    null = await start_shim(Role.DECODE, sim_profile="null")
    paced = await start_shim(Role.DECODE)  # the H100 profile: 6 ms or more a step
    bodies = [_decode_body(await prefill.prefilled(PROMPT), max_tokens=200) for _ in range(2)]
    at_pace = asyncio.create_task(paced.post(bodies[1]))
    status, body, _ = await null.post(bodies[0])
    assert status == 200
    assert body["usage"]["completion_tokens"] == 200
    assert not at_pace.done()  # the same 200 tokens, sent at the same time, at a pace
    assert (await at_pace)[0] == 200


# -- logprobs -------------------------------------------------------------------------------


def _merged(lps: list[dict[str, Any]]) -> dict[str, list[Any]]:
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {k: [v for lp in lps for v in lp[k]] for k in keys}


async def test_logprobs_go_through_prefill_and_decode(pair: tuple[Shim, Shim]) -> None:
    prefill, decode = pair
    reply = await prefill.prefilled(PROMPT, logprobs=2)
    first = reply["choices"][0]["logprobs"]
    events = await decode.stream(_decode_body(reply, max_tokens=12, logprobs=2))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    # Every chunk carries the logprobs of its own tokens.
    for c in chunks:
        lp = c["choices"][0]["logprobs"]
        assert "".join(lp["tokens"]) == c["choices"][0]["text"]
    got = _merged([c["choices"][0]["logprobs"] for c in chunks])
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert len(got["tokens"]) == 12
    assert "".join(got["tokens"]) == text
    assert got["text_offset"] == [len("".join(got["tokens"][:i])) for i in range(12)]
    for token, logprob, top in zip(
        got["tokens"], got["token_logprobs"], got["top_logprobs"], strict=True
    ):
        assert len(top) == 2
        assert list(top.values()) == sorted(top.values(), reverse=True)
        assert next(iter(top)) == token  # greedy: the sampled token is the most likely
        assert top[token] == logprob < 0
    # The decode's token 0 is the prefill's, logprobs included.
    assert got["tokens"][0] == first["tokens"][0]
    assert got["token_logprobs"][0] == first["token_logprobs"][0]
    assert got["top_logprobs"][0] == first["top_logprobs"][0]

    # Whole, the same logprobs in one piece; deterministic.
    again = await prefill.prefilled(PROMPT, logprobs=2)
    status, whole, _ = await decode.post(_decode_body(again, max_tokens=12, logprobs=2))
    assert status == 200, whole
    assert whole["choices"][0]["text"] == text
    assert whole["choices"][0]["logprobs"] == got

    # logprobs=0: just the sampled token's; none asked: null.
    third = await prefill.prefilled(PROMPT)
    status, plain, _ = await decode.post(_decode_body(third, max_tokens=3, logprobs=0))
    assert all(len(top) == 1 for top in plain["choices"][0]["logprobs"]["top_logprobs"])
    assert plain["choices"][0]["logprobs"]["token_logprobs"] == got["token_logprobs"][:3]


async def test_logprobs_with_a_stop_sequence_cover_every_generated_token(
    pair: tuple[Shim, Shim],
) -> None:
    prefill, decode = pair
    events = await decode.stream(_decode_body(await prefill.prefilled(PROMPT), max_tokens=40))
    full = "".join(e["choices"][0]["text"] for e in events[:-1])
    stop = full[len(full) // 2 : len(full) // 2 + 4]
    body = _decode_body(await prefill.prefilled(PROMPT), max_tokens=40, stop=stop, logprobs=1)
    status, whole, _ = await decode.post(body)
    assert status == 200, whole
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "stop"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == whole["usage"]["completion_tokens"]
    # The tokens' text runs up to and through the stop sequence; the text stops before it.
    assert "".join(lp["tokens"]).startswith(choice["text"] + stop[:1])


# -- SSE ------------------------------------------------------------------------------------


async def test_stream_waiting_for_its_kv_sends_pings_and_vllm_framing(
    start_shim: StartShim, registry: MemoryRegistry
) -> None:
    decode = await start_shim(Role.DECODE, capacity=2, sse_ping_interval_s=0.05)
    n = tokenizer.count(PROMPT)

    async def slow(request: Request) -> Response:
        await asyncio.sleep(0.4)
        return kv_response(n, b"\x01" * 64)

    async with fake_prefill(slow, registry) as port:
        body = {
            "model": MODEL,
            "prompt": PROMPT,
            "max_tokens": 3,
            "stream": True,
            "kv_transfer_params": kv_params(port),
        }
        async with decode.http.post(decode.url + "/v1/completions", data=orjson.dumps(body)) as r:
            assert r.status == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            raw = await r.read()
    head, _, rest = raw.partition(b"data: ")
    assert head.count(b": ping\n\n") >= 3, raw  # while the KV was on its way
    assert head.replace(b": ping\n\n", b"") == b""
    # vLLM's framing: "data: {json}\n\n" per event, then "data: [DONE]\n\n".
    frames = (b"data: " + rest).split(b"\n\n")
    assert frames[-2:] == [b"data: [DONE]", b""]
    data = [f for f in frames[:-2] if not f.startswith(b": ")]
    assert len(data) == 3
    assert all(f.startswith(b"data: {") and orjson.loads(f[6:])["choices"] for f in data)


async def test_no_shutdown_watcher_of_sse_starlette_runs(pair: tuple[Shim, Shim]) -> None:
    # pdgate owns shutdown (see engine_shim/_sse.py): no process-wide polling task.
    prefill, decode = pair
    events = await decode.stream(_decode_body(await prefill.prefilled(PROMPT), max_tokens=2))
    assert events[-1] == "[DONE]"
    names = {t.get_coro().__qualname__ for t in asyncio.all_tasks()}  # type: ignore[union-attr]
    assert "_shutdown_watcher" not in names, sorted(names)


async def test_a_client_that_stops_reading_is_dropped_after_the_send_timeout(
    start_shim: StartShim,
) -> None:
    prefill = await start_shim(Role.PREFILL, capacity=2, sim_profile="null")
    decode = await start_shim(Role.DECODE, capacity=1, sim_profile="null", sse_send_timeout_s=0.3)
    reply = await prefill.prefilled(PROMPT)
    body = orjson.dumps(_decode_body(reply, max_tokens=30000, stream=True))
    host, port = decode.url.removeprefix("http://").split(":")
    loop = asyncio.get_running_loop()
    with socket.socket() as sock:
        # A reader that never reads, with a small window: the decode's writes back up.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await loop.sock_connect(sock, (host, int(port)))
        await loop.sock_sendall(
            sock,
            b"POST /v1/completions HTTP/1.1\r\nhost: decode\r\n"
            + f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode()
            + body,
        )
        await wait_load(decode, "running", 1)
        load = await wait_load(decode, "used", 0, within=5.0)  # connection still open
        assert (load["running"], load["cancelled"], load["completed"]) == (0, 1, 0)
