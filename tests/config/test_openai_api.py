"""The one completions schema both sides of the wire validate with."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from pdgate.config.openai_api import (
    MAX_JSON_DEPTH,
    CompletionRequest,
    OpenAIError,
    parse_chat,
    parse_completion,
)


def parse(body: bytes) -> tuple[CompletionRequest, dict[str, Any]]:
    return parse_completion(body, max_tokens_limit=1000, default_max_tokens=16)


def test_valid_request_keeps_unknown_sampling_fields_for_the_engine() -> None:
    _, forward = parse(b'{"model":"m","prompt":"hi","top_k":5,"seed":1}')
    assert forward["top_k"] == 5 and forward["seed"] == 1
    assert forward["max_tokens"] == 16  # default filled in so prefill and decode agree


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[1,2]", None),
        (b'{"max_tokens":4}', "prompt"),
        (b'{"prompt":7}', "prompt"),
        (b'{"prompt":""}', "prompt"),
        (b'{"prompt":["a","b"]}', "prompt"),
        (b'{"prompt":"x","max_tokens":-1}', "max_tokens"),
        (b'{"prompt":"x","max_tokens":0}', "max_tokens"),
        (b'{"prompt":"x","max_tokens":1000000}', "max_tokens"),
        (b'{"prompt":"x","max_tokens":"12"}', "max_tokens"),
        (b'{"prompt":"x","max_tokens":1.5}', "max_tokens"),
        (b'{"prompt":"x","stream":"yes"}', "stream"),
        (b'{"prompt":"x","temperature":-1}', "temperature"),
        (b'{"prompt":"x","stop":["a","b","c","d","e"]}', "stop"),
        (b'{"prompt":"x","n":3}', "n"),
        (b'{"prompt":"x","echo":true}', "echo"),
        (b'{"prompt":"x","stream_options":{"include_usage":true}}', "stream_options"),
        (b'{"prompt":"x","logprobs":21}', "logprobs"),
        (b'{"prompt":"x","prompt_logprobs":1}', "prompt_logprobs"),
        (b'{"prompt":[]}', "prompt"),
        (b'{"prompt":[[]]}', "prompt"),
        (b'{"prompt":[1,"a"]}', "prompt"),
    ],
)
def test_bad_requests_name_the_offending_field(body: bytes, param: str | None) -> None:
    with pytest.raises(OpenAIError) as info:
        parse(body)
    assert info.value.param == param
    assert info.value.status == 400


def test_error_messages_never_echo_the_prompt() -> None:
    with pytest.raises(OpenAIError) as info:
        parse(b'{"prompt":["secret one","secret two"]}')
    assert "secret" not in info.value.message


def test_prompt_forms_vllm_accepts_are_one_prompt() -> None:
    cases = {
        b'{"prompt":"hi"}': "hi",
        b'{"prompt":["hi"]}': "hi",
        b'{"prompt":[1,2,3]}': [1, 2, 3],
        b'{"prompt":[[1,2]]}': [1, 2],
    }
    for body, prompt in cases.items():
        req, _ = parse(body)
        assert req.one_prompt == prompt


def test_sampling_collects_what_the_client_set() -> None:
    req, _ = parse(b'{"prompt":"x","temperature":0,"seed":3,"logprobs":2,"stop":["a",""]}')
    assert req.sampling() == {"temperature": 0, "seed": 3, "logprobs": 2}
    assert req.stop_sequences == ("a",)


def test_chat_forwards_one_output_limit_as_max_tokens() -> None:
    from pdgate.config.openai_api import parse_chat

    body = b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":9,"max_completion_tokens":5}'
    req, forward = parse_chat(body, max_tokens_limit=100, default_max_tokens=16)
    # max_completion_tokens wins (as in vLLM); only max_tokens goes on, so the gateway's
    # max_tokens = 1 on the prefill leg is the only limit there.
    assert (req.max_tokens, forward["max_tokens"]) == (5, 5)
    assert "max_completion_tokens" not in forward
    req, forward = parse_chat(b'{"messages":[{"role":"user","content":"hi"}]}',
                              max_tokens_limit=100, default_max_tokens=16)  # fmt: skip
    assert forward["max_tokens"] == 16


def test_chat_logprobs_reach_engines_as_a_count() -> None:
    from pdgate.config.openai_api import parse_chat

    def sampling(extra: bytes) -> dict[str, Any]:
        body = b'{"messages":[{"role":"user","content":"hi"}]' + extra + b"}"
        return parse_chat(body, max_tokens_limit=100)[0].sampling()

    assert sampling(b',"logprobs":true,"top_logprobs":3,"seed":1') == {"logprobs": 3, "seed": 1}
    assert sampling(b',"logprobs":true') == {"logprobs": 0}
    assert sampling(b',"logprobs":false') == {}


def test_a_conversations_key_extends_its_earlier_turns_key() -> None:
    from pdgate.config.openai_api import Api, parse_api

    turn1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    turn2 = [*turn1, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "?"}]
    key1 = parse_api(Api.CHAT, orjson.dumps({"messages": turn1}), max_tokens_limit=10)[0]
    key2 = parse_api(Api.CHAT, orjson.dumps({"messages": turn2}), max_tokens_limit=10)[0]
    assert key2.prompt_key.startswith(key1.prompt_key)
    assert key1.prompt_key != key2.prompt_key
    other = [{"role": "system", "content": "be long"}, {"role": "user", "content": "hi"}]
    key3 = parse_api(Api.CHAT, orjson.dumps({"messages": other}), max_tokens_limit=10)[0]
    assert not key2.prompt_key.startswith(key3.prompt_key)


def _nested(levels: int) -> bytes:
    """An array `levels` deep: the body holding it (an object) is one level more."""
    return b"[" * levels + b"]" * levels


@pytest.mark.parametrize("field", ["x", "response_format", "chat_template_kwargs"])
def test_a_body_nested_deeper_than_the_limit_is_400_and_one_at_it_is_parsed(field: str) -> None:
    """orjson reads 1,024 levels but writes only 255: a body the gateway could read but not
    forward would fail after it was queued, holding a prefill's slot."""
    body = b'{"prompt":"x","' + field.encode() + b'":' + _nested(MAX_JSON_DEPTH - 1) + b"}"
    _, forward = parse(body)
    assert orjson.dumps({"requests": [forward]})  # the batch call's nesting still writes
    deeper = b'{"prompt":"x","' + field.encode() + b'":' + _nested(MAX_JSON_DEPTH) + b"}"
    with pytest.raises(OpenAIError) as caught:
        parse(deeper)
    assert caught.value.status == 400
    assert f"nested more than {MAX_JSON_DEPTH} levels" in str(caught.value)


def test_brackets_in_text_are_not_nesting() -> None:
    _, forward = parse(orjson.dumps({"prompt": "[{" * 5000}))
    assert forward["prompt"] == "[{" * 5000


def test_a_chat_with_deeply_nested_tools_is_400() -> None:
    tools = b'[{"type":"function","function":{"name":"f","parameters":' + _nested(300) + b"}}]"
    body = b'{"messages":[{"role":"user","content":"hi"}],"tools":' + tools + b"}"
    with pytest.raises(OpenAIError) as caught:
        parse_chat(body, max_tokens_limit=1000)
    assert caught.value.status == 400
