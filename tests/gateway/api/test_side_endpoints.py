"""The side endpoints through a real gateway in front of stock-like servers given by URL
(tests/registry/_stock_server.py, a pooling model with ``--pooling``): each path relayed to
one instance as it answers, the official openai client's ``embeddings.create``, failover of
a failing instance, the engine's own 4xx, and nothing held afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pdgate.config.wire import SIDE_ENDPOINTS
from tests._cluster import (
    Processes,
    get_instances,
    nothing_held,
    openai_client,
    wait_for,
    wait_instances,
)
from tests.registry._stock_server import (
    FAST_PROBES,
    StockServer,
    byte_tokens,
    embedding,
)

EMBED = "stock-embed"


@pytest.fixture
def pooling() -> Iterator[list[StockServer]]:
    servers = [StockServer(EMBED, pooling=True).start() for _ in range(2)]
    yield servers
    for server in servers:
        server.kill()


def _gateway(processes: Processes, servers: list[StockServer], *extra: str, **env: str) -> str:
    args = [a for s in servers for a in ("--aggregated", f"{s.url} capacity=2")]
    url = processes.gateway(*args, *extra, env={**FAST_PROBES, **env})
    wait_instances(url, len(servers))
    return url


def _served(servers: list[StockServer], path: str) -> int:
    return sum(int(s.stats()["side"].get(path, 0)) for s in servers)


def test_embeddings_through_the_official_client(
    processes: Processes, pooling: list[StockServer]
) -> None:
    url = _gateway(processes, pooling)
    rows = get_instances(url)
    assert {tuple(r["endpoints"]) for r in rows} == {SIDE_ENDPOINTS}  # tokens, then pooling
    client = openai_client(url)
    texts = ["first text", "second, longer text"]
    out = client.embeddings.create(model=EMBED, input=texts)  # base64 on the wire, as it asks
    assert [d.index for d in out.data] == [0, 1]
    for item, text in zip(out.data, texts, strict=True):
        assert item.embedding == pytest.approx(embedding(text), abs=1e-6)
    assert out.usage.prompt_tokens == sum(len(byte_tokens(t, bos=True)) for t in texts)
    floats = client.embeddings.create(model=EMBED, input="plain", encoding_format="float")
    assert floats.data[0].embedding == embedding("plain")
    assert _served(pooling, "/v1/embeddings") == 2  # one request each, not one per text
    wait_for(lambda: nothing_held(url), what="nothing held")


def _post(url: str, path: str, body: Any) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=30, headers={"x-request-id": "side-req-1"})


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/pooling", {"input": ["pool me"]}),
        ("/score", {"text_1": "query", "text_2": ["a", "b"]}),
        ("/v1/score", {"text_1": "query", "text_2": "a"}),
        ("/rerank", {"query": "query", "documents": ["a", "b", "c"]}),
        ("/v1/rerank", {"query": "query", "documents": ["a", "b"]}),
        ("/v2/rerank", {"query": "query", "documents": ["a"]}),
        ("/tokenize", {"prompt": "count these bytes"}),
        ("/detokenize", {"tokens": [1, 107, 108]}),
    ],
)
def test_each_side_path_is_relayed_as_the_instance_answers(
    processes: Processes, pooling: list[StockServer], path: str, body: dict[str, Any]
) -> None:
    url = _gateway(processes, pooling[:1])
    (server,) = pooling[:1]
    via = _post(url, path, {"model": EMBED, **body})
    assert via.status_code == 200, via.text
    assert via.headers["x-request-id"] == "side-req-1"
    own = _post(server.url, path, {"model": EMBED, **body})
    strip = ("id", "created")
    assert {k: v for k, v in via.json().items() if k not in strip} == {
        k: v for k, v in own.json().items() if k not in strip
    }
    assert _served(pooling, path) == 2  # one through the gateway, one directly
    wait_for(lambda: nothing_held(url), what="nothing held")


def test_a_failing_instance_is_left_for_another_and_the_engines_400_is_relayed(
    processes: Processes, pooling: list[StockServer]
) -> None:
    url = _gateway(processes, pooling)
    broken, healthy = pooling
    broken.fail("/v1/embeddings", 500, times=100)
    for i in range(4):
        resp = _post(url, "/v1/embeddings", {"model": EMBED, "input": f"text {i}"})
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-pdgate-instance"].endswith(f":{healthy.port}")
    assert int(healthy.stats()["side"]["/v1/embeddings"]) == 4
    # Bad input is the client's: the engine's 400 comes back as it gave it, once (no retry).
    # Both instances answer now, so a second try anywhere would be counted.
    broken.fail("/v1/embeddings", 500, times=0)
    before = _served(pooling, "/v1/embeddings")
    resp = _post(url, "/v1/embeddings", {"model": EMBED, "input": "x" * 9000})
    assert resp.status_code == 400
    assert "maximum context length is 8192 tokens" in resp.json()["error"]["message"]
    assert _served(pooling, "/v1/embeddings") == before + 1
    wait_for(lambda: nothing_held(url), what="nothing held")


def test_no_instance_answering_in_time_is_a_503_or_a_502_never_a_hang(
    processes: Processes, pooling: list[StockServer]
) -> None:
    url = _gateway(processes, pooling, "--ttft-timeout-s", "1")
    for server in pooling:
        server.fail("/v1/score", 503, times=1000)
    resp = _post(url, "/v1/score", {"model": EMBED, "text_1": "q", "text_2": "d"})
    assert resp.status_code in (502, 503), resp.text
    if resp.status_code == 503:
        assert 1 <= int(resp.headers["retry-after"]) <= 120
    assert resp.json()["error"]["type"] in ("upstream_error", "service_unavailable")
    wait_for(lambda: nothing_held(url), what="nothing held")


def test_side_endpoints_need_the_client_key(
    processes: Processes, pooling: list[StockServer], tmp_path: Any
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-side name=team\n")
    env = {**FAST_PROBES, "PDGATE_GATEWAY_API_KEYS_FILE": str(keys)}
    url = processes.gateway("--aggregated", pooling[0].url, env=env)
    body = {"model": EMBED, "input": "hello"}
    keyed = {"authorization": "Bearer sk-side"}
    wait_for(
        lambda: httpx.post(url + "/tokenize", json=body, headers=keyed).status_code != 503,
        what="the instance listed",
    )
    assert httpx.post(url + "/v1/embeddings", json=body, timeout=30).status_code == 401
    assert httpx.post(url + "/tokenize", json={"prompt": "x"}, timeout=30).status_code == 401
    resp = httpx.post(url + "/v1/embeddings", json=body, headers=keyed, timeout=30)
    assert resp.status_code == 200, resp.text
