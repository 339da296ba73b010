"""Anthropic Messages as chat: requests translated, chat events shaped back, checked against
the official anthropic SDK's own types."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from pdgate.gateway.errors import BadRequest, DeadlineExceeded, ServiceUnavailable
from pdgate.gateway.translate.messages import MessagesFront
from tests.gateway.translate._chunks import (
    chunk,
    named_events,
    shaped,
    text_stream,
    tool_stream,
    usage,
    whole_of,
)

EVENT = TypeAdapter(RawMessageStreamEvent)


async def checked(shaper: Any, events: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """The shaper's stream of `events`, each event valid as the anthropic SDK reads it."""
    parsed = named_events(await shaped(shaper, events))
    for name, data in parsed:
        if name != "ping":
            EVENT.validate_python(data)
    return parsed


@pytest.fixture
def front() -> MessagesFront:
    return MessagesFront(max_tokens_limit=4096)


async def translate(front: MessagesFront, body: dict[str, Any]) -> Any:
    return await front.translate(orjson.dumps({"model": "m", **body}), None)


async def test_system_text_and_sampling_become_chat_fields(front: MessagesFront) -> None:
    t = await translate(
        front,
        {
            "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "terse."}],
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 30,
            "stop_sequences": ["END"],
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 4,
            "metadata": {"user_id": "u-1"},
            "stream": True,
        },
    )
    assert t.forward["messages"] == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi"},
    ]
    f = t.forward
    assert (f["max_tokens"], f["stop"], f["temperature"], f["top_p"], f["top_k"], f["user"]) == (
        30,
        ["END"],
        0.5,
        0.9,
        4,
        "u-1",
    )
    assert f["stream_options"] == {"include_usage": True}
    assert t.request_id.startswith("msg_")


async def test_tool_use_and_tool_result_blocks_become_tool_calls_and_tool_messages(
    front: MessagesFront,
) -> None:
    t = await translate(
        front,
        {
            "max_tokens": 10,
            "tools": [
                {"name": "get_weather", "description": "d", "input_schema": {"type": "object"}}
            ],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "messages": [
                {"role": "user", "content": "Weather in Oslo?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Looking."},
                        {
                            "type": "tool_use",
                            "id": "toolu_1",
                            "name": "get_weather",
                            "input": {"city": "Oslo"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "cold"},
                        {"type": "text", "text": "And Rome?"},
                    ],
                },
            ],
        },
    )
    m = t.forward["messages"]
    assert m[1]["role"] == "assistant"
    assert m[1]["content"] == "Looking."
    assert m[1]["tool_calls"] == [
        {
            "id": "toolu_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
        }
    ]
    # The results go first, then the rest of the user's turn (vLLM's order).
    assert m[2:] == [
        {"role": "tool", "tool_call_id": "toolu_1", "content": "cold"},
        {"role": "user", "content": "And Rome?"},
    ]
    assert t.forward["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "d",
                "parameters": {"type": "object"},
            },
        }
    ]
    assert t.forward["tool_choice"] == "required"
    assert t.forward["parallel_tool_calls"] is False


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"max_tokens": 5}, "messages"),
        ({"max_tokens": 5, "messages": []}, "messages"),
        ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "messages"),
        (
            {
                "max_tokens": 5,
                "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
            },
            "messages",
        ),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "temperature": 1.5},
            "temperature",
        ),
        (
            {
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            "tools",
        ),
        (
            {
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "x"}],
                "tool_choice": {"type": "tool", "name": "t"},
            },
            "tool_choice",
        ),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "bogus": 1}, "bogus"),
    ],
)
async def test_bad_requests_are_a_400_naming_the_field(
    front: MessagesFront, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(BadRequest) as caught:
        await translate(front, body)
    assert caught.value.param is not None
    assert caught.value.param.startswith(param)


async def test_a_streamed_answer_is_anthropic_events_in_order(front: MessagesFront) -> None:
    t = await translate(front, {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]})
    events = text_stream("Hel", "lo", finish="stop")
    parsed = await checked(t.shaper, events)
    assert [n for n, _ in parsed] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    delta = parsed[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"] == {"input_tokens": 7, "output_tokens": 2}


async def test_a_streamed_tool_call_is_a_tool_use_block_with_json_deltas(
    front: MessagesFront,
) -> None:
    t = await translate(
        front,
        {
            "max_tokens": 50,
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
        },
    )
    events = tool_stream("get_weather", '{"city":', ' "Oslo"}', text="Looking.")
    parsed = await checked(t.shaper, events)
    starts = [d["content_block"] for n, d in parsed if n == "content_block_start"]
    assert starts == [
        {"type": "text", "text": ""},
        {"type": "tool_use", "id": "call_abc", "name": "get_weather", "input": {}},
    ]
    partial = [
        d["delta"]["partial_json"]
        for n, d in parsed
        if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta"
    ]
    assert "".join(partial) == '{"city": "Oslo"}'
    assert parsed[-2][1]["delta"]["stop_reason"] == "tool_use"


async def test_the_whole_message_equals_the_stream(front: MessagesFront) -> None:
    body = {
        "max_tokens": 50,
        "messages": [{"role": "user", "content": "x"}],
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
    }
    events = tool_stream("get_weather", '{"city":', ' "Oslo"}', text="Looking.")
    message = Message.model_validate(
        await (await translate(front, body)).shaper.whole(whole_of(events))
    )
    assert message.stop_reason == "tool_use"
    assert [b.type for b in message.content] == ["text", "tool_use"]
    assert message.content[1].input == {"city": "Oslo"}  # type: ignore[union-attr]
    assert (message.usage.input_tokens, message.usage.output_tokens) == (9, 5)


async def test_a_matched_stop_string_is_the_stop_sequence(front: MessagesFront) -> None:
    t = await translate(
        front,
        {
            "max_tokens": 5,
            "stop_sequences": ["END"],
            "messages": [{"role": "user", "content": "x"}],
        },
    )
    events = [chunk({"content": "a"}), chunk({}, "stop", stop_reason="END"), usage(3, 1)]
    message = await t.shaper.whole(whole_of(events))
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "END")


