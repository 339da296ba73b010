"""The vLLM decode shim takes a plain request (no kv_transfer_params) and prefills it itself.

Its greedy output equals, token for token, the same prompt's output through prefill and
decode (and the aggregated engine's), and the prefill is never involved. So does an
aggregated vLLM shim that alternates phases (the partial strategy) behind a gateway.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import orjson
import pytest

from tests._cluster import get_instances, shim_load, wait_for
from tests.vllm import conftest as harness

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def _greedy_text(base_url: str, prompt: str) -> str:
    body = {
        "model": harness.MODEL,
        "prompt": prompt,
        "max_tokens": harness.REFERENCE_TOKENS,
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


@pytest.mark.parametrize("prompt", harness.PROMPTS)
def test_plain_request_on_the_decode_equals_the_disaggregated_output(
    vllm_cluster: harness.VllmCluster, prompt: str
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


def test_the_partial_strategy_in_front_of_vllm_gives_the_same_greedy_output(
    vllm_cluster: harness.VllmCluster, redis_url: str
) -> None:
    """An aggregated vLLM shim that alternates phases, behind its own gateway (a registry
    of their own): every prompt's greedy output equals the aggregated engine's, the phases
    show in /load, and no prompt is left waiting at the gate."""
    registry = {
        "PDGATE_REGISTRY_URL": redis_url,
        "PDGATE_REGISTRY_KEY_PREFIX": f"pdgate-test:partial-{uuid.uuid4().hex}",
    }
    # The cluster's decode settings (same engine and model), as an aggregated instance.
    shim_env = {
        k: v for k, v in vllm_cluster.procs["decode"].env.items() if k.startswith("PDGATE_SHIM_")
    }
    cli = ["-m", "pdgate.config.cli"]
    procs = {
        "shim": harness.Proc(
            [*cli, "shim", "--role", "aggregated", "--capacity", "4"],
            {**shim_env, **registry, "PDGATE_SHIM_PHASES": "1"},
            "partial-shim",
        ),
        "gateway": harness.Proc(
            [*cli, "gateway", "--port", "0"],
            {**registry, "PDGATE_GATEWAY_TTFT_TIMEOUT_S": "20"},
            "partial-gateway",
        ),
    }
    try:
        gateway = harness._url(procs["gateway"].wait_line("pdgate gateway", 60))
        shim = harness._url(procs["shim"].wait_line("pdgate shim", harness.START_TIMEOUT_S))
        wait_for(lambda: len(get_instances(gateway)) == 1, timeout=15, what="shim registered")
        for prompt in harness.PROMPTS:
            assert _greedy_text(gateway, prompt) == vllm_cluster.reference[prompt]["text"]
        load = shim_load(shim)
        assert load["role"] == "aggregated"
        assert load["local_prefills"] == len(harness.PROMPTS)
        assert load["phase_switches"] >= 1 and load["pending_prefills"] == 0
        assert load["phase"] in ("prefill", "decode")
    finally:
        for proc in procs.values():
            proc.stop()
