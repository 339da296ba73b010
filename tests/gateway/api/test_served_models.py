"""The engines are the truth about models, through a real gateway and real sim shims with the
official openai client: ``/v1/models`` with ``max_model_len`` and LoRA adapters, a request
for an adapter only where it is held (both legs), ``/tokenize`` and ``/detokenize`` as the
engine answers them, and the context-length 400 before any queue (never early drop's 503)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests._cluster import (
    SIM_MODEL,
    Processes,
    ThreadedCluster,
    counts_released,
    get_instances,
    nothing_held,
    openai_client,
    shim_load,
    wait_for,
    wait_instances,
)

ADAPTER = "sim-lora-sql"
PROMPT = "Write a query that lists every table."


@pytest.fixture(scope="module")
def cluster() -> Iterator[ThreadedCluster]:
    shim = {"max_model_len": 2048, "sim_lora_adapters": [ADAPTER]}
    with ThreadedCluster(prefills=1, decodes=1, shim=shim) as c:
        yield c


def test_models_lists_max_model_len_and_the_adapter_with_its_parent(
    client: openai.OpenAI,
) -> None:
    models = {m.id: m for m in client.models.list()}
    assert set(models) == {SIM_MODEL, ADAPTER}
    base, adapter = models[SIM_MODEL], models[ADAPTER]
    assert base.model_extra is not None and adapter.model_extra is not None
    assert (base.model_extra["max_model_len"], base.model_extra["parent"]) == (2048, None)
    assert adapter.model_extra["parent"] == SIM_MODEL
    assert base.object == "model" and base.owned_by


def test_an_adapter_answers_in_its_own_words_through_both_legs(client: openai.OpenAI) -> None:
    base = client.completions.create(model=SIM_MODEL, prompt=PROMPT, max_tokens=8)
    lora = client.completions.create(model=ADAPTER, prompt=PROMPT, max_tokens=8)
    assert lora.model == ADAPTER
    assert lora.choices[0].text != base.choices[0].text
    streamed = client.completions.create(model=ADAPTER, prompt=PROMPT, max_tokens=8, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == lora.choices[0].text
    # A request naming no model is for the model, as vLLM takes it, not for its adapter.
    unnamed = httpx.post(
        str(client.base_url) + "completions", json={"prompt": PROMPT, "max_tokens": 8}, timeout=30
    )
    assert unnamed.status_code == 200, unnamed.text
    assert unnamed.json()["choices"][0]["text"] == base.choices[0].text


def _post(url: str, path: str, body: Any) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(url + path, content=body, timeout=30)
    return httpx.post(url + path, json=body, timeout=30)


def test_tokenize_and_detokenize_are_the_engines_own_answers(cluster: ThreadedCluster) -> None:
    url = cluster.url
    shim_url = get_instances(url)[0]["url"]
    messages = [{"role": "user", "content": "Count me."}]
    for body in (
        {"model": SIM_MODEL, "prompt": PROMPT, "return_token_strs": True},
        {"model": ADAPTER, "messages": messages},
        {"prompt": PROMPT},  # the one model served: the gateway fills it in
    ):
        via_gateway = _post(url, "/tokenize", body)
        assert via_gateway.status_code == 200, via_gateway.text
        own = _post(shim_url, "/tokenize", {"model": SIM_MODEL, **body})
        assert via_gateway.json() == own.json()
        assert via_gateway.json()["max_model_len"] == 2048
        assert via_gateway.headers["x-pdgate-instance"]
    tokens = _post(url, "/tokenize", {"prompt": " the model"}).json()["tokens"]
    back = _post(url, "/detokenize", {"model": SIM_MODEL, "tokens": tokens})
    assert (back.status_code, back.json()) == (200, {"prompt": " the model"})
    # The engine's 400 is relayed as it gave it.
    bad = _post(url, "/detokenize", {"model": SIM_MODEL, "tokens": [-1]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert bad.headers["x-request-id"]
    wait_for(lambda: nothing_held(url), what="nothing held")


def test_side_requests_the_model_has_no_endpoint_for_get_a_404_naming_it(
    client: openai.OpenAI, cluster: ThreadedCluster
) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        client.embeddings.create(model=SIM_MODEL, input="embed me")
    err = exc.value.body
    assert isinstance(err, dict)
    assert err["code"] == "endpoint_not_served" and SIM_MODEL in err["message"]
    for path in ("/v1/rerank", "/v1/score", "/pooling"):
        resp = _post(cluster.url, path, {"model": SIM_MODEL, "query": "q", "documents": ["d"]})
        assert resp.status_code == 404 and SIM_MODEL in resp.json()["error"]["message"]
    unknown = _post(cluster.url, "/tokenize", {"model": "nobody", "prompt": "x"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    for body in (b"not json", b"[1]", b""):
        resp = _post(cluster.url, "/tokenize", body)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["type"] == "invalid_request_error"
    wait_for(lambda: nothing_held(cluster.url), what="nothing held")


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_a_prompt_over_the_context_is_a_400_naming_both_numbers_not_a_503(
    cluster: ThreadedCluster, api: str
) -> None:
    """Early drop is on and the TTFT deadline is 1 ms, which nothing can meet: a request that
    got as far as the queue would be shed with a retryable 503. A request that cannot fit
    never gets there."""
    text = " word" * 3000  # 3000 sim tokens, far over 2048
    if api == "chat":
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}
        where = "in the messages"
    else:
        path, body = "/v1/completions", {"prompt": text}
        where = "in the prompt"
    for stream in (False, True):
        resp = httpx.post(
            cluster.url + path,
            json={"model": SIM_MODEL, **body, "max_tokens": 20, "stream": stream},
            headers={"x-pdgate-ttft-timeout-ms": "1"},
            timeout=30,
        )
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["code"] == "context_length_exceeded"
        assert "maximum context length is 2048 tokens" in err["message"]
        assert where in err["message"] and "20 in the completion" in err["message"]
    # A prompt that fits with a completion it could not hold: max_tokens is what to reduce.
    resp = httpx.post(
        cluster.url + "/v1/completions",
        json={"model": ADAPTER, "prompt": " word" * 2000, "max_tokens": 100},
        timeout=30,
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"
    assert "2100 tokens (2000 in the prompt, 100 in the completion)" in resp.text
    wait_for(lambda: nothing_held(cluster.url), what="nothing held")


def test_a_request_for_an_adapter_reaches_only_the_instances_that_hold_it(
    processes: Processes,
) -> None:
    """Two prefills and two decodes, one of each holding the adapter: every request for the
    adapter goes to those two, on both legs; the model's requests to all four."""
    lora = {"PDGATE_SHIM_SIM_LORA_ADAPTERS": f'["{ADAPTER}"]'}
    holders = [
        processes.shim("prefill", "--instance-id", "p-lora", env=lora),
        processes.shim("decode", "--instance-id", "d-lora", env=lora),
    ]
    others = [
        processes.shim("prefill", "--instance-id", "p-base"),
        processes.shim("decode", "--instance-id", "d-base"),
    ]
    url = processes.gateway()
    wait_instances(url, 4)
    urls = {row["id"]: row["url"] for row in get_instances(url)}
    client = openai_client(url)
    assert {m.id for m in client.models.list()} == {SIM_MODEL, ADAPTER}
    for i in range(6):
        out = client.completions.create(model=ADAPTER, prompt=f"{PROMPT} {i}", max_tokens=4)
        assert out.model == ADAPTER
        chat = client.chat.completions.create(
            model=ADAPTER, messages=[{"role": "user", "content": f"hi {i}"}], max_tokens=4
        )
        assert chat.choices[0].message.content
    admitted = {name: shim_load(urls[name])["admitted"] for name in urls}
    assert admitted["p-lora"] == admitted["d-lora"] == 12, admitted
    assert admitted["p-base"] == admitted["d-base"] == 0, admitted
    assert len(holders) == len(others) == 2
    wait_for(lambda: counts_released(url), what="every count back to zero")
