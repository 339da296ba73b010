"""``/v1/responses`` with the official openai client, through two gateway processes on one
Redis and sim prefill and decode shims, each its own process."""

from __future__ import annotations

import openai
import pytest

from tests._cluster import SIM_MODEL as MODEL
from tests._cluster import openai_client
from tests.gateway.api._fronts import ALICE, BOB, Stack


def client(url: str, key: str = ALICE) -> openai.OpenAI:
    return openai_client(url, key)


def test_a_response_goes_through_both_legs(stack: Stack) -> None:
    legs, fetched = stack.legs(), stack.kv_fetched()
    raw = client(stack.gateways[0]).responses.with_raw_response.create(
        model=MODEL, input="Explain disaggregated serving.", max_output_tokens=12
    )
    response = raw.parse()
    assert response.id.startswith("resp_")
    assert response.status == "incomplete"  # the sim writes until max_output_tokens
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text
    assert response.usage is not None
    assert response.usage.output_tokens == 12
    assert response.usage.input_tokens > 0
    assert raw.headers["x-pdgate-prefill"] and raw.headers["x-pdgate-decode"]
    assert raw.headers["x-request-id"] == response.id  # one id, the legs' too
    mine = client(stack.gateways[0]).responses.with_raw_response.create(
        model=MODEL, input="Again.", max_output_tokens=2, extra_headers={"x-request-id": "trace-7"}
    )
    assert mine.headers["x-request-id"] == "trace-7"
    assert mine.parse().id.startswith("resp_")
    legs = (legs[0] + 1, legs[1] + 1)
    fetched += 1
    # The prefill computed the prompt, the decode pulled its KV and generated.
    prefilled, decoded = stack.legs()
    assert (prefilled, decoded) == (legs[0] + 1, legs[1] + 1)
    assert stack.kv_fetched() == fetched + 1
    stack.settled()


def test_the_stream_is_the_typed_events_in_order_and_equals_the_stored_response(
    stack: Stack,
) -> None:
    c = client(stack.gateways[0])
    events = list(
        c.responses.create(model=MODEL, input="Stream, please.", max_output_tokens=6, stream=True)
    )
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == deltas
    assert final.usage is not None
    assert final.usage.output_tokens == 6
    # Stored before the stream ended: the other gateway reads it at once.
    stored = client(stack.gateways[1]).responses.retrieve(final.id)
    assert stored.output_text == deltas
    assert stored.status == final.status
    stack.settled()


def test_the_sdk_stream_helper_gets_its_final_response(stack: Stack) -> None:
    with client(stack.gateways[1]).responses.stream(
        model=MODEL, input="Helper.", max_output_tokens=5
    ) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.output_text == text


def test_the_answer_is_the_chat_answer_for_the_same_conversation(stack: Stack) -> None:
    c = client(stack.gateways[0])
    response = c.responses.create(
        model=MODEL,
        instructions="Answer briefly.",
        input=[{"role": "user", "content": "What is a KV cache?"}],
        max_output_tokens=10,
        temperature=0,
    )
    chat = c.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is a KV cache?"},
        ],
        max_tokens=10,
        temperature=0,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_a_conversation_continues_through_the_other_gateway(stack: Stack) -> None:
    one, two = client(stack.gateways[0]), client(stack.gateways[1])
    first = one.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=4)
    second = two.responses.create(
        model=MODEL,
        input="What is my name?",
        previous_response_id=first.id,
        max_output_tokens=4,
    )
    assert second.previous_response_id == first.id
    # The second prompt holds the first turn's input and output too.
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    # And is the chat answer to the whole conversation.
    chat = one.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"},
        ],
        max_tokens=4,
    )
    assert second.output_text == chat.choices[0].message.content
    items = one.responses.input_items.list(second.id)
    assert [(i.type, i.role) for i in items.data] == [("message", "user")]  # type: ignore[union-attr]


def test_stored_responses_are_the_keys_own(stack: Stack) -> None:
    alice, bob = client(stack.gateways[0]), client(stack.gateways[1], BOB)
    mine = alice.responses.create(model=MODEL, input="secret", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        bob.responses.delete(mine.id)
    with pytest.raises(openai.BadRequestError) as caught:
        bob.responses.create(
            model=MODEL, input="go on", previous_response_id=mine.id, max_output_tokens=2
        )
    assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert alice.responses.retrieve(mine.id).id == mine.id
    alice.responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(mine.id)
    with pytest.raises(openai.AuthenticationError):
        client(stack.gateways[0], "sk-nobody").responses.retrieve(mine.id)


def test_store_false_is_not_kept(stack: Stack) -> None:
    c = client(stack.gateways[0])
    response = c.responses.create(model=MODEL, input="forget me", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(response.id)


def test_input_items_page_as_openai_lists_them(stack: Stack) -> None:
    c = client(stack.gateways[0])
    items = [{"role": "user", "content": f"part {i}"} for i in range(5)]
    response = c.responses.create(model=MODEL, input=items, max_output_tokens=2)  # type: ignore[arg-type]
    page = c.responses.input_items.list(response.id, limit=2, order="asc")
    texts = [item.content[0].text for item in page.data]  # type: ignore[union-attr]
    assert texts == ["part 0", "part 1"]
    assert page.has_more
    rest = c.responses.input_items.list(response.id, order="asc", after=page.data[-1].id)
    assert [i.content[0].text for i in rest.data] == ["part 2", "part 3", "part 4"]  # type: ignore[union-attr]
    newest = c.responses.input_items.list(response.id, limit=1)
    assert newest.data[0].content[0].text == "part 4"  # type: ignore[union-attr]


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


@pytest.mark.parametrize("stream", [False, True])
def test_a_function_tool_round_trip(stack: Stack, stream: bool) -> None:
    """The model calls the tool (over P/D: the call's first token at the prefill, the rest
    at the decode), the client runs it and answers with its output, chained through the
    other gateway; the model answers in text."""
    import json

    legs = stack.legs()
    one, two = client(stack.gateways[0]), client(stack.gateways[1])
    request = {
        "model": MODEL,
        "input": "Weather in Oslo?",
        "tools": [WEATHER],
        "max_output_tokens": 64,
    }
    if stream:
        with one.responses.stream(**request) as events:  # type: ignore[arg-type]
            kinds = [e.type for e in events]
            first = events.get_final_response()
        assert "response.function_call_arguments.delta" in kinds
        assert kinds.index("response.function_call_arguments.done") < kinds.index(
            "response.completed"
        )
    else:
        first = one.responses.create(**request)  # type: ignore[call-overload]
    assert first.status == "completed"
    [call] = first.output
    assert call.type == "function_call"
    assert call.name == "get_weather"
    assert set(json.loads(call.arguments)) >= {"city"}
    assert stack.legs() == (legs[0] + 1, legs[1] + 1)
    second = two.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "12 C, rain"}],
        tools=[WEATHER],  # type: ignore[list-item]
        max_output_tokens=8,
    )
    assert second.output[0].type == "message"
    assert second.output_text
    # The conversation went to the model whole: the same as a chat of the same turns.
    chat = one.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "12 C, rain"},
        ],
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],  # type: ignore[list-item]
        max_tokens=8,
    )
    assert second.output_text == chat.choices[0].message.content
    stack.settled()
