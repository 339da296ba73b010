"""What a stock ``vllm serve`` says of its model, through the gateway: one real server on the
tiny random Llama, started with ``--max-model-len 2048``, behind ``pdgate gateway
--aggregated URL`` (and a second gateway that has the model's tokenizer itself).

``/v1/models`` through the gateway shows ``max_model_len`` 2048, read from the server; a
40k-token prompt (completions and chat) gets the gateway's 400 naming 2048 and the prompt's
count as vLLM counts it, before any queue; ``/tokenize`` through the gateway is the server's
own answer.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests._redis import free_port
from tests.vllm.conftest import MODEL, START_TIMEOUT_S, Proc, _url, wait_healthy

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

LIMIT = 2048
# About 7 tokens of the tiny model's tokenizer per repeat: over 40k tokens in all.
LONG = "Hello there, general Kenobi. " * 5800


@dataclass
class Stock:
    server_url: str
    gateway_url: str  # counts with the server's /tokenize
    tokenizing_url: str  # has the model's tokenizer: counts completion prompts itself
    procs: dict[str, Proc]


@pytest.fixture(scope="module")
def stock(tiny_model: Path) -> Iterator[Stock]:
    port = free_port()
    server_url = f"http://127.0.0.1:{port}"
    args = ["-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model)]
    args += ["--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port)]
    args += ["--dtype", "float32", "--enforce-eager", "--max-model-len", str(LIMIT)]
    args += ["--kv-cache-memory-bytes", str(64 << 20), "--max-num-seqs", "4"]
    procs: dict[str, Proc] = {}
    try:
        procs["server"] = Proc(args, {}, "server")
        wait_healthy(procs["server"], server_url, time.monotonic() + START_TIMEOUT_S)
        gateway = ["-m", "pdgate.config.cli", "gateway", "--port", "0"]
        gateway += ["--aggregated", f"{server_url} capacity=2"]
        env = {"PDGATE_GATEWAY_TTFT_TIMEOUT_S": "60"}
        procs["gateway"] = Proc(gateway, env, "gateway")
        tokenizers = f'{{"{MODEL}": "{tiny_model}"}}'
        procs["tokenizing"] = Proc(
            gateway, {**env, "PDGATE_GATEWAY_TOKENIZERS": tokenizers}, "tokenizing"
        )
        urls = [
            _url(procs[name].wait_line("pdgate gateway", 60)) for name in procs if name != "server"
        ]
        for url in urls:
            deadline = time.monotonic() + 30
            while not httpx.get(url + "/v1/models", timeout=5).json()["data"]:
                assert time.monotonic() < deadline, "the gateway never listed the server"
                time.sleep(0.2)
        yield Stock(server_url, urls[0], urls[1], procs)
    finally:
        for proc in procs.values():
            proc.stop()


def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


def test_models_through_the_gateway_show_the_servers_max_model_len(stock: Stock) -> None:
    (card,) = httpx.get(stock.gateway_url + "/v1/models", timeout=5).json()["data"]
    assert (card["id"], card["max_model_len"], card["parent"]) == (MODEL, LIMIT, None)
    (own,) = httpx.get(stock.server_url + "/v1/models", timeout=5).json()["data"]
    assert own["max_model_len"] == LIMIT
    rows = httpx.get(stock.gateway_url + "/admin/instances", timeout=5).json()["instances"]
    assert [(r["max_model_len"], tuple(r["endpoints"])) for r in rows] == [
        (LIMIT, ("/tokenize", "/detokenize"))  # a generative model: no pooling routes
    ]


def test_tokenize_through_the_gateway_is_the_servers_own(stock: Stock) -> None:
    chat = [{"role": "user", "content": "Count my tokens, please."}]
    for body in (
        {"model": MODEL, "prompt": "Hello there, general Kenobi."},
        {"model": MODEL, "prompt": "Hello", "return_token_strs": True},
        {"model": MODEL, "messages": chat},
    ):
        via = _post(stock.gateway_url, "/tokenize", body)
        assert via.status_code == 200, via.text
        assert via.json() == _post(stock.server_url, "/tokenize", body).json()
    tokens = _post(stock.gateway_url, "/tokenize", {"prompt": "Hello there"}).json()["tokens"]
    back = _post(stock.gateway_url, "/detokenize", {"model": MODEL, "tokens": tokens})
    assert back.json() == _post(stock.server_url, "/detokenize", {"tokens": tokens}).json()


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_a_40k_token_prompt_gets_a_400_naming_2048_and_its_count(stock: Stock, api: str) -> None:
    if api == "chat":
        messages = [{"role": "user", "content": LONG}]
        count_body: dict[str, Any] = {"model": MODEL, "messages": messages}
        path, body, where = "/v1/chat/completions", {"messages": messages}, "messages"
    else:
        count_body = {"model": MODEL, "prompt": LONG}
        path, body, where = "/v1/completions", {"prompt": LONG}, "prompt"
    count = _post(stock.server_url, "/tokenize", count_body).json()["count"]
    assert count > 40_000
    urls = [stock.gateway_url] + ([stock.tokenizing_url] if api == "completions" else [])
    for url in urls:
        resp = _post(url, path, {"model": MODEL, **body, "max_tokens": 16})
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert (err["code"], err["param"]) == ("context_length_exceeded", where)
        assert f"maximum context length is {LIMIT} tokens" in err["message"]
        assert f"({count} in the {where}, 16 in the completion)" in err["message"]
        health = httpx.get(url + "/health", timeout=5).json()
        assert (health["pending"], health["inflight"], health["open_streams"]) == (0, 0, 0)
    # A prompt that fits is served, by the same server.
    ok = _post(
        stock.gateway_url, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
    )
    assert ok.status_code == 200, ok.text
