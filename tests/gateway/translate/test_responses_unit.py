"""The Responses API as chat: requests translated, chat events shaped back, checked against
the official openai SDK's own types."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from pdgate.config.openai_api import OpenAIError
from pdgate.gateway.admission.auth import ApiKey
from pdgate.gateway.errors import BadGateway, BadRequest
from pdgate.gateway.translate.base import scope_of
from pdgate.gateway.translate.responses import ResponsesFront
from pdgate.registry.responses import MemoryResponseStore, StoreLimits
from tests.gateway.translate._chunks import named_events, shaped, text_stream, tool_stream, whole_of

EVENT = TypeAdapter(ResponseStreamEvent)


@pytest.fixture
def store() -> MemoryResponseStore:
    return MemoryResponseStore(StoreLimits(ttl_s=60))


@pytest.fixture
def front(store: MemoryResponseStore) -> ResponsesFront:
    return ResponsesFront(store, max_tokens_limit=4096, default_max_tokens=16)


async def translate(front: ResponsesFront, body: dict[str, Any], key: ApiKey | None = None) -> Any:
    return await front.translate(orjson.dumps(body), key)


async def test_string_input_with_instructions_is_a_system_and_a_user_message(
    front: ResponsesFront,
) -> None:
    t = await translate(
        front,
        {"model": "m", "input": "Hi", "instructions": "Be terse.", "max_output_tokens": 9},
    )
    assert t.forward["messages"] == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi"},
    ]
    assert t.forward["max_tokens"] == 9
    assert t.req.max_tokens == 9
    assert t.forward["stream"] is False
    assert "stream_options" not in t.forward
    assert t.request_id.startswith("resp_")


async def test_items_with_function_calls_become_tool_calls_and_tool_messages(
    front: ResponsesFront,
) -> None:
    t = await translate(
        front,
        {
            "model": "m",
            "stream": True,
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {
                    "type": "function_call",
                    "call_id": "c1",
                    "name": "get_weather",
                    "arguments": '{"city":"Oslo"}',
                },
                {
                    "type": "function_call",
                    "call_id": "c2",
                    "name": "get_weather",
                    "arguments": '{"city":"Rome"}',
                },
                {"type": "function_call_output", "call_id": "c1", "output": "cold"},
                {"type": "function_call_output", "call_id": "c2", "output": "warm"},
            ],
            "tools": [
                {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
            ],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "parallel_tool_calls": False,
            "temperature": 0,
            "top_k": 5,
        },
    )
    messages = t.forward["messages"]
    assert messages[0] == {"role": "user", "content": "Weather?"}
    # Consecutive calls are one assistant turn, as vLLM's Responses layer builds it.
    assert messages[1]["role"] == "assistant"
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]
    assert messages[1]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city":"Oslo"}',
    }
    assert messages[2:] == [
        {"role": "tool", "tool_call_id": "c1", "content": "cold"},
        {"role": "tool", "tool_call_id": "c2", "content": "warm"},
    ]
    assert t.forward["tools"] == [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    ]
    assert t.forward["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert t.forward["parallel_tool_calls"] is False
    assert t.forward["stream_options"] == {"include_usage": True}
    assert t.forward["temperature"] == 0
    assert t.forward["top_k"] == 5


async def test_text_format_json_schema_is_the_chat_response_format(front: ResponsesFront) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    t = await translate(
        front,
        {
            "model": "m",
            "input": "x",
            "text": {
                "format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}
            },
        },
    )
    assert t.forward["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": schema, "strict": True},
    }


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input",
        ),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "max_output_tokens": 4097}, "max_output_tokens"),
        ({"input": "x", "temperature": 3}, "temperature"),
        ({"input": "x", "frobnicate": 1}, "frobnicate"),
        ({"input": 5}, "input"),
        ({"input": []}, "input"),
        ({}, "input"),
        ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"input": "x", "include": ["file_search_call.results"]}, "include"),
        ({"input": "x", "kv_transfer_params": {}}, "kv_transfer_params"),
    ],
)
async def test_what_it_cannot_do_is_a_400_naming_the_field(  # the path, as OpenAI's
    front: ResponsesFront, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(BadRequest) as caught:
        await translate(front, {"model": "m", **body})
    assert caught.value.param is not None
    assert caught.value.param.startswith(param)


def shaper_of(t: Any) -> Any:
    return t.shaper


async def test_a_streamed_text_answer_is_the_api_events_in_order(front: ResponsesFront) -> None:
    t = await translate(front, {"model": "m", "input": "Hi", "stream": True})
    shaper = shaper_of(t)
    events = text_stream("Hel", "lo", finish="stop")
    raw = await shaped(shaper, events)
    parsed = named_events(raw)
    for _, data in parsed:
        EVENT.validate_python(data)
    assert [n for n, _ in parsed] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [d["sequence_number"] for _, d in parsed] == list(range(len(parsed)))
    final = Response.model_validate(parsed[-1][1]["response"])
    assert final.status == "completed"
    assert final.output_text == "Hello"
    assert final.usage is not None
    assert (final.usage.input_tokens, final.usage.output_tokens) == (7, 2)
    assert parsed[0][1]["response"]["status"] == "in_progress"


async def test_a_cut_answer_is_incomplete_with_its_reason(front: ResponsesFront) -> None:
    t = await translate(front, {"model": "m", "input": "Hi", "max_output_tokens": 2})
    response = Response.model_validate(
        await t.shaper.whole(whole_of(text_stream("a", "b", finish="length")))
    )
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"  # type: ignore[union-attr]


async def test_a_streamed_tool_call_is_a_function_call_item_with_argument_deltas(
    front: ResponsesFront,
) -> None:
    t = await translate(
        front,
        {
            "model": "m",
            "input": "Weather?",
            "stream": True,
            "tools": [{"type": "function", "name": "get_weather", "parameters": {}}],
        },
    )
    events = tool_stream("get_weather", '{"city":', ' "Oslo"}', text="Let me look.")
    shaper = t.shaper
    raw = await shaped(shaper, events)
    parsed = named_events(raw)
    for _, data in parsed:
        EVENT.validate_python(data)
    names = [n for n, _ in parsed]
    assert names[2:] == [
        "response.output_item.added",  # the text message
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",  # the function call
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    done = next(d for n, d in parsed if n == "response.function_call_arguments.done")
    assert done["arguments"] == '{"city": "Oslo"}'
    assert done["output_index"] == 1
    final = Response.model_validate(parsed[-1][1]["response"])
    call = final.output[1]
    assert call.type == "function_call"
    assert (call.call_id, call.name, call.arguments) == (
        "call_abc",
        "get_weather",
        '{"city": "Oslo"}',
    )


async def test_the_whole_answer_equals_the_streamed_one(front: ResponsesFront) -> None:
    body = {
        "model": "m",
        "input": "Weather?",
        "tools": [{"type": "function", "name": "get_weather", "parameters": {}}],
    }
    events = tool_stream("get_weather", '{"city":', ' "Oslo"}', text="Let me look.")
    streamed = await translate(front, {**body, "stream": True})
    shaper = streamed.shaper
    raw = await shaped(shaper, events)
    last = named_events(raw)[-1][1]["response"]
    whole = await (await translate(front, body)).shaper.whole(whole_of(events))
    for response in (last, whole):
        for item in response["output"]:
            item.pop("id")
        response.pop("id")
        response.pop("created_at")
    assert whole == last


async def test_a_failure_midstream_is_an_error_event_then_response_failed(
    front: ResponsesFront,
) -> None:
    t = await translate(front, {"model": "m", "input": "Hi", "stream": True})
    events = text_stream("a", "b")
    shaper = t.shaper
    raw = shaper.start(events[0]) + shaper.chunk(events[0]) + shaper.chunk(events[1])
    raw += shaper.fail(BadGateway("the decode instance failed mid-stream"))
    parsed = named_events(raw)
    for _, data in parsed:
        EVENT.validate_python(data)
    assert [n for n, _ in parsed][-3:] == ["response.output_item.done", "error", "response.failed"]
    failed = Response.model_validate(parsed[-1][1]["response"])
    assert failed.status == "failed"
    assert failed.error is not None
    assert "mid-stream" in failed.error.message


async def test_a_stored_response_chains_in_its_key_scope_alone(
    front: ResponsesFront, store: MemoryResponseStore
) -> None:
    alice = ApiKey(name="alice", digest=b"a" * 32)
    bob = ApiKey(name="bob", digest=b"b" * 32)
    first = await translate(front, {"model": "m", "input": "Hi", "instructions": "Terse."}, alice)
    response = await first.shaper.whole(whole_of(text_stream("Hello")))
    assert await store.get(scope_of(alice), response["id"]) is not None
    assert await store.get(scope_of(bob), response["id"]) is None
    chained = await translate(
        front, {"model": "m", "input": "More", "previous_response_id": response["id"]}, alice
    )
    # The first turn's instructions do not carry over; its input and output do.
    assert chained.forward["messages"] == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "More"},
    ]
    with pytest.raises(BadRequest) as caught:
        await translate(
            front, {"model": "m", "input": "More", "previous_response_id": response["id"]}, bob
        )
    assert caught.value.param == "previous_response_id"


async def test_store_false_stores_nothing(
    front: ResponsesFront, store: MemoryResponseStore
) -> None:
    t = await translate(front, {"model": "m", "input": "Hi", "store": False})
    response = await t.shaper.whole(whole_of(text_stream("Hello")))
    assert response["store"] is False
    assert len(store) == 0


def test_errors_keep_the_openai_shape(front: ResponsesFront) -> None:
    assert isinstance(front.error(BadRequest("x")), object)
    body = orjson.loads(OpenAIError(400, "bad").response().body)
    assert set(body["error"]) == {"message", "type", "param", "code"}
