"""The KV-block index against a real vLLM engine's KV events: before each request, the
gateway's index predicts how many of its prompt tokens the engine will find in its prefix
cache, and vLLM's answer reports the count (``usage.prompt_tokens_details.cached_tokens``).

One stock ``vllm serve`` on the tiny random Llama, with prefix caching, KV events on a ZMQ
PUB endpoint (``--kv-events-config``), prompt-token details, 32-token blocks and a KV cache
of 64 blocks, so that the shared-prefix workload below makes it evict. The gateway's parts
run in the test process (its tokenizer from the model directory, the index, and the
subscriber), as a gateway composes them; the vLLM engine is its own process.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from pdgate.config import Role
from pdgate.gateway.instances.affinity import PrefixIndex, PromptBlocks
from pdgate.gateway.instances.kv_events import KvEventFeed
from pdgate.gateway.instances.kv_index import KvBlockIndex, KvEventCounts
from pdgate.gateway.instances.prompt_tokens import PromptTokenizers
from pdgate.policies.base import RequestInfo
from pdgate.registry import InstanceRecord
from tests._redis import free_port
from tests.vllm.conftest import MODEL, START_TIMEOUT_S, Proc, wait_healthy

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK = 32
# The tiny model's KV: 2 layers x K,V x 2 heads x 64 x float32 = 2 KiB a token.
CACHE_BLOCKS = 64


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[tuple[str, str]]:
    port, events = free_port(), free_port()
    args = ["-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model)]
    args += ["--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port)]
    args += ["--dtype", "float32", "--enforce-eager", "--max-model-len", "1024"]
    args += ["--block-size", str(BLOCK), "--enable-prefix-caching"]
    args += ["--kv-cache-memory-bytes", str(CACHE_BLOCKS * BLOCK * 2048), "--max-num-seqs", "4"]
    args += ["--enable-prompt-tokens-details"]
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events}"}
    args += ["--kv-events-config", json.dumps(config)]
    proc = Proc(args, {}, "vllm-kv-events")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, time.monotonic() + START_TIMEOUT_S)
        yield url, f"tcp://127.0.0.1:{events}"
    finally:
        proc.stop()


def _workload(seed: int) -> list[str]:
    """Six shared prefixes of 300-900 tokens, each followed by a question, in random order:
    ~150 requests through a cache of 2,048 tokens."""
    rng = random.Random(seed)
    words = ["system", "prompt", "answers", "every", "question", "about", "cached", "blocks"]
    prefixes = [
        f"System {i}: " + " ".join(rng.choice(words) for _ in range(rng.randint(60, 240)))
        for i in range(6)
    ]
    return [
        f"{rng.choice(prefixes)} Question {n}: what is {rng.randint(1, 999)} plus one?"
        for n in range(150)
    ]


def test_predicted_cached_tokens_agree_with_what_vllm_reports(
    engine: tuple[str, str], tiny_model: Path
) -> None:
    url, endpoint = engine
    rows, counts = asyncio.run(_run(url, endpoint, tiny_model))
    agree = sum(predicted == reported for _, predicted, reported in rows)
    hits = sum(reported > 0 for _, _, reported in rows)
    same_tokens = sum(mine == theirs for (mine, theirs), _, _ in rows)
    print(f"{agree}/{len(rows)} agree, {hits} hits, {counts.removed} blocks evicted")
    assert same_tokens == len(rows)  # the gateway tokenizes as the engine does
    assert hits >= len(rows) // 3, rows  # the workload shares prefixes...
    assert counts.removed > 0  # ...and the engine evicted blocks
    assert agree >= 0.95 * len(rows), [r for r in rows if r[1] != r[2]]


async def _run(
    url: str, endpoint: str, model_dir: Path
) -> tuple[list[tuple[tuple[int, int], int, int]], KvEventCounts]:
    tokenizers = PromptTokenizers({MODEL: str(model_dir)})
    index = KvBlockIndex(tokenizers, PrefixIndex())
    feed = KvEventFeed(index, tokenizers, CollectorRegistry())
    record = InstanceRecord(id="vllm", role=Role.PREFILL, url=url, model=MODEL, kv_events=endpoint)
    feed.on_change({"vllm": record}, set())
    rows: list[tuple[tuple[int, int], int, int]] = []
    try:
        async with httpx.AsyncClient(timeout=120) as client:
            await asyncio.sleep(1.0)  # the subscription connects
            for prompt in _workload(3):
                blocks = index.blocks(RequestInfo(MODEL, None, prompt, len(prompt), 1))
                predicted = index.expected_cached_tokens(blocks, "vllm")
                assert predicted is not None
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
                resp = await client.post(url + "/v1/completions", json=body)
                assert resp.status_code == 200, resp.text
                usage = resp.json()["usage"]
                reported = usage["prompt_tokens_details"]["cached_tokens"]
                rows.append(((len(blocks.tokens), usage["prompt_tokens"]), predicted, reported))
                await _settled(index, blocks)
    finally:
        await feed.aclose()
    return rows, index.counts


async def _settled(index: KvBlockIndex, blocks: PromptBlocks) -> None:
    """Until the engine's events for the step just answered have arrived (its prompt's
    whole blocks are known), at most 3 s: the next prediction must see them."""
    want = (len(blocks.tokens) - 1) // BLOCK * BLOCK
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        if index.cached_tokens(blocks).get("vllm", 0) >= want:
            return
        await asyncio.sleep(0.01)
