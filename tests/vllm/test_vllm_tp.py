"""pdgate's KV connector under tensor parallelism, on the CPU: vLLM 0.32 runs TP 2 there
when each rank's threads are bound by hand (its automatic binding wants a NUMA node per rank,
and this machine has one).

A TP-2 prefill shim feeds a TP-1 decode shim, and a TP-1 prefill a TP-2 decode, each pair
behind a real gateway: each rank of the TP-2 engine writes or reads only its own KV heads'
columns of the buffer's token rows, and a greedy streamed completion equals, token for
token, the tiny model's greedy output from one aggregated TP-1 engine, with the decode's
prefix hits counting the prompt it loaded.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._cluster import get_instances, shim_load, wait_for
from tests.vllm.conftest import (
    MODEL,
    PROMPTS,
    REFERENCE_TOKENS,
    START_TIMEOUT_S,
    Proc,
    _url,
    vllm_shim_env,
)
from tests.vllm.test_vllm_pd import _stream_ids

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

# vLLM's CPU workers: rank 0's threads on CPU 0, rank 1's on CPU 1 (VLLM_CPU_OMP_THREADS_BIND).
TP2 = {
    "PDGATE_SHIM_VLLM_ENGINE_ARGS": json.dumps({"tensor_parallel_size": 2}),
    "VLLM_CPU_OMP_THREADS_BIND": "0|1",
}


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> dict[str, dict[str, Any]]:
    """The greedy output of one aggregated TP-1 engine, per prompt."""
    proc = Proc(
        ["-m", "tests.vllm._reference", str(tiny_model), str(REFERENCE_TOKENS), *PROMPTS],
        {},
        "reference",
    )
    try:
        lines = proc.wait_lines("REFERENCE ", len(PROMPTS), START_TIMEOUT_S)
    finally:
        proc.stop()
    return {
        prompt: json.loads(line.removeprefix("REFERENCE "))
        for prompt, line in zip(PROMPTS, lines, strict=True)
    }


@pytest.fixture(scope="module", params=["tp2-prefill", "tp2-decode"])
def pair(
    request: pytest.FixtureRequest, redis_url: str, tiny_model: Path
) -> Iterator[tuple[str, str, str]]:
    """A gateway in front of a prefill shim and a decode shim, one of them TP 2: the URLs
    of the gateway, the prefill and the decode."""
    from tests._redis import delete_prefix

    prefix = f"pdgate-test:{uuid.uuid4().hex}"
    registry = {"PDGATE_REGISTRY_URL": redis_url, "PDGATE_REGISTRY_KEY_PREFIX": prefix}
    shim = vllm_shim_env(registry, tiny_model)
    tp2_prefill = request.param == "tp2-prefill"
    cli = ["-m", "pdgate.config.cli"]
    procs: dict[str, Proc] = {}
    try:
        procs["prefill"] = Proc(
            [*cli, "shim", "--role", "prefill", "--capacity", "1"],
            {**shim, **(TP2 if tp2_prefill else {})},
            "prefill",
        )
        procs["decode"] = Proc(
            [*cli, "shim", "--role", "decode", "--capacity", "2"],
            {**shim, **({} if tp2_prefill else TP2)},
            "decode",
        )
        procs["gateway"] = Proc(
            [*cli, "gateway", "--port", "0"],
            {**registry, "PDGATE_GATEWAY_TTFT_TIMEOUT_S": "60"},
            "gateway",
        )
        gateway = _url(procs["gateway"].wait_line("pdgate gateway", 60))
        prefill = _url(procs["prefill"].wait_line("pdgate shim", START_TIMEOUT_S))
        decode = _url(procs["decode"].wait_line("pdgate shim", START_TIMEOUT_S))
        wait_for(lambda: len(get_instances(gateway)) == 2, timeout=15, what="both registered")
        yield gateway, prefill, decode
    finally:
        for proc in procs.values():
            proc.stop()
        delete_prefix(redis_url, prefix)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_tp2_on_one_side_and_tp1_on_the_other_give_one_engines_greedy_tokens(
    pair: tuple[str, str, str], reference: dict[str, dict[str, Any]], prompt: str
) -> None:
    gateway, prefill, decode = pair
    before = shim_load(decode)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": REFERENCE_TOKENS, "temperature": 0,
            "stream": True, "return_token_ids": True}  # fmt: skip
    text, ids = _stream_ids(gateway, body)
    ref = reference[prompt]
    assert ids == ref["token_ids"]
    assert text == ref["text"]
    after = shim_load(decode)
    # The decode loaded all of the prompt but its last token from the prefill's buffer.
    loaded = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    assert loaded >= len(ref["prompt_token_ids"]) - 1, (loaded, ref["prompt_token_ids"])
    assert after["local_prefills"] == before["local_prefills"]
    wait_for(lambda: shim_load(prefill)["kv_held"] == 0, what="the buffer taken")
