"""Gateway + vLLM prefill shim + vLLM decode shim on a tiny random Llama, on the CPU.

* A greedy streamed completion through the gateway equals, token for token, the same model's
  greedy output from one aggregated vLLM engine, and the decode really used the transferred
  KV (its prefix hits count the loaded prompt tokens) instead of recomputing the prompt.
* A request that finds the prefill's only slot taken gets 429 there and the gateway retries
  it until the slot frees.
* A client that disconnects aborts the vLLM request: on the decode while streaming, on the
  prefill while its long prompt is still being computed.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import httpx
import orjson
import pytest

from tests._cluster import hold_prefill_slot, shim_load, wait_for
from tests.vllm.conftest import MODEL, PROMPTS, REFERENCE_TOKENS, VllmCluster

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def _stream(gateway_url: str, body: dict[str, Any]) -> tuple[list[str], dict[str, Any] | None]:
    """Text of every streamed chunk, and the usage chunk."""
    texts: list[str] = []
    usage = None
    with httpx.stream(
        "POST", gateway_url + "/v1/completions", json={**body, "stream": True}, timeout=60
    ) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                break
            event = orjson.loads(data)
            assert "error" not in event, event
            if event["choices"]:
                texts.append(event["choices"][0]["text"])
            if event.get("usage"):
                usage = event["usage"]
    return texts, usage


def _greedy(prompt: str, max_tokens: int = REFERENCE_TOKENS) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }


@pytest.mark.parametrize("prompt", PROMPTS)
def test_disaggregated_greedy_equals_aggregated(vllm_cluster: VllmCluster, prompt: str) -> None:
    ref = vllm_cluster.reference[prompt]
    prefill0 = shim_load(vllm_cluster.prefill_url)
    decode0 = shim_load(vllm_cluster.decode_url)

    texts, usage = _stream(vllm_cluster.gateway_url, _greedy(prompt))

    assert "".join(texts) == ref["text"]
    assert usage is not None
    assert usage["completion_tokens"] == len(ref["token_ids"])
    prompt_tokens = usage["prompt_tokens"]
    prefill = shim_load(vllm_cluster.prefill_url)
    decode = shim_load(vllm_cluster.decode_url)
    assert prefill["kv_fetched"] == prefill0["kv_fetched"] + 1
    assert decode["completed"] == decode0["completed"] + 1
    # The decode computed only the last prompt token: the rest came from the prefill's KV.
    loaded = decode["prefix_cache_hit_tokens"] - decode0["prefix_cache_hit_tokens"]
    assert loaded >= prompt_tokens - 1, (loaded, prompt_tokens)
    wait_for(lambda: shim_load(vllm_cluster.prefill_url)["used"] == 0, what="prefill slot free")
    assert shim_load(vllm_cluster.prefill_url)["kv_held"] == 0


def test_busy_prefill_429_is_retried_by_the_gateway(vllm_cluster: VllmCluster) -> None:
    prompt = PROMPTS[0]
    before = shim_load(vllm_cluster.prefill_url)
    held = hold_prefill_slot(vllm_cluster.prefill_url, prompt="an earlier request holds it")
    assert shim_load(vllm_cluster.prefill_url)["free"] == 0

    result: dict[str, Any] = {}

    def client() -> None:
        try:
            result["texts"], result["usage"] = _stream(vllm_cluster.gateway_url, _greedy(prompt))
        except BaseException as exc:  # reported by the assertion below
            result["error"] = exc

    thread = threading.Thread(target=client)
    thread.start()
    try:
        # The prefill turned the request away at once (no local queue) ...
        wait_for(
            lambda: shim_load(vllm_cluster.prefill_url)["rejected"] > before["rejected"],
            timeout=15,
            what="a 429 from the busy prefill",
        )
        assert thread.is_alive()  # ... and the gateway keeps it, waiting for a free slot.
    finally:
        # The earlier request's KV is released: the slot frees and the gateway's retry lands.
        url = vllm_cluster.prefill_url + "/v1/kv/" + held["remote_request_id"]
        assert httpx.delete(url, timeout=10).status_code == 204
        thread.join(60)
    assert "error" not in result, result
    assert "".join(result["texts"]) == vllm_cluster.reference[prompt]["text"]
    after = shim_load(vllm_cluster.prefill_url)
    assert after["admitted"] == before["admitted"] + 2  # the holder and the retried request


def _disconnect_after(gateway_url: str, body: dict[str, Any], chunks: int) -> None:
    """Stream `body` and hang up after `chunks` data lines (0: as soon as headers arrive)."""
    with httpx.stream("POST", gateway_url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        seen = 0
        for line in resp.iter_lines():
            if seen >= chunks:
                break
            if line:
                seen += 1


def test_client_disconnect_aborts_the_decode(vllm_cluster: VllmCluster) -> None:
    decode0 = shim_load(vllm_cluster.decode_url)
    body = {**_greedy(PROMPTS[1], max_tokens=1500), "ignore_eos": True, "stream": True}
    _disconnect_after(vllm_cluster.gateway_url, body, chunks=3)

    def aborted() -> bool:
        load = shim_load(vllm_cluster.decode_url)
        return load["engine_aborted"] == decode0["engine_aborted"] + 1 and load["used"] == 0

    wait_for(aborted, timeout=15, what="the decode's vLLM request aborted")
    assert shim_load(vllm_cluster.decode_url)["cancelled"] == decode0["cancelled"] + 1
    wait_for(lambda: shim_load(vllm_cluster.decode_url)["running"] == 0, what="decode idle")


def test_client_disconnect_aborts_the_prefill(vllm_cluster: VllmCluster) -> None:
    prefill0 = shim_load(vllm_cluster.prefill_url)
    decode0 = shim_load(vllm_cluster.decode_url)
    # ~1800 tokens computed 16 per engine step: the prefill is still running when we leave.
    long_prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 130)
    body = orjson.dumps({"model": MODEL, "prompt": long_prompt, "max_tokens": 4, "stream": True})
    url = httpx.URL(vllm_cluster.gateway_url)
    assert url.host is not None
    assert url.port is not None
    # A raw socket: the gateway sends no status before the prefill is done, and the point
    # is to leave before that.
    with socket.create_connection((url.host, url.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: pdgate\r\n"
            b"content-type: application/json\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_for(
            lambda: shim_load(vllm_cluster.prefill_url)["used"] == 1,
            timeout=10,
            what="the prefill admitting the long prompt",
        )
        time.sleep(0.2)  # into the engine's chunked prefill

    def aborted() -> bool:
        load = shim_load(vllm_cluster.prefill_url)
        return (
            load["engine_aborted"] == prefill0["engine_aborted"] + 1
            and load["used"] == 0
            and load["kv_held"] == 0
        )

    wait_for(aborted, timeout=15, what="the prefill's vLLM request aborted")
    assert shim_load(vllm_cluster.prefill_url)["cancelled"] == prefill0["cancelled"] + 1
    assert shim_load(vllm_cluster.decode_url)["admitted"] == decode0["admitted"]


def test_sampling_vllm_refuses_is_a_400(vllm_cluster: VllmCluster) -> None:
    resp = httpx.post(
        vllm_cluster.prefill_url + "/v1/completions",
        json={
            "model": MODEL,
            "prompt": PROMPTS[0],
            "max_tokens": 1,
            "top_p": 5,  # vLLM: top_p must be in (0, 1]
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
        },
        timeout=30,
    )
    assert resp.status_code == 400, resp.text
    assert shim_load(vllm_cluster.prefill_url)["used"] == 0
