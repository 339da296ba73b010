"""``/v1/chat/completions`` on the shims (both roles), on real sockets: the sim's fixed chat
template, the prefill's ``chat.completion`` with ``kv_transfer_params``, the decode's
``chat.completion.chunk`` stream (role first, then content deltas, logprobs as
``{"content": [...]}``, usage on request), and what the engines cannot honour refused."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from pdgate.config import sim_tokenizer as tokenizer
from pdgate.engine_shim.backend import ChatPrompt
from pdgate.engine_shim.sim_engine import render_chat_text
from tests.engine_shim.conftest import MODEL, Shim, assert_openai_error, sse_events

MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "there!"}],
    },
]
KV_REQUEST = {"do_remote_decode": True, "do_remote_prefill": False}


def test_the_sim_chat_template() -> None:
    chat = ChatPrompt(
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function"}]},
            {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "c1"},
        ],
        tools=[{"type": "function", "function": {"name": "weather"}}],
    )
    assert render_chat_text(chat) == (
        '<|tools|>\n[{"type":"function","function":{"name":"weather"}}]<|end|>\n'
        "<|system|>\nYou are terse.<|end|>\n"
        "<|user|>\nWeather?<|end|>\n"
        '<|assistant|>\n<tool_calls>[{"id":"c1","type":"function"}]</tool_calls><|end|>\n'
        '<|tool|>\n{"temp": 21}<|end|>\n'
        "<|assistant|>\n"
    )
    partial = ChatPrompt(
        [{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "one, two,"}],
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert render_chat_text(partial) == "<|user|>\nCount:<|end|>\n<|assistant|>\none, two,"


async def _post(shim: Shim, body: dict[str, Any]) -> tuple[int, Any]:
    async with shim.http.post(shim.url + "/v1/chat/completions", data=orjson.dumps(body)) as resp:
        if resp.content_type == "text/event-stream":
            return resp.status, await sse_events(resp)
        return resp.status, await resp.json()


async def _prefill(prefill: Shim, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    status, body = await _post(
        prefill,
        {
            "model": MODEL,
            "messages": messages,
            "max_tokens": 1,
            "kv_transfer_params": KV_REQUEST,
            **extra,
        },
    )
    assert status == 200, body
    assert isinstance(body, dict)
    return body


async def test_both_legs_serve_chat(pair: tuple[Shim, Shim]) -> None:
    prefill, decode = pair
    first = await _prefill(prefill, MESSAGES, logprobs=True, top_logprobs=2)
    rendered = render_chat_text(
        ChatPrompt([MESSAGES[0], {"role": "user", "content": "Hello, there!"}])
    )
    assert first["object"] == "chat.completion"
    assert first["id"].startswith("chatcmpl-")
    assert first["choices"][0]["message"]["role"] == "assistant"
    assert first["usage"]["prompt_tokens"] == tokenizer.count(rendered)
    assert first["kv_transfer_params"]["do_remote_prefill"] is True
    first_logprob = first["choices"][0]["logprobs"]["content"][0]

    status, events = await _post(
        decode,
        {
            "model": MODEL,
            "messages": MESSAGES,
            "max_completion_tokens": 6,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": True,
            "top_logprobs": 2,
            "kv_transfer_params": first["kv_transfer_params"],
        },
    )
    assert status == 200
    head, *chunks, usage, done = events
    assert done == "[DONE]"
    assert head["object"] == "chat.completion.chunk"
    assert head["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
         "finish_reason": None}
    ]  # fmt: skip
    assert len(chunks) == 6
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    content = [e for c in chunks for e in c["choices"][0]["logprobs"]["content"]]
    assert len(content) == 6
    # The decode regenerates the prefill's token from the same context: the same logprobs.
    assert content[0] == first_logprob
    assert "".join(e["token"] for e in content) == "".join(
        c["choices"][0]["delta"]["content"] for c in chunks
    )
    assert all(len(e["top_logprobs"]) == 2 for e in content)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    await _wait_idle(prefill, decode)


async def _wait_idle(prefill: Shim, decode: Shim) -> None:
    from tests.engine_shim.conftest import wait_load

    await wait_load(prefill, "used", 0)
    await wait_load(decode, "used", 0)


async def test_a_non_streaming_decode_answers_one_chat_completion(pair: tuple[Shim, Shim]) -> None:
    prefill, decode = pair
    first = await _prefill(prefill, MESSAGES)
    status, whole = await _post(
        decode,
        {"model": MODEL, "messages": MESSAGES, "max_tokens": 4,
         "kv_transfer_params": first["kv_transfer_params"]},
    )  # fmt: skip
    assert status == 200, whole
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"]["content"].startswith(
        first["choices"][0]["message"]["content"]
    )
    assert whole["usage"]["completion_tokens"] == 4


async def test_continue_final_message_continues_the_assistant(pair: tuple[Shim, Shim]) -> None:
    prefill, _ = pair
    messages = [{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "one,"}]
    opts = {"add_generation_prompt": False, "continue_final_message": True}
    chat = await _prefill(prefill, messages, **opts)
    completion_status, completion, _ = await prefill.post(
        {"model": MODEL, "prompt": "<|user|>\nCount:<|end|>\n<|assistant|>\none,", "max_tokens": 1,
         "kv_transfer_params": KV_REQUEST}
    )  # fmt: skip
    assert completion_status == 200
    assert chat["choices"][0]["message"]["content"] == completion["choices"][0]["text"]
    for params in (chat["kv_transfer_params"], completion["kv_transfer_params"]):
        kv = params["remote_request_id"]
        async with prefill.http.delete(f"{prefill.url}/v1/kv/{kv}") as resp:
            assert resp.status == 204


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        # A tool choice without tools (as vLLM); tools themselves: test_tool_calls.py.
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"max_tokens": 10**6}, "max_tokens"),
    ],
)
async def test_what_the_engine_cannot_honour_is_refused(
    pair: tuple[Shim, Shim], extra: dict[str, Any], param: str
) -> None:
    prefill, decode = pair
    for shim in (prefill, decode):
        status, body = await _post(
            shim, {"model": MODEL, "messages": MESSAGES, "kv_transfer_params": KV_REQUEST, **extra}
        )
        assert status == 400, body
        err = assert_openai_error(body)
        assert err["param"] == param
        load = await shim.load()
        assert (load["used"], load["admitted"]) == (0, 0)


async def test_tools_reach_the_template(pair: tuple[Shim, Shim]) -> None:
    prefill, _ = pair
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    plain = await _prefill(prefill, MESSAGES)
    with_tools = await _prefill(prefill, MESSAGES, tools=tools, tool_choice="auto")
    assert with_tools["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]
