"""Bad input: a clear 4xx with an OpenAI error body, never a 500 or a hang."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests._cluster import ThreadedCluster


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


def test_bad_ttft_header_is_400(gateway: str) -> None:
    resp = httpx.post(
        gateway + "/v1/completions",
        json={"prompt": "x"},
        headers={"x-pdgate-ttft-timeout-ms": "soon"},
    )
    assert_openai_error(resp, 400)


def test_gateway_still_serves_after_bad_input(gateway: str) -> None:
    resp = httpx.post(gateway + "/v1/completions", json={"prompt": "fine", "max_tokens": 3})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 3
