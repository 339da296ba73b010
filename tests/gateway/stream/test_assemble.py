"""Assembling a whole OpenAI answer from a decode's stream (non-streaming clients)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from pdgate.gateway.stream.assemble import Assembler, StreamError, one_event, sse_events


def feed(events: list[dict[str, Any]]) -> dict[str, Any]:
    a = Assembler()
    for e in events:
        a.feed(orjson.dumps(e))
    a.feed(b"[DONE]")
    assert a.done
    return a.result()


def test_sse_events_split_on_either_line_ending_and_skip_comments() -> None:
    buf = bytearray(b': ping\n\ndata: {"a":1}\n\ndata: [DONE]\r\n\r\ndata: {"b"')
    assert sse_events(buf) == [b'{"a":1}', b"[DONE]"]
    assert bytes(buf) == b'data: {"b"'  # an incomplete event waits for more bytes


_STREAM = (
    b': ping\n\ndata: {"a":1}\n\ndata:{"b":2}\n\n\n\nevent: x\ndata: {"c":\ndata: 3}\n\n'
    b"id: 7\n\ndata: [DONE]\n\n"
)


@pytest.mark.parametrize("cut", range(1, len(_STREAM)))
def test_sse_events_are_the_same_however_the_stream_is_cut(cut: int) -> None:
    """Two reads, cut anywhere (and LF endings turned into CRLF ones): the same events."""
    expected = [b'{"a":1}', b'{"b":2}', b'{"c":\n3}', b"[DONE]"]
    for stream in (_STREAM, _STREAM.replace(b"\n", b"\r\n")):
        buf = bytearray(stream[:cut])
        got = sse_events(buf)
        buf += stream[cut:]
        got += sse_events(buf)
        assert got == expected and not buf


_EVENTS = [b'data: {"a":1}\n\n', b"data:{}\n\n", b'data: {"x":"a\rb"}\n\n', b"data: {\ndata: }\n\n",
           b": ping\n\n", b"data: [DONE]\n\n"]  # fmt: skip


@pytest.mark.parametrize("cut", range(0, 12))
def test_sse_events_fed_chunk_by_chunk_match_one_buffer(cut: int) -> None:
    """Chunks handed in one by one as the relay does (a one-event chunk by `one_event` unless
    bytes are held back, the rest through the buffer) give what the whole stream gives at
    once, with the buffer left alike."""
    stream = b"".join(_EVENTS)
    chunks = [stream[:cut], *_EVENTS] if cut else _EVENTS
    buf = bytearray()
    got: list[bytes] = []
    for chunk in chunks:
        one = one_event(chunk) if not buf else None
        if one is not None:
            got.append(one)
        else:
            buf += chunk
            got += sse_events(buf)
    whole = bytearray(stream[:cut] + stream)
    assert got == sse_events(whole)
    assert bytes(buf) == bytes(whole)
    assert got[-1] == b"[DONE]"


def test_completion_text_logprobs_and_usage() -> None:
    head = {"id": "cmpl-9", "object": "text_completion", "created": 5, "model": "m"}
    lp1 = {"tokens": ["a"], "token_logprobs": [-0.1], "top_logprobs": [{"a": -0.1}],
           "text_offset": [0]}  # fmt: skip
    lp2 = {"tokens": ["b"], "token_logprobs": [-0.2], "top_logprobs": [{"b": -0.2}],
           "text_offset": [1]}  # fmt: skip
    out = feed(
        [
            {**head, "choices": [{"index": 0, "text": "a", "logprobs": lp1,
                                  "finish_reason": None}]},
            {**head, "choices": [{"index": 0, "text": "b", "logprobs": lp2, "finish_reason": "stop",
                                  "stop_reason": None}]},
            {**head, "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}},
        ]
    )  # fmt: skip
    assert out["object"] == "text_completion" and out["id"] == "cmpl-9"
    choice = out["choices"][0]
    assert choice["text"] == "ab" and choice["finish_reason"] == "stop"
    assert choice["logprobs"]["tokens"] == ["a", "b"]
    assert choice["logprobs"]["text_offset"] == [0, 1]
    assert out["usage"]["completion_tokens"] == 2


def test_chat_message_and_tool_calls_are_merged() -> None:
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "m"}

    def delta(d: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": d, "finish_reason": finish}]}

    out = feed(
        [
            delta({"role": "assistant", "content": ""}),
            delta({"content": "Hel"}),
            delta({"content": "lo"}),
            delta({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                   "function": {"name": "get", "arguments": "{\"q\""}}]}),
            delta({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}, "tool_calls"),
        ]
    )  # fmt: skip
    assert out["object"] == "chat.completion"
    message = out["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"] == "Hello"
    assert message["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "get", "arguments": '{"q": 1}'}}
    ]
    assert out["choices"][0]["finish_reason"] == "tool_calls"
    # A call with no text before it: null content, as a whole answer has it.
    calls_only = feed(
        [
            delta({"role": "assistant", "content": ""}),
            delta({"tool_calls": [{"index": 0, "id": "call_2", "type": "function",
                                   "function": {"name": "get", "arguments": ""}},
                                  {"index": 0, "function": {"arguments": "{}"}}]}),
            delta({}, "tool_calls"),
        ]
    )  # fmt: skip
    message = calls_only["choices"][0]["message"]
    assert message["content"] is None
    assert message["tool_calls"] == [
        {"id": "call_2", "type": "function", "function": {"name": "get", "arguments": "{}"}}
    ]


def test_an_in_band_error_or_garbage_is_a_stream_error() -> None:
    a = Assembler()
    with pytest.raises(StreamError, match="KV transfer failed"):
        a.feed(b'{"error": {"message": "KV transfer failed: gone", "type": "upstream_error"}}')
    with pytest.raises(StreamError, match="not JSON"):
        Assembler().feed(b"{nope")
    with pytest.raises(StreamError, match="without a completion"):
        Assembler().result()
