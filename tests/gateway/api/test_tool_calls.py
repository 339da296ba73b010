"""Function-tool round trips through the gateway's chat endpoint over P/D, with the official
openai client, against sim prefills and decodes on real sockets (the embedded cluster).

The sim model calls a tool as a vLLM server with a tool parser does (engine_shim/_sim_tools.py):
the prefill leg computes the call's first token, the decode generates the whole call, the
relay passes its ``tool_calls`` deltas on, and a non-streaming answer is assembled from them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion

from pdgate.config import sim_tokenizer as tokenizer
from pdgate.engine_shim._sim_tools import tool_call
from pdgate.engine_shim.backend import ChatPrompt, ToolUse
from pdgate.engine_shim.sim_engine import render_chat_text
from tests._cluster import ThreadedCluster, shim_load

MODEL = "sim-llama-3.1-8b"
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 5},
                },
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
        },
    },
]
ASK: list[dict[str, Any]] = [
    {"role": "system", "content": "You answer with the tools you are given."},
    {"role": "user", "content": "Is it raining in Lyon?"},
]


@pytest.fixture(scope="module")
def cluster() -> Iterator[ThreadedCluster]:
    with ThreadedCluster(prefills=1, decodes=1) as c:
        yield c


def _served(cluster: ThreadedCluster) -> dict[str, int]:
    """Requests each shim completed so far, by role."""
    return {r["role"]: shim_load(r["url"])["completed"] for r in cluster.instances()}


def _expected(messages: list[dict[str, Any]], use: ToolUse) -> str:
    """The call text the sim model generates for `messages`."""
    prompt = tokenizer.encode(render_chat_text(ChatPrompt(messages, tools=use.tools)))
    text = tool_call(prompt, use)
    assert text is not None
    return text


def _arguments(text: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(text.split("\n", 1)[1].removesuffix("</tool_call>"))
    return out


def _ask(
    client: openai.OpenAI,
    tool_choice: Any = openai.NOT_GIVEN,
    *,
    messages: list[dict[str, Any]] = ASK,
    max_tokens: int = 200,
) -> ChatCompletion:
    """A non-streaming chat call offering `TOOLS`."""
    return client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice=tool_choice,
        max_tokens=max_tokens,
    )


def _called(answer: ChatCompletion) -> list[str]:
    """The names of the functions the answer calls."""
    calls = answer.choices[0].message.tool_calls
    assert calls is not None
    return [c.function.name for c in calls]  # type: ignore[union-attr]


def _idle(cluster: ThreadedCluster) -> None:
    cluster.wait_for(
        lambda: all(r["open_streams"] == 0 and r["inflight"] == 0 for r in cluster.instances()),
        what="every count released",
    )


def test_a_tool_round_trip_over_pd(client: openai.OpenAI, cluster: ThreadedCluster) -> None:
    """User -> a streamed tool call -> the tool's result -> a text answer; both legs of each
    turn reach the shims."""
    before = _served(cluster)
    expected = _expected(ASK, ToolUse(TOOLS))
    stream = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=ASK,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        max_tokens=200,
        stream=True,
        stream_options={"include_usage": True},
    )
    assert stream.headers["x-pdgate-prefill"] and stream.headers["x-pdgate-decode"]
    chunks = list(stream.parse())
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    first, *rest = deltas
    assert (first.index, first.type) == (0, "function")
    assert first.id and first.id.startswith("call_")
    assert first.function is not None
    assert (first.function.name, first.function.arguments) == ("get_weather", "")
    assert all(d.index == 0 and d.id is None and d.function and not d.function.name for d in rest)
    arguments = "".join(d.function.arguments or "" for d in rest if d.function)
    assert json.loads(arguments) == _arguments(expected)
    assert {"city", "unit"} <= json.loads(arguments).keys()
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "tool_calls" and set(finishes[:-1]) == {None}
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == tokenizer.count(expected)
    after_call = {role: n + 1 for role, n in before.items()}  # a prefill, then a decode
    cluster.wait_for(lambda: _served(cluster) == after_call, what="both legs served")

    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": first.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": first.id, "content": '{"rain": false, "temp": 18}'},
    ]
    answer = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=history,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        max_tokens=12,
    )
    assert answer.headers["x-pdgate-prefill"] and answer.headers["x-pdgate-decode"]
    choice = answer.parse().choices[0]
    assert choice.message.content and not choice.message.tool_calls
    assert choice.finish_reason == "length"
    answered = {role: n + 1 for role, n in after_call.items()}
    cluster.wait_for(lambda: _served(cluster) == answered, what="both legs served")
    _idle(cluster)


def test_the_assembled_answer_is_the_streamed_call(client: openai.OpenAI) -> None:
    def streamed() -> dict[str, Any]:
        with client.chat.completions.stream(
            model=MODEL,
            messages=ASK,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            max_tokens=200,
        ) as events:
            final = events.get_final_completion()
        calls = final.choices[0].message.tool_calls
        assert calls is not None and len(calls) == 1
        assert final.choices[0].finish_reason == "tool_calls"
        call: dict[str, Any] = calls[0].model_dump(include={"id", "type", "function"})
        call["function"].pop("parsed_arguments", None)
        return call

    whole = _ask(client)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.tool_calls is not None
    whole_call = choice.message.tool_calls[0].model_dump(include={"id", "type", "function"})
    # The same call every run (id included): a function of the prompt.
    assert streamed() == whole_call == streamed()
    expected = _expected(ASK, ToolUse(TOOLS))
    assert whole.usage is not None and whole.usage.completion_tokens == tokenizer.count(expected)


def test_token_ids_of_a_call_through_the_gateway(cluster: ThreadedCluster) -> None:
    body = {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS,
        "max_tokens": 200,
        "return_token_ids": True,
    }
    whole = httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=30).json()
    expected = _expected(ASK, ToolUse(TOOLS))
    assert whole["choices"][0]["token_ids"] == tokenizer.encode(expected)
    assert whole["usage"]["completion_tokens"] == len(whole["choices"][0]["token_ids"])


def test_named_required_and_none(client: openai.OpenAI) -> None:
    named = _ask(client, {"type": "function", "function": {"name": "get_time"}})
    assert _called(named) == ["get_time"]
    assert named.choices[0].finish_reason == "stop"  # a named choice, as OpenAI answers it

    after_tool: list[dict[str, Any]] = [
        *ASK,
        {"role": "assistant", "content": "Checking.", "tool_calls": [{"id": "call_0",
         "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "noon"},
    ]  # fmt: skip
    required = _ask(client, "required", messages=after_tool)
    assert _called(required) == ["get_weather"]
    assert required.choices[0].finish_reason == "tool_calls"

    none = _ask(client, "none", max_tokens=6)
    assert not none.choices[0].message.tool_calls
    assert none.choices[0].message.content and none.choices[0].finish_reason == "length"


def test_an_unknown_named_tool_is_a_400(client: openai.OpenAI, cluster: ThreadedCluster) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _ask(client, {"type": "function", "function": {"name": "launch_rockets"}}, max_tokens=20)
    err = info.value.body
    assert isinstance(err, dict) and err["param"] == "tool_choice"
    assert "launch_rockets" not in err["message"]
    _idle(cluster)
