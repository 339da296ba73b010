"""A decode lost during a tool call, for every API: before its first event the request goes
to another decode and the client sees one whole call; mid-call (a tool call cannot be
continued from token ids) the stream ends with a clean in-band error in the API's shape.
Every count and KV is released either way."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import orjson
import pytest

from pdgate.config.openai_api import Api, sse_event
from pdgate.config.wire import CHAT_PATH, SSE_DONE
from pdgate.gateway.stream.relay import Relay, RelayOptions, RelayRequest
from pdgate.gateway.translate.messages import MessagesFront
from pdgate.gateway.translate.responses import ResponsesFront
from pdgate.gateway.upstream.mock import Call, MockUpstream
from pdgate.policies.base import RequestInfo
from pdgate.registry.responses import MemoryResponseStore
from tests.gateway._fakes import Sink, dispatcher, eventually
from tests.gateway._tokens import MODEL, Fault, TokenCluster, token_tracker

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
FRAGMENTS = ('{"city"', ': "Os', 'lo", "unit"', ': "C"}')


@dataclass
class ToolCluster(TokenCluster):
    """A decode that answers a chat with tools by calling the tool, in vLLM's chunks."""

    def _decode(self, call: Call) -> list[bytes]:
        body = call.body
        assert body is not None
        if call.path != CHAT_PATH or not body.get("tools"):
            return super()._decode(call)
        head = {
            "id": "decode-own-id",
            "object": "chat.completion.chunk",
            "created": 9,
            "model": MODEL,
        }

        ids = bool(body.get("return_token_ids"))

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            if ids:
                choice["token_ids"] = [] if "role" in delta else [7]
            return sse_event({**head, "choices": [choice]})

        out = [chunk({"role": "assistant", "content": ""})]
        if ids:  # with every id a continuation would need: only the tools stop it
            out[0] = sse_event({**orjson.loads(out[0][6:]), "prompt_token_ids": [1, 2, 3]})
        call_head = {"index": 0, "id": "call_1", "type": "function"}
        out.append(
            chunk(
                {
                    "tool_calls": [
                        {**call_head, "function": {"name": "get_weather", "arguments": ""}}
                    ]
                }
            )
        )
        out += [
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": f}}]}) for f in FRAGMENTS
        ]
        out.append(chunk({}, "tool_calls"))
        usage = {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}
        out.append(sse_event({**head, "choices": [], "usage": usage}))
        out.append(SSE_DONE)
        return out


async def _front(api: str) -> Any:
    if api == "responses":
        front: Any = ResponsesFront(
            MemoryResponseStore(), max_tokens_limit=64, default_max_tokens=16
        )
        body = {
            "model": MODEL,
            "input": "Weather in Oslo?",
            "stream": True,
            "tools": [
                {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
            ],
        }
    elif api == "messages":
        front = MessagesFront(max_tokens_limit=64)
        body = {
            "model": MODEL,
            "max_tokens": 16,
            "stream": True,
            "messages": [{"role": "user", "content": "Weather in Oslo?"}],
            "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
        }
    else:
        return None
    return await front.translate(orjson.dumps(body), None)


async def _relay(api: str, faults: list[Fault | None]) -> tuple[str, Sink]:
    upstream = MockUpstream(ToolCluster(faults=list(faults)))
    tracker = token_tracker()
    d, metrics = dispatcher(upstream, tracker)
    sink = Sink()
    translated = await _front(api)
    if translated is None:  # a client's own chat request
        from pdgate.config.openai_api import parse_chat

        raw = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Weather in Oslo?"}],
            "tools": [TOOL],
            "stream": True,
            "max_tokens": 16,
        }
        req, forward = parse_chat(orjson.dumps(raw), max_tokens_limit=64)
        out = None
    else:
        req, forward, out = translated.req, translated.forward, translated.out(sink, "req-1")
    now = time.monotonic()
    info = RequestInfo(model=MODEL, group=None, prompt=req.prompt_key,
                       prompt_chars=len(req.prompt_key), max_tokens=16)  # fmt: skip
    request = RelayRequest(info, req, forward, Api.CHAT, "req-1", now + 2, now)
    relay = Relay(d, sink, request, RelayOptions(max_migrations=2), metrics, out=out)
    try:
        outcome = await relay.run()
        await eventually(lambda: tracker.totals() == (0, 0))
        # A decode lost before its first event may not have pulled its KV: it is released
        # at the prefill, once; one lost later had it.
        lost_early = sum(1 for f in faults if f is not None and f.after == 0)
        assert len(upstream.released()) == lost_early
    finally:
        if relay.first is not None:
            relay.first.close()
        await d.close()
    return outcome, sink


def _named(sink: Sink) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in sink.body.decode().split("\n\n"):
        if block.startswith("event: "):
            name, data = block.split("\n")
            out.append((name.removeprefix("event: "), orjson.loads(data.removeprefix("data: "))))
    return out


def _arguments(api: str, sink: Sink) -> str:
    if api == "responses":
        return next(
            d["arguments"] for n, d in _named(sink) if n == "response.function_call_arguments.done"
        )
    if api == "messages":
        return "".join(
            d["delta"]["partial_json"]
            for n, d in _named(sink)
            if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta"
        )
    return "".join(
        c["delta"]["tool_calls"][0]["function"].get("arguments", "")
        for e in sink.events()
        if isinstance(e, dict)
        for c in e.get("choices") or ()
        if c["delta"].get("tool_calls")
    )


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
async def test_a_decode_lost_before_its_first_event_is_replaced_unseen(api: str) -> None:
    outcome, sink = await _relay(api, [Fault("lost", after=0)])
    assert outcome == "ok" and sink.status == 200
    assert _arguments(api, sink) == "".join(FRAGMENTS)
    if api == "chat":
        assert sink.events()[-1] == "[DONE]"
        assert not any("error" in e for e in sink.events() if isinstance(e, dict))
    else:
        names = [n for n, _ in _named(sink)]
        assert names[-1] == ("response.completed" if api == "responses" else "message_stop")
        assert "error" not in names


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
async def test_a_decode_lost_mid_tool_call_ends_with_an_in_band_error(
    api: str, caplog: pytest.LogCaptureFixture
) -> None:
    outcome, sink = await _relay(api, [Fault("lost", after=3)])
    assert "tools cannot be continued by a plain completion" in caplog.text
    assert outcome == "upstream_error" and sink.status == 200
    # The call had begun: the client saw part of its arguments, never a second head.
    assert _arguments(api, sink) == FRAGMENTS[0]
    if api == "chat":
        events = sink.events()
        assert events[-1] == "[DONE]"
        assert "mid-stream" in events[-2]["error"]["message"]
        return
    named = _named(sink)
    if api == "responses":
        assert [n for n, _ in named][-2:] == ["error", "response.failed"]
        assert named[-1][1]["response"]["status"] == "failed"
    else:
        assert named[-1][0] == "error"
        assert named[-1][1]["error"]["type"] == "api_error"
    assert not sink.messages[-1]["more_body"]
