"""The vLLM decode shim takes a plain request (no kv_transfer_params) and prefills it itself.

Its greedy output equals, token for token, the same prompt's output through prefill and
decode (and the aggregated engine's), and the prefill is never involved.
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from tests._cluster import shim_load
from tests.vllm.conftest import MODEL, PROMPTS, REFERENCE_TOKENS, VllmCluster

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def _greedy_text(base_url: str, prompt: str) -> str:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": REFERENCE_TOKENS,
        "temperature": 0,
        "stream": True,
    }
    texts: list[str] = []
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            event: dict[str, Any] = orjson.loads(line.removeprefix("data: "))
            assert "error" not in event, event
            texts += [choice["text"] for choice in event["choices"]]
    return "".join(texts)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_plain_request_on_the_decode_equals_the_disaggregated_output(
    vllm_cluster: VllmCluster, prompt: str
) -> None:
    prefill0 = shim_load(vllm_cluster.prefill_url)
    decode0 = shim_load(vllm_cluster.decode_url)

    local = _greedy_text(vllm_cluster.decode_url, prompt)

    decode = shim_load(vllm_cluster.decode_url)
    assert decode["local_prefills"] == decode0["local_prefills"] + 1
    assert decode["completed"] == decode0["completed"] + 1
    assert shim_load(vllm_cluster.prefill_url)["admitted"] == prefill0["admitted"]
    assert local == vllm_cluster.reference[prompt]["text"]
    assert local == _greedy_text(vllm_cluster.gateway_url, prompt)  # prefill + decode
    assert shim_load(vllm_cluster.prefill_url)["kv_fetched"] == prefill0["kv_fetched"] + 1
