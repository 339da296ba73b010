from __future__ import annotations

import pytest

from gateway.errors import BadRequest
from gateway.schemas import parse_completion


def parse(body: bytes) -> tuple[object, dict[str, object]]:
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
        (b'{"prompt":"x","kv_transfer_params":{"do_remote_decode":true}}', "kv_transfer_params"),
    ],
)
def test_bad_requests_name_the_offending_field(body: bytes, param: str | None) -> None:
    with pytest.raises(BadRequest) as info:
        parse(body)
    assert info.value.param == param
    assert info.value.status == 400


def test_error_messages_never_echo_the_prompt() -> None:
    with pytest.raises(BadRequest) as info:
        parse(b'{"prompt":["secret one","secret two"]}')
    assert "secret" not in info.value.message
