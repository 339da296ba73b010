"""Function tools on the sim shims: the sim model calls a tool as a vLLM server with a tool
parser does, end to end through tokens.

The parser and the sim model's rule are checked on their own first; then real shims on real
sockets: the prefill's one token is the call's first, the decode (given the prefill's KV, or
computing the prompt itself, or as an aggregated instance) generates the whole call, and the
chat layer streams it as OpenAI ``tool_calls`` deltas in vLLM's shape, or answers it whole;
token ids, logprobs and usage count exactly the call's tokens.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from pdgate.config import Role
from pdgate.config import sim_tokenizer as tokenizer
from pdgate.config.openai_api import parse_chat
from pdgate.config.wire import CHAT_PATH, COMPLETIONS_PATH
from pdgate.engine_shim._http import ApiError
from pdgate.engine_shim._sim_tools import MAX_DEPTH, arguments, tool_call
from pdgate.engine_shim._tool_calls import NO_TOOL_PARSER, ToolCallParser, tool_use
from pdgate.engine_shim.backend import ChatPrompt, ToolUse, tool_call_text
from pdgate.engine_shim.sim_engine import render_chat_text
from tests.engine_shim import conftest as shims

WEATHER_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "where"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 3},
        "hourly": {"type": "boolean"},
        "note": {"type": "string"},
    },
    "required": ["city", "unit", "days", "hourly"],
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": WEATHER_PARAMS,
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
    {"role": "system", "content": "You are a weather assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
]


def _pieces_of(text: str) -> list[str]:
    return tokenizer.pieces(text)


def _stream_deltas(parser: ToolCallParser, text: str, finish: str) -> list[dict[str, Any]]:
    """Every delta of `text` fed token by token (the last piece with `finish`)."""
    pieces = _pieces_of(text) or [""]
    out = [parser.feed(p) for p in pieces[:-1]]
    out.append(parser.feed(pieces[-1], finish))
    return [d for d in out if d is not None]


# -- the parser ----------------------------------------------------------------------------


def test_a_streamed_call_comes_out_in_vllms_delta_shape() -> None:
    args = '{"city":"model cache","days":2}'
    text = "Let me look." + tool_call_text("get_weather", args)
    parser = ToolCallParser([1, 2, 3], named=False)
    deltas = _stream_deltas(parser, text, "stop")
    contents = [d["content"] for d in deltas if "content" in d]
    assert "".join(contents) == "Let me look."
    calls = [c for d in deltas for c in d.get("tool_calls", ())]
    first, *rest = calls
    assert set(first) == {"index", "id", "type", "function"}
    assert first["index"] == 0 and first["type"] == "function"
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    assert first["id"].startswith("call_") and len(first["id"]) == 5 + 24
    assert int(first["id"][5:], 16) >= 0  # hex
    assert all(set(c) == {"index", "function"} and c["index"] == 0 for c in rest)
    assert all(set(c["function"]) == {"arguments"} for c in rest)
    assert "".join(c["function"]["arguments"] for c in rest) == args
    # No marker, nor any piece of one, ever went out.
    sent = "".join(contents) + "".join(c["function"]["arguments"] for c in rest)
    assert "<" not in sent and "tool_call" not in sent
    assert parser.finish_reason("stop") == "tool_calls"
    # The whole answer is the same call, with the same id.
    whole = ToolCallParser([1, 2, 3], named=False).message(text, "stop")
    assert whole == {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [
            {
                "id": first["id"],
                "type": "function",
                "function": {"name": "get_weather", "arguments": args},
            }
        ],
    }


@pytest.mark.parametrize("cut", range(1, 40))
def test_markers_split_anywhere_are_held_back(cut: int) -> None:
    text = "Hi." + tool_call_text("f", '{"a":1}') + tool_call_text("g", "{}")
    parser = ToolCallParser([7], named=False)
    deltas = [parser.feed(text[:cut]), parser.feed(text[cut:], "stop")]
    content = "".join(d.get("content", "") for d in deltas if d)
    assert content == "Hi."
    assert [c["function"] for c in parser.calls] == [
        {"name": "f", "arguments": '{"a":1}'},
        {"name": "g", "arguments": "{}"},
    ]
    indexes = [c["index"] for d in deltas if d for c in d.get("tool_calls", ())]
    assert indexes == sorted(indexes) and set(indexes) == {0, 1}
    assert parser.calls[0]["id"] != parser.calls[1]["id"]


def test_max_tokens_inside_a_call_sends_what_was_parsed() -> None:
    text = tool_call_text("get_weather", '{"city":"model"}')
    cut = text.index('"model')
    parser = ToolCallParser([1], named=False)
    message = parser.message(text[:cut], "length")
    assert message["content"] is None
    assert message["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city":',
    }
    assert parser.finish_reason("length") == "length"
    # Cut inside the opening marker or the name: no call, and no marker as content.
    for end in (4, len("<tool_call>get")):
        cut_early = ToolCallParser([1], named=False)
        assert cut_early.message(text[:end], "length") == {"role": "assistant", "content": ""}


def test_text_that_only_looks_like_a_marker_is_content_when_the_model_stops() -> None:
    parser = ToolCallParser([1], named=False)
    assert parser.feed("a <") == {"content": "a "}
    assert parser.feed("tool", "stop") == {"content": "<tool"}
    assert parser.finish_reason("stop") == "stop"


def test_a_named_choice_finishes_with_stop_as_openai_does() -> None:
    parser = ToolCallParser([1], named=True)
    parser.message(tool_call_text("f", "{}"), "stop")
    assert parser.finish_reason("stop") == "stop"


# -- the request's tools, checked ----------------------------------------------------------


def _chat(**fields: Any) -> Any:
    body = {"messages": ASK, **fields}
    req, _ = parse_chat(orjson.dumps(body), max_tokens_limit=4096)
    return req


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": []}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function"),
        ({"tools": TOOLS, "tool_choice": {"function": {"name": 3}}}, "tool_choice.function.name"),
        ({"tools": TOOLS, "tool_choice": {"function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 1}}]}, "tools"),
    ],
)
def test_bad_tools_are_refused(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as info:
        tool_use(_chat(**fields), can_call=True)
    assert info.value.status == 400
    assert info.value.body()["error"]["param"] == param
    assert "nope" not in info.value.body()["error"]["message"]  # never echoes the request


def test_the_choice_becomes_a_tool_use() -> None:
    assert tool_use(_chat(), can_call=True) is None
    assert tool_use(_chat(tools=TOOLS, tool_choice="none"), can_call=True) is None
    assert tool_use(_chat(tools=TOOLS), can_call=True) == ToolUse(TOOLS, last_role="user")
    assert tool_use(_chat(tools=TOOLS, tool_choice="required"), can_call=True) == ToolUse(
        TOOLS, required=True, last_role="user"
    )
    named = {"type": "function", "function": {"name": "get_time"}}
    assert tool_use(_chat(tools=TOOLS, tool_choice=named), can_call=True) == ToolUse(
        TOOLS, name="get_time", required=True, last_role="user"
    )


def test_an_engine_without_tool_calls_refuses_to_force_one() -> None:
    assert tool_use(_chat(tools=TOOLS), can_call=False) is None
    assert tool_use(_chat(tools=TOOLS, tool_choice="none"), can_call=False) is None
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        with pytest.raises(ApiError) as info:
            tool_use(_chat(tools=TOOLS, tool_choice=choice), can_call=False)
        err = info.value.body()["error"]
        assert (info.value.status, err["param"], err["message"]) == (
            400,
            "tool_choice",
            NO_TOOL_PARSER,
        )
        assert "tool-call parser" in err["message"] and "vllm serve" in err["message"]


# -- the sim model -------------------------------------------------------------------------


def _args(text: str | None) -> tuple[str, dict[str, Any]]:
    assert text is not None
    head, _, rest = text.removeprefix("<tool_call>").partition("\n")
    return head, json.loads(rest.removesuffix("</tool_call>"))


def test_the_sim_model_calls_by_the_documented_rule() -> None:
    prompt = [5, 6, 7]
    assert _args(tool_call(prompt, ToolUse(TOOLS)))[0] == "get_weather"  # user last: a call
    for role in ("tool", "assistant", "system"):
        assert tool_call(prompt, ToolUse(TOOLS, last_role=role)) is None  # text
        assert _args(tool_call(prompt, ToolUse(TOOLS, required=True, last_role=role)))[0] == (
            "get_weather"
        )
        named = ToolUse(TOOLS, name="get_time", required=True, last_role=role)
        assert _args(tool_call(prompt, named))[0] == "get_time"


def test_arguments_follow_the_schema() -> None:
    name, args = _args(tool_call([1, 2], ToolUse(TOOLS)))
    assert name == "get_weather"
    assert set(args) == set(WEATHER_PARAMS["required"])  # the required ones only
    assert isinstance(args["city"], str) and 1 <= len(args["city"].split()) <= 2
    assert args["city"].replace(" ", "").isalpha()
    assert args["unit"] == "celsius"  # an enum's first value
    assert type(args["days"]) is int and 1 <= args["days"] <= 3
    assert args["hourly"] is True
    # None required: every property.
    assert set(_args(tool_call([1, 2], ToolUse(TOOLS, name="get_time")))[1]) == {"zone"}
    # Deterministic, a function of the prompt.
    assert tool_call([1, 2], ToolUse(TOOLS)) == tool_call([1, 2], ToolUse(TOOLS))
    many = {tool_call([i], ToolUse(TOOLS)) for i in range(20)}
    assert len(many) > 1


def test_arguments_of_every_kind_and_bounded_depth() -> None:
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            "n": {"type": "number", "minimum": 100},
            "i": {"type": ["integer", "null"], "maximum": -5},
            "tags": {"type": "array", "items": {"type": "string"}},
            "c": {"const": "fixed"},
            "u": {"anyOf": [{"type": "null"}, {"type": "boolean"}]},
            "nothing": {"type": "null"},
            "inner": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "string"}},
                "required": ["x"],
            },
        },
    }
    args = arguments(schema, b"seed")
    assert args["n"] == 100 and args["i"] == -5
    assert args["tags"] == [] and args["c"] == "fixed" and args["u"] is True
    assert args["nothing"] is None
    assert set(args["inner"]) == {"x"} and type(args["inner"]["x"]) is int
    deep: dict[str, Any] = {"type": "object", "properties": {}}
    node = deep
    for _ in range(MAX_DEPTH + 5):
        child: dict[str, Any] = {"type": "object", "properties": {}}
        node["properties"]["d"] = child
        node = child
    value = arguments(deep, b"seed")
    for _ in range(MAX_DEPTH - 1):
        value = value["d"]
    assert value == {"d": {}}
    assert arguments(None, b"s") == {} and arguments({"type": "string"}, b"s") == {}


# -- through the shims ---------------------------------------------------------------------


async def _post(shim: shims.Shim, body: dict[str, Any]) -> tuple[int, Any]:
    async with shim.http.post(shim.url + CHAT_PATH, data=orjson.dumps(body)) as resp:
        return resp.status, await resp.json(content_type=None)


def _expected_call(messages: list[dict[str, Any]], use: ToolUse) -> tuple[str, list[int]]:
    """The call text the sim model generates for `messages` and its token ids."""
    prompt = tokenizer.encode(render_chat_text(ChatPrompt(messages, tools=use.tools)))
    text = tool_call(prompt, use)
    assert text is not None
    return text, tokenizer.encode(text)


def _chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": shims.MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 200, **extra}


def _streamed_call(events: list[Any]) -> tuple[dict[str, Any], list[int], str | None, str]:
    """The call of a chat stream's events (merged as OpenAI's clients do), its token ids,
    finish reason and content."""
    assert events[-1] == "[DONE]"
    call: dict[str, Any] = {}
    ids: list[int] = []
    content = ""
    finish = None
    for event in events[1:-1]:
        if not event["choices"]:
            continue
        choice = event["choices"][0]
        ids += choice.get("token_ids") or []
        content += choice["delta"].get("content") or ""
        finish = choice["finish_reason"] or finish
        for delta in choice["delta"].get("tool_calls") or ():
            assert delta["index"] == 0
            if "id" in delta:
                assert not call, "a call's first delta came twice"
                call = {**delta, "function": dict(delta["function"])}
                del call["index"]
            else:
                call["function"]["arguments"] += delta["function"]["arguments"]
    return call, ids, finish, content


async def test_pd_streams_the_call_the_prefill_began(pair: shims.Pair) -> None:
    prefill, decode = pair
    text, call_ids = _expected_call(ASK, ToolUse(TOOLS))
    status, first = await _post(prefill, shims.prefill_leg(_chat_body(return_token_ids=True)))
    assert status == 200, first
    # The prefill's one token is the call's first; the parser holds it back.
    assert first["choices"][0]["token_ids"] == call_ids[:1]
    assert first["choices"][0]["message"]["content"] == ""
    assert first["choices"][0]["finish_reason"] == "length"

    body = _chat_body(
        stream=True,
        stream_options={"include_usage": True},
        return_token_ids=True,
        logprobs=True,
        top_logprobs=2,
        kv_transfer_params=first["kv_transfer_params"],
    )
    events = await decode.stream(body, CHAT_PATH)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    call, ids, finish, content = _streamed_call(events)
    assert finish == "tool_calls" and content == ""
    assert ids == call_ids  # every generated token, in order, and nothing more
    name, args = _args(text)
    assert call["function"]["name"] == name == "get_weather"
    assert json.loads(call["function"]["arguments"]) == args
    assert set(args) >= set(WEATHER_PARAMS["required"])
    logprobs = [e for ev in events[1:-2] for e in ev["choices"][0]["logprobs"]["content"]]
    assert "".join(e["token"] for e in logprobs) == text  # the raw tokens, markers included
    assert all(e["top_logprobs"][0]["token"] == e["token"] for e in logprobs)
    assert events[-2]["usage"]["completion_tokens"] == len(call_ids)

    # Whole: the same call (id too), content null, from a second P/D pass.
    status, first = await _post(prefill, shims.prefill_leg(_chat_body()))
    whole_body = _chat_body(return_token_ids=True, kv_transfer_params=first["kv_transfer_params"])
    status, whole = await _post(decode, whole_body)
    assert status == 200, whole
    choice = whole["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": None, "tool_calls": [call]}
    assert choice["finish_reason"] == "tool_calls"
    assert choice["token_ids"] == call_ids
    assert whole["usage"]["completion_tokens"] == len(call_ids)
    await shims.wait_load(prefill, "used", 0)
    await shims.wait_load(decode, "used", 0)


async def test_the_decode_and_an_aggregated_instance_compute_the_call_themselves(
    pair: shims.Pair, start_shim: shims.StartShim
) -> None:
    _, decode = pair
    aggregated = await start_shim(Role.AGGREGATED, capacity=2)
    text, call_ids = _expected_call(ASK, ToolUse(TOOLS))
    answers = []
    for shim in (decode, aggregated):
        events = await shim.stream(_chat_body(return_token_ids=True), CHAT_PATH)
        call, ids, finish, _ = _streamed_call(events)
        assert (ids, finish) == (call_ids, "tool_calls")
        answers.append(call)
        status, whole = await _post(shim, _chat_body())
        assert status == 200, whole
        assert whole["choices"][0]["message"]["tool_calls"] == [call]
        assert (await shims.wait_load(shim, "used", 0))["local_prefills"] == 2
    assert answers[0] == answers[1]  # deterministic: same prompt, same call, same id
    assert json.loads(answers[0]["function"]["arguments"]) == _args(text)[1]


async def test_named_required_and_none_choices(pair: shims.Pair) -> None:
    _, decode = pair
    named = {"type": "function", "function": {"name": "get_time"}}
    status, whole = await _post(decode, _chat_body(tool_choice=named))
    assert status == 200, whole
    choice = whole["choices"][0]
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_time"]
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]).keys() == {
        "zone"
    }
    assert choice["finish_reason"] == "stop"  # a named choice: as OpenAI and vLLM answer

    after_tool = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]  # fmt: skip
    status, whole = await _post(decode, _chat_body(messages=after_tool, tool_choice="required"))
    assert status == 200, whole
    choice = whole["choices"][0]
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
    assert choice["finish_reason"] == "tool_calls"

    # auto after a tool result, and "none": text, as without tools.
    for extra in ({"messages": after_tool}, {"tool_choice": "none"}):
        status, whole = await _post(decode, _chat_body(max_tokens=8, **extra))
        assert status == 200, whole
        choice = whole["choices"][0]
        assert "tool_calls" not in choice["message"]
        assert choice["message"]["content"] and "<" not in choice["message"]["content"]
        assert choice["finish_reason"] == "length"
        assert whole["usage"]["completion_tokens"] == 8


async def test_max_tokens_inside_the_call(pair: shims.Pair) -> None:
    _, decode = pair
    text, call_ids = _expected_call(ASK, ToolUse(TOOLS))
    cut = len(call_ids) - 8
    events = await decode.stream(_chat_body(max_tokens=cut, return_token_ids=True), CHAT_PATH)
    call, ids, finish, content = _streamed_call(events)
    assert (finish, content, ids) == ("length", "", call_ids[:cut])
    assert call["function"]["name"] == "get_weather"
    assert text.split("\n", 1)[1].startswith(call["function"]["arguments"])
    status, whole = await _post(decode, _chat_body(max_tokens=cut))
    assert status == 200, whole
    assert whole["choices"][0]["message"]["tool_calls"] == [call]
    assert whole["choices"][0]["finish_reason"] == "length"


async def test_an_unknown_named_tool_is_a_400_on_both_roles(pair: shims.Pair) -> None:
    kv = {"do_remote_decode": True, "do_remote_prefill": False}
    named = {"type": "function", "function": {"name": "launch_rockets"}}
    for shim in pair:
        status, body = await _post(shim, _chat_body(tool_choice=named, kv_transfer_params=kv))
        assert status == 400, body
        err = shims.assert_openai_error(body)
        assert err["param"] == "tool_choice" and "launch_rockets" not in err["message"]
        load = await shim.load()
        assert (load["used"], load["admitted"]) == (0, 0)


async def test_a_raw_prompt_never_calls_a_tool(pair: shims.Pair) -> None:
    prefill, decode = pair
    rendered = render_chat_text(ChatPrompt(ASK, tools=TOOLS))
    body = {"model": shims.MODEL, "prompt": rendered, "max_tokens": 8, "tools": TOOLS}
    events = await decode.stream(body, COMPLETIONS_PATH)
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert text and "<" not in text
    status, first = await _post(prefill, shims.prefill_leg(_chat_body(tool_choice="none")))
    assert status == 200 and "<" not in first["choices"][0]["message"]["content"]
    await prefill.kv("DELETE", first)
