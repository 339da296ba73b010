"""``/v1/messages`` with the official anthropic client, through a gateway process and sim
prefill and decode shims, each its own process."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from tests._cluster import SIM_MODEL as MODEL
from tests.gateway.api._fronts import ALICE, Stack


def client(stack: Stack, key: str = ALICE) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.gateways[0], api_key=key, max_retries=0, timeout=30)


def test_a_message_goes_through_both_legs(stack: Stack) -> None:
    legs, fetched = stack.legs(), stack.kv_fetched()
    raw = client(stack).messages.with_raw_response.create(
        model=MODEL,
        max_tokens=9,
        system="You are terse.",
        messages=[{"role": "user", "content": "Explain the KV cache."}],
    )
    message = raw.parse()
    assert message.id.startswith("msg_")
    assert message.role == "assistant"
    assert message.stop_reason == "max_tokens"
    assert message.content[0].type == "text"
    assert message.content[0].text
    assert message.usage.output_tokens == 9
    assert message.usage.input_tokens > 0
    assert raw.headers["x-pdgate-prefill"] and raw.headers["x-pdgate-decode"]
    assert stack.legs() == (legs[0] + 1, legs[1] + 1)
    assert stack.kv_fetched() == fetched + 1
    stack.settled()


def test_the_stream_is_anthropic_events_and_equals_the_whole_message(stack: Stack) -> None:
    c = client(stack)
    body = {
        "model": MODEL,
        "max_tokens": 7,
        "messages": [{"role": "user", "content": "Stream a little."}],
    }
    whole = c.messages.create(**body)  # type: ignore[arg-type]
    with c.messages.stream(**body) as stream:  # type: ignore[arg-type]
        types = [event.type for event in stream]
        final = stream.get_final_message()
    assert types[0] == "message_start"
    assert types[-2:] == ["message_delta", "message_stop"]
    assert "content_block_delta" in types
    assert final.content[0].text == whole.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == 7
    stack.settled()


def test_the_answer_is_the_chat_answer_for_the_same_conversation(stack: Stack) -> None:
    message = client(stack).messages.create(
        model=MODEL,
        max_tokens=8,
        system="Answer briefly.",
        messages=[
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": [{"type": "text", "text": "What is P/D?"}]},
        ],
    )
    chat = openai.OpenAI(base_url=stack.gateways[0] + "/v1", api_key=ALICE).chat.completions.create(
        model=MODEL,
        max_tokens=8,
        messages=[
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "What is P/D?"},
        ],
    )
    assert message.content[0].text == chat.choices[0].message.content  # type: ignore[union-attr]
    assert chat.usage is not None
    assert message.usage.input_tokens == chat.usage.prompt_tokens


def test_keys_errors_and_versions_as_anthropic_clients_see_them(stack: Stack) -> None:
    with pytest.raises(anthropic.AuthenticationError) as caught:
        client(stack, "sk-nobody").messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}]
        )
    assert caught.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError):
        client(stack).messages.create(
            model="no-such-model", max_tokens=2, messages=[{"role": "user", "content": "x"}]
        )
    # The API version header is read by nobody, and a bearer key works too.
    resp = httpx.post(
        stack.gateways[0] + "/v1/messages",
        headers={"authorization": f"Bearer {ALICE}", "anthropic-version": "2099-01-01"},
        json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]},
        timeout=30,
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["type"] == "message"


WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def test_a_tool_use_round_trip_streamed_and_not(stack: Stack) -> None:
    c = client(stack)
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    whole = c.messages.create(model=MODEL, max_tokens=64, messages=ask, tools=[WEATHER])  # type: ignore[arg-type,list-item]
    assert whole.stop_reason == "tool_use"
    [use] = [b for b in whole.content if b.type == "tool_use"]
    assert use.name == "get_weather"
    assert set(use.input) >= {"city"}  # type: ignore[arg-type]
    with c.messages.stream(model=MODEL, max_tokens=64, messages=ask, tools=[WEATHER]) as stream:  # type: ignore[arg-type,list-item]
        kinds = [e.type for e in stream]
        streamed = stream.get_final_message()
    assert "input_json" in kinds  # the SDK's event for input_json_delta
    assert streamed.stop_reason == "tool_use"
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in whole.content]
    answer = c.messages.create(
        model=MODEL,
        max_tokens=8,
        tools=[WEATHER],  # type: ignore[list-item]
        messages=[
            *ask,
            {"role": "assistant", "content": [b.model_dump() for b in whole.content]},  # type: ignore[misc]
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": use.id, "content": "12 C, rain"}
                ],
            },
        ],
    )
    assert answer.stop_reason == "max_tokens"
    assert answer.content[0].type == "text" and answer.content[0].text
    stack.settled()


def test_count_tokens_is_what_the_engine_prefills(stack: Stack) -> None:
    """The count of the chat template's rendering, tools included: the input tokens the
    same conversation is then charged."""
    c = client(stack)
    conversation = {
        "model": MODEL,
        "system": "You are terse.",
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": [WEATHER],
    }
    counted = c.messages.count_tokens(**conversation)  # type: ignore[arg-type]
    message = c.messages.create(max_tokens=64, **conversation)  # type: ignore[arg-type]
    assert counted.input_tokens == message.usage.input_tokens > 0
    without_tools = c.messages.count_tokens(
        model=MODEL,
        system="You are terse.",
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
    )
    assert without_tools.input_tokens < counted.input_tokens
    with pytest.raises(anthropic.NotFoundError) as caught:
        c.messages.count_tokens(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert caught.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError):
        c.messages.count_tokens(model=MODEL, messages=[{"role": "robot", "content": "x"}])  # type: ignore[misc,list-item]
    with pytest.raises(anthropic.AuthenticationError):
        client(stack, "sk-nobody").messages.count_tokens(
            model=MODEL, messages=[{"role": "user", "content": "x"}]
        )
