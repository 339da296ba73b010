"""First token early (``first_token_early``): a streaming client gets the prefill's token as
soon as the prefill answers, and the decode continues from prompt + that token.

Against `MockUpstream`: the first chunk reaches the client while the decode has not even
answered (the fake decode waits for the client to have it), the decode leg is the
continuation (prompt ids + the first token's id, one token fewer), the text equals the flag
off's, and stock decodes get vLLM's handshake unchanged. Through real processes (sim shims):
greedy text identical with the flag on and off, completions and chat, and the first chunk
arrives while the decode process is stopped (SIGSTOP).
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import httpx
import orjson

from pdgate.config.openai_api import Api
from pdgate.config.wire import COMPLETIONS_PATH
from pdgate.gateway.upstream.mock import MockUpstream
from tests._cluster import SIM_MODEL, Processes, wait_instances
from tests.gateway import _tokens as tokens
from tests.gateway._fakes import Sink, eventually


async def _run(
    cluster: tokens.TokenCluster,
    body: dict[str, Any] | None = None,
    *,
    extensions: tuple[str, ...] | None = None,
    **options: Any,
) -> tuple[str, Sink, MockUpstream]:
    done = await tokens.relay_tokens(cluster, body, decode_extensions=extensions, **options)
    return done.outcome, done.sink, done.upstream


async def test_the_first_chunk_reaches_the_client_before_the_decode_answers() -> None:
    gate = asyncio.Event()
    sink = Sink()
    task = asyncio.ensure_future(
        _run(tokens.TokenCluster(decode_gate=gate), sink=sink, first_token_early=True)
    )
    # The decode answers only once the client has its first chunk: without the early token
    # this would wait for ever.
    await eventually(lambda: b"data:" in sink.body)
    first = sink.events()[0]
    assert first["choices"][0]["text"] == tokens.word(tokens.next_id(tokens.encode(tokens.PROMPT)))
    assert first["id"] == "req-1"
    gate.set()
    outcome, _, upstream = await task
    assert outcome == "ok"
    events = sink.events()
    assert (
        tokens.text_of(events) == tokens.expected_text(tokens.PROMPT, tokens.N)
        and events[-1] == "[DONE]"
    )
    assert all("token_ids" not in c for e in events[:-1] for c in e["choices"])
    # The decode continued from prompt + the token the client saw.
    decode = next(c for c in upstream.calls if c.leg == "decode")
    assert decode.path == COMPLETIONS_PATH
    assert decode.body["prompt"] == [
        *tokens.encode(tokens.PROMPT),
        tokens.next_id(tokens.encode(tokens.PROMPT)),
    ]
    assert decode.body["max_tokens"] == tokens.N - 1
    assert decode.body["kv_transfer_params"]["remote_host"] == "p0"


async def test_greedy_text_and_usage_are_the_same_with_the_flag_on_and_off() -> None:
    body = tokens.stream_body(stream_options={"include_usage": True}, return_token_ids=True)
    runs = {}
    for early in (False, True):
        outcome, sink, _ = await _run(tokens.TokenCluster(), body, first_token_early=early)
        assert outcome == "ok"
        events = [e for e in sink.events() if isinstance(e, dict)]
        ids = [t for e in events for c in e["choices"] for t in c.get("token_ids", [])]
        runs[early] = (tokens.text_of(events), events[-1]["usage"], ids)
    assert runs[True] == runs[False]
    assert runs[True][2] == tokens.generate(tokens.encode(tokens.PROMPT), tokens.N)


async def test_chat_gets_its_role_then_the_first_token_early() -> None:
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": "m", "messages": messages, "max_tokens": tokens.N, "stream": True}
    texts = {}
    for early in (False, True):
        gate = asyncio.Event()
        sink = Sink()
        task = asyncio.ensure_future(
            _run(tokens.TokenCluster(decode_gate=gate), body, sink=sink, api=Api.CHAT,
                 first_token_early=early)
        )  # fmt: skip
        if early:
            await eventually(lambda s=sink: s.body.count(b"data:") == 2)  # type: ignore[misc]
            role, first = sink.events()
            assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert first["choices"][0]["delta"]["content"] == tokens.word(
                tokens.next_id(tokens.encode("<user>hi"))
            )
        gate.set()
        _, sink, _ = await task
        events = sink.events()
        assert {e["object"] for e in events[:-1]} == {"chat.completion.chunk"}
        texts[early] = tokens.text_of(events, chat=True)
    assert texts[True] == texts[False] == tokens.expected_text(messages, tokens.N)


async def test_stock_decodes_get_vllms_handshake_unchanged() -> None:
    bodies = {}
    for early in (False, True):
        _, sink, upstream = await _run(
            tokens.TokenCluster(), extensions=(), first_token_early=early
        )
        assert tokens.text_of(sink.events()) == tokens.expected_text(tokens.PROMPT, tokens.N)
        bodies[early] = [(c.leg, c.path, _without_kv_id(c.body)) for c in upstream.calls
                         if c.leg != "release"]  # fmt: skip
    assert bodies[True] == bodies[False]
    assert all("return_token_ids" not in body for _, _, body in bodies[True])


def _without_kv_id(body: Any) -> Any:
    """`body` without the KV handle's random name."""
    params = body.get("kv_transfer_params") or {}
    kept = {k: v for k, v in params.items() if "request_id" not in k}
    return {**body, "kv_transfer_params": kept}