async def test_cut_by_max_tokens(front: MessagesFront) -> None:
    t = await translate(front, {"max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
    message = await t.shaper.whole(whole_of(text_stream("a", "b", finish="length")))
    assert message["stop_reason"] == "max_tokens"


def test_errors_are_anthropic_shaped_with_the_gateway_status(front: MessagesFront) -> None:
    app = front.error(DeadlineExceeded("no prefill", retry_after=2.5))
    assert isinstance(app, object)
    response: Any = app
    assert response.status_code == 503
    assert response.headers["retry-after"] == "3"
    assert response.headers["retry-after-ms"] == "2500"
    assert orjson.loads(response.body) == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "no prefill", "retry_after": 2.5},
    }
    assert orjson.loads(front.error(BadRequest("bad")).body)["error"]["type"] == (  # type: ignore[attr-defined]
        "invalid_request_error"
    )
    assert isinstance(DeadlineExceeded("x"), ServiceUnavailable)


async def test_a_failure_midstream_is_an_error_event(front: MessagesFront) -> None:
    t = await translate(front, {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]})
    events = text_stream("a", "b")
    raw = t.shaper.start(events[0]) + t.shaper.chunk(events[1])
    raw += t.shaper.fail(ServiceUnavailable("the decode instance failed"))
    parsed = named_events(raw)
    assert [n for n, _ in parsed][-2:] == ["content_block_stop", "error"]
    assert parsed[-1][1]["error"]["type"] == "overloaded_error"


def test_x_api_key_is_the_credential(front: MessagesFront) -> None:
    assert front.credentials({"x-api-key": "k"}) == "Bearer k"
    assert front.credentials({"authorization": "Bearer j", "x-api-key": "k"}) == "Bearer j"
    assert front.credentials({}) is None
