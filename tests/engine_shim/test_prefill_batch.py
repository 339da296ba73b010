"""The prefill shim's batch endpoint (pdgate extension for batch forwarding)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests._cluster import ThreadedCluster, shim_load


@pytest.fixture(scope="module")
def prefill() -> Iterator[str]:
    with ThreadedCluster(prefills=1, decodes=1, shim={"capacity": 2, "kv_hold_timeout_s": 30}) as c:
        assert c.info is not None
        yield c.info.prefill_urls[0]


def item(prompt: str) -> dict[str, Any]:
    return {
        "model": "sim-llama-3.1-8b",
        "prompt": prompt,
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True},
    }


def test_batch_admits_in_order_and_rejects_the_rest_first(prefill: str) -> None:
    body = {
        "requests": [item(f"prompt {i} " * 20) for i in range(4)],
        "kv_ids": ["a" * 16, "b" * 16],
    }
    start = time.monotonic()
    lines: list[tuple[float, dict[str, Any]]] = []
    with httpx.stream("POST", prefill + "/v1/completions/batch", json=body, timeout=10) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("application/x-ndjson")
        for line in resp.iter_lines():
            lines.append((time.monotonic() - start, orjson.loads(line)))
    by_index = {entry["index"]: entry for _, entry in lines}
    assert sorted(by_index) == [0, 1, 2, 3]
    assert [by_index[i]["status"] for i in range(4)] == [200, 200, 429, 429]
    assert by_index[2]["body"]["error"]["code"] == "no_free_slot"
    # Rejections are reported before any completion: the gateway re-queues them at once.
    order = [entry["status"] for _, entry in lines]
    assert order[:2] == [429, 429]
    # The caller's KV ids name the handles, so it can release them without the answer.
    assert by_index[0]["body"]["kv_transfer_params"]["remote_request_id"] == "a" * 16
    assert shim_load(prefill)["kv_held"] == 2
    for kv_id in ("a" * 16, "b" * 16):
        assert httpx.delete(f"{prefill}/v1/kv/{kv_id}").status_code == 204
    assert shim_load(prefill)["used"] == 0


def test_bad_items_fail_alone(prefill: str) -> None:
    body = {"requests": [{"prompt": 5}, item("fine")]}
    resp = httpx.post(prefill + "/v1/completions/batch", json=body, timeout=10)
    lines = {e["index"]: e for e in map(orjson.loads, resp.text.splitlines())}
    assert lines[0]["status"] == 400
    assert lines[1]["status"] == 200
    rid = lines[1]["body"]["kv_transfer_params"]["remote_request_id"]
    assert httpx.delete(f"{prefill}/v1/kv/{rid}").status_code == 204


def test_each_item_is_checked_against_its_own_decode_max_tokens(prefill: str) -> None:
    """The gateway says what each request's decode leg will ask for: an item the model's
    context (32,768 tokens) cannot hold with it is refused before it is computed, naming it;
    a value that is not a positive integer is ignored, as a server without the field would."""
    long = " ab" * 32_700
    body = {"requests": [item(long), item(long), item("short")], "decode_max_tokens": [100, "x", 5]}
    resp = httpx.post(prefill + "/v1/completions/batch", json=body, timeout=10)
    lines = {e["index"]: e for e in map(orjson.loads, resp.text.splitlines())}
    assert [lines[i]["status"] for i in range(3)] == [400, 200, 200]
    assert "max_tokens is 100" in lines[0]["body"]["error"]["message"]
    for i in (1, 2):
        rid = lines[i]["body"]["kv_transfer_params"]["remote_request_id"]
        assert httpx.delete(f"{prefill}/v1/kv/{rid}").status_code == 204


@pytest.mark.parametrize(
    "body",
    [
        b"{",
        b"[]",
        b'{"requests": []}',
        b'{"requests": [1]}',
        # An item deeper than its own body may be (it answered 500 where it was re-encoded).
        b'{"requests":[{"prompt":"a","max_tokens":1,"kv_transfer_params":'
        + b'{"a":' * 300
        + b"1"
        + b"}" * 300
        + b"}]}",
    ],
)
def test_malformed_batches_are_400(prefill: str, body: bytes) -> None:
    resp = httpx.post(prefill + "/v1/completions/batch", content=body, timeout=10)
    assert resp.status_code == 400
    assert "error" in resp.json()


def test_duplicate_kv_ids_fail_alone_and_the_stream_goes_on(prefill: str) -> None:
    # Index 1 repeats index 0's id: a 409 line for it, the others are served and the NDJSON
    # answer has a line for every request.
    body = {
        "requests": [item(f"dup {i}") for i in range(2)],
        "kv_ids": ["d" * 16, "d" * 16],
        "request_ids": ["req-a", "req-b"],
    }
    resp = httpx.post(prefill + "/v1/completions/batch", json=body, timeout=10)
    assert resp.status_code == 200
    lines = {e["index"]: e for e in map(orjson.loads, resp.text.splitlines())}
    assert sorted(lines) == [0, 1]
    assert lines[0]["status"] == 200
    assert lines[0]["body"]["id"] == "req-a"
    assert lines[1]["status"] == 409
    assert lines[1]["body"]["error"]["code"] == "duplicate_kv_id"
    assert set(lines[1]["body"]["error"]) == {"message", "type", "param", "code"}
    load = shim_load(prefill)
    assert (load["used"], load["kv_held"]) == (1, 1)
    assert httpx.delete(f"{prefill}/v1/kv/{'d' * 16}").status_code == 204
    assert shim_load(prefill)["used"] == 0