async def test_a_decode_failing_after_the_early_token_is_continued_from_it() -> None:
    outcome, sink, upstream = await _run(
        tokens.TokenCluster(faults=[tokens.Fault("status")]), first_token_early=True
    )
    assert outcome == "ok"
    assert tokens.text_of(sink.events()) == tokens.expected_text(
        tokens.PROMPT, tokens.N
    )  # the first token once
    prefills = [c for c in upstream.calls if c.leg == "prefill"]
    first = tokens.next_id(tokens.encode(tokens.PROMPT))
    assert prefills[1].body["prompt"] == [*tokens.encode(tokens.PROMPT), first]


async def test_a_first_token_that_may_begin_a_stop_string_is_not_sent_early() -> None:
    first = tokens.word(tokens.next_id(tokens.encode(tokens.PROMPT)))
    body = tokens.stream_body(stop=[first[-1] + "\u2603"])
    outcome, sink, upstream = await _run(tokens.TokenCluster(), body, first_token_early=True)
    assert outcome == "ok"
    decode = next(c for c in upstream.calls if c.leg == "decode")
    assert decode.body["prompt"] == tokens.PROMPT  # the normal leg: the decode holds it back itself
    assert tokens.text_of(sink.events()) == tokens.expected_text(tokens.PROMPT, tokens.N)


# -- real processes ---------------------------------------------------------------------------

PROMPTS = [
    "Explain prefill and decode in one paragraph.",
    "Why would a gateway send the first token before the decode starts?",
]
CHAT = [{"role": "user", "content": "Tell me about KV caches."}]


def _stream(url: str, path: str, body: dict[str, Any]) -> list[Any]:
    events: list[Any] = []
    with httpx.stream("POST", url + path, json=body, timeout=30) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else orjson.loads(data))
    assert events[-1] == "[DONE]"
    assert all("error" not in e for e in events[:-1]), events
    return events


def test_sim_greedy_text_is_identical_with_the_flag_on_and_off(processes: Processes) -> None:
    processes.shim("prefill", "--capacity", "4")
    decode = processes.shim("decode", "--capacity", "8")
    gateways = {}
    for early in (False, True):
        flags = {
            "PDGATE_GATEWAY_FIRST_TOKEN_EARLY": str(early).lower(),
            "PDGATE_GATEWAY_DECODE_HEADER_TIMEOUT_S": "20",
        }
        gateways[early] = processes.gateway(env=flags)
    for url in gateways.values():
        wait_instances(url, 2)

    usage = {"stream_options": {"include_usage": True}, "temperature": 0}
    results: dict[bool, list[Any]] = {}
    for early, url in gateways.items():
        out: list[Any] = []
        for prompt in PROMPTS:
            body = {"model": SIM_MODEL, "prompt": prompt, "max_tokens": 24, "stream": True,
                    "return_token_ids": True, **usage}  # fmt: skip
            events = _stream(url, "/v1/completions", body)
            ids = [t for e in events[:-1] for c in e["choices"] for t in c.get("token_ids", [])]
            out.append((tokens.text_of(events), events[-2]["usage"], ids))
        body = {"model": SIM_MODEL, "messages": CHAT, "max_tokens": 24, "stream": True, **usage}
        events = _stream(url, "/v1/chat/completions", body)
        out.append((tokens.text_of(events, chat=True), events[-2]["usage"]))
        results[early] = out
    assert results[True] == results[False]
    assert all(len(r[2]) == 24 for r in results[True][:2])
    # Every decode took the prompt one token longer than its KV at once (EXT_CONTINUATION):
    # no leg failed and was placed again.
    metrics = httpx.get(gateways[True] + "/metrics", timeout=5).text
    failovers = [line for line in metrics.splitlines()
                 if line.startswith("pdgate_decode_failovers_total{")]  # fmt: skip
    assert all(line.endswith(" 0.0") for line in failovers), failovers

    # Ordering, not timing: with the decode process stopped, the client still gets its first
    # chunk (the prefill's token); the rest comes once the decode runs again.
    body = {"model": SIM_MODEL, "prompt": PROMPTS[0], "max_tokens": 24, "stream": True}
    os.kill(decode.proc.pid, signal.SIGSTOP)
    try:
        with httpx.stream("POST", gateways[True] + "/v1/completions", json=body,
                          timeout=30) as resp:  # fmt: skip
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            os.kill(decode.proc.pid, signal.SIGCONT)
            rest = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    finally:
        os.kill(decode.proc.pid, signal.SIGCONT)
    events = [orjson.loads(first.removeprefix("data: ")), *map(_load, rest)]
    assert tokens.text_of(events) == results[True][0][0]


def _load(data: str) -> Any:
    return data if data == "[DONE]" else orjson.loads(data)
