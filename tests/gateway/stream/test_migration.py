"""P/D-aware decode failover and stream migration (gateway/stream/relay.py,
gateway/stream/continuation.py).

Against `MockUpstream` (a fake whose greedy text is a function of the whole context, tests/
gateway/_tokens.py): a decode that fails before its first event is invisible (the same KV
for the next decode when it was never reached, a re-prefill when it answered); a stream that
breaks mid-way is continued from prompt ids + the ids already sent, without repeated or
missing text, ids stripped, usage over every leg, up to ``max_migrations``, every count and
KV released once. Through real processes: a gateway, a prefill and two sim decodes, streaming
clients, and one decode killed with SIGKILL mid-stream: no client notices.
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import httpx
import orjson
import pytest

from pdgate.config.wire import COMPLETIONS_PATH
from pdgate.gateway.errors import BadGateway, BadRequest
from pdgate.gateway.upstream.mock import MockUpstream
from tests._cluster import SIM_MODEL, Processes, Subprocess, wait_instances
from tests.gateway._fakes import dispatcher, eventually, relay
from tests.gateway._tokens import (
    PROMPT,
    Fault,
    N,
    TokenCluster,
    encode,
    expected_text,
    generate,
    relay_tokens,
    stream_body,
    text_of,
    token_tracker,
    word,
)


async def _run(
    faults: list[Fault | None], body: dict[str, Any] | None = None, **options: Any
) -> tuple[str, Any, Any, MockUpstream, Any]:
    options.setdefault("max_migrations", 2)
    done = await relay_tokens(TokenCluster(faults=list(faults)), body, **options)
    return done.outcome, done.relay, done.sink, done.upstream, done.metrics


def _legs(upstream: MockUpstream, leg: str) -> list[Any]:
    return [c for c in upstream.calls if c.leg == leg]


# -- failures before the first event --------------------------------------------------------


@pytest.mark.parametrize("kind", ["status", "lost", "error", "truncated"])
async def test_a_decode_that_fails_before_its_first_event_is_invisible(kind: str) -> None:
    outcome, _, sink, upstream, metrics = await _run([Fault(kind)], max_migrations=0)
    assert outcome == "ok" and sink.status == 200
    events = sink.events()
    assert text_of(events) == expected_text(PROMPT, N) and events[-1] == "[DONE]"
    assert all("error" not in e for e in events if isinstance(e, dict))
    # Its KV may be gone: placed again, prefill included, with the client's own body.
    prefills = _legs(upstream, "prefill")
    assert len(prefills) == 2 and prefills[0].body == prefills[1].body
    assert len(upstream.released()) == 1  # the broken leg's KV, once
    value = metrics.registry.get_sample_value("pdgate_decode_failovers_total", {"reason": kind})
    assert value == 1


@pytest.mark.parametrize(
    ("migrations", "body"),
    [(2, stream_body()), (0, stream_body()), (2, stream_body(return_token_ids=True))],
    ids=["events", "bytes", "client-ids"],
)
async def test_every_token_relayed_is_counted_and_timed_once(
    migrations: int, body: dict[str, Any]
) -> None:
    """Each relay path (events as bytes or parsed, bytes passed through) counts the tokens
    a decode served and times the gaps between them: the ratio advice and the ITL
    histogram read them."""
    outcome, relay, sink, _, metrics = await _run([None], body, max_migrations=migrations)
    assert outcome == "ok" and text_of(sink.events()) == expected_text(PROMPT, N)
    assert relay.first.tokens == N and relay.first.first_token_at is not None
    assert relay.first.gaps_s >= 0
    assert metrics.registry.get_sample_value("pdgate_inter_token_seconds_count") == N - 1
    assert metrics.registry.get_sample_value("pdgate_ttft_seconds_count", {"group": "*"}) == 1


async def test_a_decode_never_reached_passes_the_same_kv_to_the_next() -> None:
    _, _, sink, upstream, _ = await _run([Fault("unreachable")])
    assert text_of(sink.events()) == expected_text(PROMPT, N)
    decodes = _legs(upstream, "decode")
    assert len(_legs(upstream, "prefill")) == 1 and len(decodes) == 2
    assert decodes[0].url != decodes[1].url
    kv = [c.body["kv_transfer_params"] for c in decodes]
    assert kv[0] == kv[1]
    assert upstream.released() == []


async def test_decode_failovers_count_against_the_retry_budget() -> None:
    upstream = MockUpstream(TokenCluster(faults=[Fault("status")] * 50))
    tracker = token_tracker()
    d, metrics = dispatcher(upstream, tracker, retry_budget_burst=2, retry_budget_ratio=0)
    with pytest.raises(BadGateway):  # before anything was sent: a real status
        await relay(d, metrics)
    # The burst of two retries, then no more: a failing pool is not hammered.
    assert len(_legs(upstream, "decode")) == 3
    assert metrics.registry.get_sample_value("pdgate_retry_budget_exhausted_total") == 1
    await eventually(lambda: tracker.totals() == (0, 0))
    assert len(upstream.released()) == 3
    await d.close()


async def test_migrations_do_not_draw_on_the_retry_budget() -> None:
    """A decode that dies takes all its streams at once: each migrates, budget or not
    (`max_migrations` bounds what each can add)."""
    upstream = MockUpstream(TokenCluster(faults=[Fault("lost", after=3)] * 2))
    tracker = token_tracker()
    d, metrics = dispatcher(upstream, tracker, retry_budget_burst=1, retry_budget_ratio=0)
    assert d.budget.withdraw()  # spent
    outcome, r, sink = await relay(d, metrics, stream_body(), max_migrations=2)
    assert outcome == "ok" and r.migrations == 2
    assert text_of(sink.events()) == expected_text(PROMPT, N)
    await eventually(lambda: tracker.totals() == (0, 0))
    await d.close()


async def test_an_in_band_client_error_before_the_first_event_is_a_real_400() -> None:
    cluster = TokenCluster()

    async def handler(call: Any) -> Any:
        reply = await cluster(call)
        if call.leg == "decode":
            error = {"error": {"message": "no logprobs here", "type": "invalid_request_error"}}
            reply.chunks = [b"data: " + orjson.dumps(error) + b"\n\n", b"data: [DONE]\n\n"]
        return reply

    upstream = MockUpstream(handler)
    tracker = token_tracker()
    d, metrics = dispatcher(upstream, tracker)
    with pytest.raises(BadRequest, match="no logprobs"):
        await relay(d, metrics)
    assert len(_legs(upstream, "prefill")) == 1  # the request's own fault: not retried
    await eventually(lambda: tracker.totals() == (0, 0))
    await d.close()


# -- migration mid-stream ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["lost", "silent"])
async def test_a_decode_silent_on_every_stream_is_ejected_one_that_lost_one_is_not(
    kind: str,
) -> None:
    """The stall watchdog found the decode silent on all its streams: it is out of the
    rankings at once, not after `consecutive` failures (its other streams are moving too)."""
    outcome, r, sink, _, metrics = await _run([Fault(kind, after=3)])
    assert outcome == "ok" and r.migrations == 1
    assert text_of(sink.events()) == expected_text(PROMPT, N)
    ejected = metrics.registry.get_sample_value("pdgate_ejections_total", {"role": "decode"})
    assert (ejected or 0) == (1 if kind == "silent" else 0)


@pytest.mark.parametrize("kind", ["lost", "error", "truncated"])
async def test_a_stream_broken_mid_way_continues_without_repeats(kind: str) -> None:
    body = stream_body(stream_options={"include_usage": True})
    outcome, r, sink, upstream, metrics = await _run([Fault(kind, after=5)], body)
    assert outcome == "ok" and r.migrations == 1
    events = sink.events()
    assert events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict)]
    assert text_of(events) == expected_text(PROMPT, N)  # nothing repeated, nothing missing
    # One stream as far as the client can tell: one id, no ids it did not ask for.
    assert {e["id"] for e in chunks} == {"req-1"}
    assert {e["object"] for e in chunks} == {"text_completion"}
    for e in chunks:
        assert "prompt_token_ids" not in e
        for choice in e["choices"]:
            assert "token_ids" not in choice and "prompt_token_ids" not in choice
    usage = chunks[-1]["usage"]
    assert usage == {"prompt_tokens": len(encode(PROMPT)), "completion_tokens": N,
                     "total_tokens": len(encode(PROMPT)) + N}  # fmt: skip
    assert sum(1 for e in chunks if e.get("usage")) == 1
    # The continuation: prompt ids + the 5 ids sent, 5 fewer tokens, another decode.
    sent = generate(encode(PROMPT), 5)
    prefills, decodes = _legs(upstream, "prefill"), _legs(upstream, "decode")
    assert len(prefills) == 2 and len(decodes) == 2
    assert prefills[1].body["prompt"] == encode(PROMPT) + sent
    assert decodes[1].body["prompt"] == encode(PROMPT) + sent
    assert decodes[1].body["max_tokens"] == N - 5
    assert decodes[1].url != decodes[0].url
    assert decodes[0].body["return_token_ids"] is True
    # The prefill's ids are not needed (the decode's first event carries them): not asked.
    assert "return_token_ids" not in prefills[0].body
    value = metrics.registry.get_sample_value("pdgate_migrations_total", {"reason": kind})
    assert value == 1


async def test_chat_continues_token_exactly_as_chat_chunks() -> None:
    messages = [{"role": "user", "content": "hello there"}]
    body = {"model": "m", "messages": messages, "max_tokens": N, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    from pdgate.config.openai_api import Api

    outcome, _, sink, upstream, _ = await _run([Fault("lost", after=4)], body, api=Api.CHAT)
    assert outcome == "ok"
    events = sink.events()
    chunks = [e for e in events if isinstance(e, dict)]
    assert text_of(events, chat=True) == expected_text(messages, N)
    assert {e["object"] for e in chunks} == {"chat.completion.chunk"}
    assert {e["id"] for e in chunks} == {"req-1"}
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert sum(1 for e in chunks if e["choices"] and "role" in e["choices"][0]["delta"]) == 1
    assert chunks[-1]["usage"]["completion_tokens"] == N
    assert chunks[-1]["usage"]["prompt_tokens"] == len(encode("<user>hello there"))
    # The continuation went to /v1/completions with the chat's rendered prompt ids.
    decodes = _legs(upstream, "decode")
    assert decodes[1].path == COMPLETIONS_PATH
    assert "messages" not in decodes[1].body


async def test_ids_the_client_asked_for_go_on_across_the_boundary() -> None:
    _, _, sink, _, _ = await _run([Fault("lost", after=3)], stream_body(return_token_ids=True))
    chunks = [e for e in sink.events() if isinstance(e, dict)]
    ids = [t for e in chunks for c in e["choices"] for t in c.get("token_ids", [])]
    assert ids == generate(encode(PROMPT), N)
    prompts = [c["prompt_token_ids"] for e in chunks for c in e["choices"]
               if c.get("prompt_token_ids") is not None]  # fmt: skip
    assert prompts == [encode(PROMPT)]  # the client's prompt, once (vLLM's nulls after it)


async def test_the_migration_limit_is_honoured_then_the_error_is_in_band() -> None:
    faults = [Fault("lost", after=2)] * 3
    outcome, r, sink, upstream, _ = await _run(faults, max_migrations=2)
    assert outcome == "upstream_error" and r.migrations == 2
    events = sink.events()
    assert events[-1] == "[DONE]" and "error" in events[-2]
    assert text_of(events) == expected_text(PROMPT, 6)  # 3 legs of 2 tokens, no repeats
    assert len(_legs(upstream, "decode")) == 3


async def test_migration_off_keeps_the_byte_relay() -> None:
    outcome, _, sink, upstream, _ = await _run([Fault("lost", after=3)], max_migrations=0)
    assert outcome == "upstream_error"
    decode = _legs(upstream, "decode")[0]
    assert "return_token_ids" not in decode.body
    # The decode's own bytes, untouched (its own id: the fake is a pdgate-like decode whose id
    # is not the request's, so only that is rewritten), then the in-band error.
    sent = TokenCluster()._decode(decode)[:3]
    assert sink.body.startswith(b"".join(sent).replace(b"decode-own-id", b"req-1"))
    assert sink.events()[-1] == "[DONE]"


async def test_a_non_streaming_answer_survives_a_migration() -> None:
    body = {"model": "m", "prompt": PROMPT, "max_tokens": N}
    outcome, _, sink, _, _ = await _run([Fault("lost", after=4)], body)
    assert outcome == "ok" and sink.status == 200
    answer = orjson.loads(sink.body)
    assert answer["choices"][0]["text"] == expected_text(PROMPT, N)
    assert "token_ids" not in answer["choices"][0]
    assert "prompt_token_ids" not in answer["choices"][0]
    assert answer["usage"]["completion_tokens"] == N
    assert answer["usage"]["prompt_tokens"] == len(encode(PROMPT))
    assert answer["id"] == "req-1"


async def test_a_stream_that_broke_after_its_last_token_only_gets_its_tail() -> None:
    body = stream_body(stream_options={"include_usage": True})
    # All N token events went out; the usage chunk and [DONE] did not.
    outcome, r, sink, upstream, _ = await _run([Fault("lost", after=N)], body)
    assert outcome == "ok" and r.migrations == 0
    events = sink.events()
    assert text_of(events) == expected_text(PROMPT, N) and events[-1] == "[DONE]"
    assert events[-2]["usage"]["completion_tokens"] == N
    assert len(_legs(upstream, "prefill")) == 1


async def test_a_stop_string_across_the_boundary_ends_the_stream() -> None:
    ids = generate(encode(PROMPT), N)
    # The fake decode holds nothing back: the first leg sends up to token 4's text; the stop
    # string is the end of that text plus the start of token 5's.
    before = "".join(word(t) for t in ids[:4])
    stop = before[-2:] + word(ids[4])[:3]
    assert stop not in before
    body = stream_body(stop=[stop], stream_options={"include_usage": True})
    outcome, _, sink, _, _ = await _run([Fault("lost", after=4)], body)
    events = sink.events()
    assert outcome == "ok" and events[-1] == "[DONE]"
    assert text_of(events) == before  # nothing after the boundary: the match began before it
    finishes = [c["finish_reason"] for e in events[:-1] for c in e["choices"]]
    assert finishes[-1] == "stop"


async def test_stop_strings_on_a_stock_decode_are_not_migrated() -> None:
    upstream = MockUpstream(TokenCluster(faults=[Fault("lost", after=3)]))
    tracker = token_tracker(decode_extensions=())
    d, metrics = dispatcher(upstream, tracker)
    outcome, r, sink = await relay(d, metrics, stream_body(stop=["zzz"]), max_migrations=2)
    # A stock server may hold back text for a stop string while its ids went out: that
    # text would be lost, so the stream ends with an in-band error instead.
    assert outcome == "upstream_error" and r.migrations == 0
    assert "error" in sink.events()[-2]
    await eventually(lambda: tracker.totals() == (0, 0))
    await d.close()


async def test_a_client_leaving_during_a_migration_releases_everything() -> None:
    gate = asyncio.Event()
    cluster = TokenCluster(faults=[Fault("lost", after=3)])

    async def handler(call: Any) -> Any:
        if call.leg == "prefill" and len([c for c in upstream.calls if c.leg == "prefill"]) > 1:
            await gate.wait()  # the continuation's prefill never answers
        return await cluster(call)

    upstream = MockUpstream(handler)
    tracker = token_tracker()
    d, metrics = dispatcher(upstream, tracker)
    task = asyncio.ensure_future(relay(d, metrics, max_migrations=2))
    await eventually(lambda: len(_legs(upstream, "prefill")) == 2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await eventually(lambda: tracker.totals() == (0, 0))
    assert len(upstream.released()) == 1  # the abandoned continuation prefill's KV, by id
    await d.close()


# -- real processes: kill -9 a decode under streaming load --------------------------------

CLIENTS = 12
TOKENS = 120


async def _client(
    url: str, i: int, started: set[int], all_started: asyncio.Event
) -> dict[str, Any]:
    body = {"model": SIM_MODEL, "prompt": f"client {i} asks about disaggregated serving",
            "max_tokens": TOKENS, "stream": True, "temperature": 0}  # fmt: skip
    texts: list[str] = []
    done = False
    errors: list[Any] = []
    async with (
        httpx.AsyncClient(timeout=60) as http,
        http.stream("POST", url + "/v1/completions", json=body) as resp,
    ):
        status = resp.status_code
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done = True
                continue
            event = orjson.loads(data)
            if "error" in event:
                errors.append(event["error"])
                continue
            texts.extend(c["text"] for c in event["choices"])
            if len(texts) >= 5:
                started.add(i)
                if len(started) == CLIENTS:
                    all_started.set()
    return {"status": status, "text": "".join(texts), "done": done, "errors": errors}


async def stream_and_break(
    url: str, procs: dict[str, Subprocess], sig: signal.Signals = signal.SIGKILL
) -> tuple[list[dict[str, Any]], str]:
    started: set[int] = set()
    all_started = asyncio.Event()
    tasks = [asyncio.ensure_future(_client(url, i, started, all_started)) for i in range(CLIENTS)]
    # Kill (or stop) one decode once every client is well into its stream.
    await asyncio.wait_for(all_started.wait(), 30)
    victim = "d0"
    os.kill(procs[victim].proc.pid, sig)
    return await asyncio.gather(*tasks), victim


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["kill", "stop"])
def test_losing_a_decode_mid_stream_goes_unnoticed(
    processes: Processes, sig: signal.Signals
) -> None:
    """SIGKILL drops the decode's connections: the streams move at once. SIGSTOP leaves
    them open and silent (a hung decode): without the stall timeout they waited for the
    60 s read timeout; now they move after one second of silence."""
    sim = {"PDGATE_SHIM_SIM_PROFILE": "llama-3.1-8b-a100"}
    processes.shim("prefill", "--capacity", "8", env=sim)
    decodes = {
        name: processes.shim("decode", "--capacity", "16", "--instance-id", name, env=sim)
        for name in ("d0", "d1")
    }
    url = processes.gateway(env={"PDGATE_GATEWAY_DECODE_STALL_TIMEOUT_S": "1"})
    wait_instances(url, 3)

    # The greedy text of every prompt, from an undisturbed run.
    expected = asyncio.run(undisturbed_texts(url))
    try:
        results, victim = asyncio.run(stream_and_break(url, decodes, sig))
    finally:
        if sig is signal.SIGSTOP:
            os.kill(decodes["d0"].proc.pid, signal.SIGCONT)
    if sig is signal.SIGKILL:
        assert decodes[victim].proc.wait(5) == -signal.SIGKILL
    assert_unnoticed(url, results, expected)


def assert_unnoticed(url: str, results: list[dict[str, Any]], expected: list[str]) -> None:
    """Every client got its whole undisturbed text, and some stream did move."""
    noticed = [
        (i, r) for i, r in enumerate(results)
        if r["status"] != 200 or not r["done"] or r["errors"] or r["text"] != expected[i]
    ]  # fmt: skip
    assert noticed == [], noticed
    metrics = httpx.get(url + "/metrics", timeout=5).text
    migrated = sum(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("pdgate_migrations_total{")
    )
    assert migrated >= 1, "the killed instance was serving no stream: nothing was tested"


async def undisturbed_texts(url: str) -> list[str]:
    started: set[int] = set()
    event = asyncio.Event()
    results = await asyncio.gather(*(_client(url, i, started, event) for i in range(CLIENTS)))
    assert all(r["done"] and not r["errors"] for r in results)
    return [r["text"] for r in results]
