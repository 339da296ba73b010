"""Bad input: a clear 4xx with an OpenAI error body, never a 500 or a hang."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests._cluster import ThreadedCluster, shim_load


@pytest.fixture(scope="module")
def gateway() -> Iterator[str]:
    with ThreadedCluster(prefills=1, decodes=1, gateway={"max_body_bytes": 1024 * 1024}) as c:
        yield c.url


def assert_openai_error(resp: httpx.Response, status: int) -> dict[str, object]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    return err


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"prompt": "x", "max_tokens": ', None),
        (b'{"prompt": 12}', "prompt"),
        (b'{"prompt": "x", "max_tokens": "ten"}', "max_tokens"),
        (b'{"prompt": "x", "max_tokens": -5}', "max_tokens"),
        (b'{"prompt": "x", "max_tokens": 10000000000}', "max_tokens"),
        (b'{"max_tokens": 5}', "prompt"),
        (b'{"prompt": "x", "stream": "true"}', "stream"),
        (b"", None),
    ],
)
def test_bad_bodies_are_400(gateway: str, body: bytes, param: str | None) -> None:
    resp = httpx.post(
        gateway + "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    err = assert_openai_error(resp, 400)
    assert err["param"] == param
    assert err["type"] == "invalid_request_error"


def test_ten_megabyte_body_is_413_without_reading_it_all(gateway: str) -> None:
    big = b'{"prompt": "' + b"a" * (10 * 1024 * 1024) + b'"}'
    resp = httpx.post(
        gateway + "/v1/completions", content=big, headers={"content-type": "application/json"}
    )
    assert_openai_error(resp, 413)


def test_chunked_body_over_the_limit_is_413(gateway: str) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"a" * 65536
        yield b'"}'

    resp = httpx.post(
        gateway + "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert_openai_error(resp, 413)


def test_unknown_route_and_wrong_method_are_openai_errors(gateway: str) -> None:
    assert_openai_error(httpx.get(gateway + "/v1/nope"), 404)
    assert_openai_error(httpx.get(gateway + "/v1/completions"), 405)


@pytest.mark.parametrize(
    "header", [{"x-pdgate-ttft-timeout-ms": "soon"}, {"x-pdgate-tpot-slo-ms": "0"},
               {"x-pdgate-tpot-slo-ms": "fast"}],
)  # fmt: skip
def test_bad_slo_headers_are_400(gateway: str, header: dict[str, str]) -> None:
    resp = httpx.post(gateway + "/v1/completions", json={"prompt": "x"}, headers=header)
    err = assert_openai_error(resp, 400)
    assert next(iter(header)) in str(err["message"])


def _nested(levels: int) -> bytes:
    return b"[" * levels + b"]" * levels


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", b'{"prompt":"x","stream":true,"x":' + _nested(254) + b"}"),
        ("/v1/completions", b'{"prompt":"x","response_format":' + _nested(600) + b"}"),
        ("/v1/chat/completions", b'{"messages":[{"role":"user","content":"hi"}],"tools":[{"type":'
         b'"function","function":{"name":"f","parameters":' + _nested(300) + b"}}]}"),
        ("/v1/chat/completions", b'{"messages":[{"role":"assistant","tool_calls":[{"id":"1","type":'
         b'"function","function":{"name":"f","arguments":' + _nested(300) + b'}}]},{"role":"user",'
         b'"content":"x"}]}'),
    ],
    ids=["completion-field", "completion-deeper", "chat-tools", "chat-tool-calls"],
)  # fmt: skip
def test_a_body_nested_too_deep_is_400_and_holds_nothing(
    gateway: str, path: str, body: bytes
) -> None:
    """Deeper than the gateway can write again (orjson reads 1,024 levels, writes 255): it
    once took a prefill slot for good, or answered 500 where the chat's key was hashed."""
    for _ in range(3):  # more than the prefill's slots, were any taken
        resp = httpx.post(
            gateway + path, content=body, headers={"content-type": "application/json"}
        )
        err = assert_openai_error(resp, 400)
        assert "nested more than" in str(err["message"])
    resp = httpx.post(gateway + "/v1/completions", json={"prompt": "fine", "max_tokens": 2})
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("name", ["x-pdgate-ttft-timeout-ms", "x-pdgate-tpot-slo-ms"])
def test_an_slo_header_beyond_any_float_is_no_tighter_than_the_bound(
    gateway: str, name: str
) -> None:
    resp = httpx.post(
        gateway + "/v1/completions",
        json={"prompt": "x", "max_tokens": 2},
        headers={name: "1" + "0" * 400},
    )
    assert resp.status_code == 200, resp.text


def test_gateway_still_serves_after_bad_input(gateway: str) -> None:
    resp = httpx.post(gateway + "/v1/completions", json={"prompt": "fine", "max_tokens": 3})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 3


def test_a_prompt_too_long_for_the_model_names_the_clients_max_tokens(gateway: str) -> None:
    """The prefill leg asks for max_tokens=1: the context-length error said "max_tokens is
    1" whatever the client asked for. The gateway counts the prompt against the model's
    max_model_len with the client's max_tokens (the sim tokenizer makes each short word one
    token)."""
    body = {"model": "sim-llama-3.1-8b", "prompt": " ab" * 66_000, "max_tokens": 16}
    resp = httpx.post(gateway + "/v1/completions", json=body, timeout=30)
    err = assert_openai_error(resp, 400)
    assert (err["param"], err["code"]) == ("prompt", "context_length_exceeded")
    assert "context length is 32768 tokens" in str(err["message"])
    assert "66016 tokens (66000 in the prompt, 16 in the completion)" in str(err["message"])


def test_a_prompt_only_the_clients_max_tokens_makes_too_long_is_refused_before_its_prefill() -> (
    None
):
    """32,700 prompt tokens fit the model's 32,768 with the prefill leg's max_tokens=1, not
    with the client's 100: the prefill computed the prompt, then the decode refused it. Now
    the gateway refuses it before either leg."""
    with ThreadedCluster(prefills=1, decodes=1) as c:
        (prefill,) = [r["url"] for r in c.instances() if r["role"] == "prefill"]
        computed = shim_load(prefill)["prefix_cache_total_tokens"]
        body = {"model": "sim-llama-3.1-8b", "prompt": " ab" * 32_700, "max_tokens": 100}
        resp = httpx.post(c.url + "/v1/completions", json=body, timeout=30)
        err = assert_openai_error(resp, 400)
        assert "32800 tokens (32700 in the prompt, 100 in the completion)" in str(err["message"])
        assert err["param"] == "max_tokens"
        assert shim_load(prefill)["prefix_cache_total_tokens"] == computed
