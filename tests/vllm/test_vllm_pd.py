"""Gateway + vLLM prefill shim + vLLM decode shim on a tiny random Llama, on the CPU.

* A greedy streamed completion through the gateway equals, token for token, the same model's
  greedy output from one aggregated vLLM engine, and the decode really used the transferred
  KV (its prefix hits count the loaded prompt tokens) instead of recomputing the prompt; with
  ``logprobs``, every token's log-probability equals the aggregated engine's.
* A request that finds the prefill's only slot taken gets 429 there and the gateway retries
  it until the slot frees.
* A client that disconnects aborts the vLLM request: on the decode while streaming, on the
  prefill while its long prompt is still being computed.
* A chat through the gateway (the model's chat template on both legs) equals the aggregated
  engine's ``LLM.chat``, prompt token ids and greedy output alike.
* A greedy run re-submitted as prompt ids + its first k generated ids (what a mid-stream
  decode migration sends) continues with exactly the uninterrupted run's tokens.
* A decode with another block size than the prefill's gives one engine's greedy tokens from
  the prefill's KV (the connector's layout-neutral token rows).
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests._cluster import get_instances, hold_prefill_slot, metric_by_label, shim_load, wait_for
from tests.vllm.conftest import (
    CHATS,
    MODEL,
    PROMPTS,
    REFERENCE_TOKENS,
    START_TIMEOUT_S,
    Proc,
    VllmCluster,
    _url,
    assert_messages_text,
    greedy_messages_body,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def _events(url: str, body: dict[str, Any], timeout: float = 60) -> list[dict[str, Any]]:
    """The events of `body` streamed through the gateway at `url` (which must answer 200,
    send no in-band error and end with ``[DONE]``)."""
    with httpx.stream(
        "POST", url + "/v1/completions", json={**body, "stream": True}, timeout=timeout
    ) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [line for line in resp.iter_lines() if line and not line.startswith(":")]
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]", lines[-1]
    events = [orjson.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    for event in events:
        assert "error" not in event, event
    return events


def _stream(gateway_url: str, body: dict[str, Any]) -> tuple[list[str], dict[str, Any] | None]:
    """Text of every streamed chunk, and the usage chunk."""
    events = _events(gateway_url, body)
    texts = [e["choices"][0]["text"] for e in events if e["choices"]]
    usages = [e["usage"] for e in events if e.get("usage")]
    return texts, usages[-1] if usages else None


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


def test_logprobs_through_prefill_and_decode_match_one_engine(vllm_cluster: VllmCluster) -> None:
    prompt = PROMPTS[0]
    ref = vllm_cluster.reference[prompt]
    tokens: list[str] = []
    logprobs: list[float] = []
    tops: list[dict[str, float]] = []
    texts: list[str] = []
    for event in _events(vllm_cluster.gateway_url, {**_greedy(prompt), "logprobs": 2}):
        for choice in event["choices"]:
            texts.append(choice["text"])
            tokens += choice["logprobs"]["tokens"]
            logprobs += choice["logprobs"]["token_logprobs"]
            tops += choice["logprobs"]["top_logprobs"]
    assert "".join(texts) == ref["text"]  # greedy output unchanged by asking for logprobs
    assert tokens == [t["token"] for t in ref["logprobs"]]
    # The same model on the same KV: the same log-probabilities, to float32 rounding.
    assert logprobs == pytest.approx([t["logprob"] for t in ref["logprobs"]], abs=1e-3)
    for token, logprob, top in zip(tokens, logprobs, tops, strict=True):
        assert 2 <= len(top) <= 3  # the top 2, plus the sampled token when not among them
        assert list(top.values()) == sorted(top.values(), reverse=True)
        assert top[token] == logprob
        assert max(top.values()) == logprob  # greedy: the sampled token is the most likely

    # The prefill leg returns its one token's logprobs too.
    resp = httpx.post(
        vllm_cluster.prefill_url + "/v1/completions",
        json={
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0,
            "logprobs": 2,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
        },
        timeout=30,
    )
    assert resp.status_code == 200, resp.text
    first = resp.json()["choices"][0]["logprobs"]
    assert first["tokens"] == tokens[:1]
    assert first["token_logprobs"] == pytest.approx(logprobs[:1], abs=1e-3)
    rid = resp.json()["kv_transfer_params"]["remote_request_id"]
    assert httpx.delete(f"{vllm_cluster.prefill_url}/v1/kv/{rid}", timeout=10).status_code == 204


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


def test_a_forced_tool_choice_is_refused_saying_why(vllm_cluster: VllmCluster) -> None:
    """pdgate's vLLM shim has no tool-call parser: a forced call is a 400 on both roles,
    through the gateway too, and the message points at stock `vllm serve`."""
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    body = {"model": MODEL, "messages": CHATS[0], "max_tokens": 4, "tools": tools}
    kv = {"do_remote_decode": True, "do_remote_prefill": False}
    for url in (vllm_cluster.prefill_url, vllm_cluster.decode_url, vllm_cluster.gateway_url):
        resp = httpx.post(
            url + "/v1/chat/completions",
            json={**body, "tool_choice": "required", "kv_transfer_params": kv}
            if url != vllm_cluster.gateway_url
            else {**body, "tool_choice": "required"},
            timeout=30,
        )
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == "tool_choice"
        assert "tool-call parser" in err["message"] and "vllm serve" in err["message"]
    # "auto": the tools reach the model's template and its text comes back as content.
    resp = httpx.post(vllm_cluster.gateway_url + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"]
    assert shim_load(vllm_cluster.prefill_url)["used"] == 0


def test_the_gateway_serves_again_after_a_client_left_mid_prefill(
    vllm_cluster: VllmCluster,
) -> None:
    """Runs after `test_client_disconnect_aborts_the_prefill`: the prefill's only slot, freed
    at the shim, must be usable through the gateway again (its count and lease released)."""
    resp = httpx.post(
        vllm_cluster.gateway_url + "/v1/completions",
        json={"model": MODEL, "prompt": "Hello again", "max_tokens": 3},
        timeout=30,
    )
    assert resp.status_code == 200, resp.text


def test_chat_through_pd_equals_the_aggregated_chat(vllm_cluster: VllmCluster) -> None:
    import openai

    ref = vllm_cluster.chat_reference[0]
    client = openai.OpenAI(base_url=vllm_cluster.gateway_url + "/v1", api_key="unused",
                           max_retries=0, timeout=60)  # fmt: skip
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CHATS[0],  # type: ignore[arg-type]
            max_tokens=REFERENCE_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref["text"]
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == len(ref["prompt_token_ids"])
    assert chunks[-1].usage.completion_tokens == len(ref["token_ids"])
    # Non-streaming, with the token ids: the same rendered prompt, the same tokens.
    whole = httpx.post(
        vllm_cluster.gateway_url + "/v1/chat/completions",
        json={"model": MODEL, "messages": CHATS[0], "max_tokens": REFERENCE_TOKENS,
              "temperature": 0, "return_token_ids": True},
        timeout=60,
    ).json()  # fmt: skip
    assert whole["prompt_token_ids"] == ref["prompt_token_ids"]
    assert whole["choices"][0]["token_ids"] == ref["token_ids"]
    assert whole["choices"][0]["message"]["content"] == ref["text"]
    wait_for(lambda: shim_load(vllm_cluster.prefill_url)["used"] == 0, what="prefill slot free")


def _token_ids(gateway_url: str, prompt: str | list[int], max_tokens: int) -> dict[str, Any]:
    """A greedy streamed completion with ``return_token_ids``: prompt ids and generated ids."""
    prompt_ids: list[int] | None = None
    ids: list[int] = []
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "return_token_ids": True}  # fmt: skip
    for event in _events(gateway_url, body):
        for choice in event["choices"]:
            prompt_ids = prompt_ids or choice.get("prompt_token_ids")
            ids += choice["token_ids"]
    assert prompt_ids is not None
    return {"prompt_token_ids": prompt_ids, "token_ids": ids}


def test_greedy_continues_exactly_from_prompt_and_generated_ids(
    vllm_cluster: VllmCluster,
) -> None:
    prompt = PROMPTS[0]
    ref = vllm_cluster.reference[prompt]
    run = _token_ids(vllm_cluster.gateway_url, prompt, REFERENCE_TOKENS)
    assert run["token_ids"] == ref["token_ids"]
    assert run["prompt_token_ids"] == ref["prompt_token_ids"]
    for k in (1, REFERENCE_TOKENS // 2, REFERENCE_TOKENS - 2):
        # What the gateway sends when a decode died after streaming k tokens.
        resumed = _token_ids(
            vllm_cluster.gateway_url, run["prompt_token_ids"] + run["token_ids"][:k],
            REFERENCE_TOKENS - k,
        )  # fmt: skip
        assert resumed["token_ids"] == ref["token_ids"][k:], k


# -- continuing a stream: first token early, migration ---------------------------------------


def _stream_ids(url: str, body: dict[str, Any]) -> tuple[str, list[int]]:
    """Text and token ids of a streamed completion (the body asks for ``return_token_ids``)."""
    texts: list[str] = []
    ids: list[int] = []
    for event in _events(url, body, timeout=120):
        for choice in event["choices"]:
            texts.append(choice["text"])
            ids += choice.get("token_ids", [])
    return "".join(texts), ids


def _prefill_leg(prefill_url: str, prompt: str) -> dict[str, Any]:
    """The greedy prefill leg's answer, sent to the prefill shim directly: its first token,
    the prompt's ids and the ``kv_transfer_params`` a decode leg takes."""
    resp = httpx.post(
        prefill_url + "/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0,
              "return_token_ids": True,
              "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}},
        timeout=120,
    )  # fmt: skip
    assert resp.status_code == 200, resp.text
    answer: dict[str, Any] = resp.json()
    return answer


@pytest.mark.parametrize("ahead", [1, 3])
def test_a_decode_continues_from_a_prompt_longer_than_its_kv(
    vllm_cluster: VllmCluster, ahead: int
) -> None:
    """The decode leg of the first token early (``ahead`` = 1) and of any continuation: the
    KV of the prompt, and the prompt + tokens already generated as the decode's prompt. The
    decode loads the KV it was given and computes the rest (EXT_CONTINUATION)."""
    prompt = PROMPTS[1]
    ref = vllm_cluster.reference[prompt]
    first = _prefill_leg(vllm_cluster.prefill_url, prompt)
    prompt_ids = first["choices"][0]["prompt_token_ids"]
    assert first["choices"][0]["token_ids"] == ref["token_ids"][:1]
    decode0 = shim_load(vllm_cluster.decode_url)
    _, ids = _stream_ids(
        vllm_cluster.decode_url,
        {"model": MODEL, "prompt": prompt_ids + ref["token_ids"][:ahead],
         "max_tokens": REFERENCE_TOKENS - ahead, "temperature": 0, "stream": True,
         "return_token_ids": True, "kv_transfer_params": first["kv_transfer_params"]},
    )  # fmt: skip
    assert ids == ref["token_ids"][ahead:]
    decode = shim_load(vllm_cluster.decode_url)
    # The prompt's KV came from the prefill (or the decode's own prefix cache), not recomputed.
    hits = decode["prefix_cache_hit_tokens"] - decode0["prefix_cache_hit_tokens"]
    assert hits >= len(prompt_ids), (hits, len(prompt_ids))
    wait_for(lambda: shim_load(vllm_cluster.prefill_url)["kv_held"] == 0, what="KV taken")


def test_first_token_early_gives_the_same_greedy_tokens(vllm_cluster: VllmCluster) -> None:
    gateway = Proc(
        ["-m", "pdgate.config.cli", "gateway", "--port", "0"],
        {**vllm_cluster.registry, "PDGATE_GATEWAY_FIRST_TOKEN_EARLY": "true",
         "PDGATE_GATEWAY_TTFT_TIMEOUT_S": "30"},
        "gateway-first-token-early",
    )  # fmt: skip
    try:
        url = _url(gateway.wait_line("pdgate gateway", 60))
        wait_for(lambda: len(get_instances(url)) == 2, timeout=15, what="shims seen")
        for prompt in PROMPTS:
            ref = vllm_cluster.reference[prompt]
            decode0 = shim_load(vllm_cluster.decode_url)
            body = {"model": MODEL, "prompt": prompt, "max_tokens": REFERENCE_TOKENS,
                    "temperature": 0, "stream": True, "return_token_ids": True}  # fmt: skip
            text, ids = _stream_ids(url, body)
            assert ids == ref["token_ids"] and text == ref["text"]
            decode = shim_load(vllm_cluster.decode_url)
            assert decode["completed"] == decode0["completed"] + 1
            # The decode was sent prompt + the first token: it had the whole prompt's KV and
            # computed that token (the usual leg computes the prompt's last token: n - 1 hits).
            hits = decode["prefix_cache_hit_tokens"] - decode0["prefix_cache_hit_tokens"]
            assert hits >= len(ref["prompt_token_ids"]), (hits, len(ref["prompt_token_ids"]))
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert 'pdgate_requests_total{group="*",outcome="ok"} 2.0' in metrics
    finally:
        gateway.stop()


class _CutProxy:
    """A TCP proxy to `target` that cuts the first connection over which `events` SSE data
    events came back, as a decode that dies mid-stream would; every other byte passes."""

    def __init__(self, target: str, events: int) -> None:
        url = httpx.URL(target)
        assert url.host is not None and url.port is not None
        self._target = (url.host, url.port)
        self._events = events
        self.cut = threading.Event()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self._target)
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, answers: bool) -> None:
        seen = 0
        try:
            while data := src.recv(65536):
                dst.sendall(data)
                seen += data.count(b"data: ") if answers else 0
                if answers and seen >= self._events and not self.cut.is_set():
                    self.cut.set()
                    break
        except OSError:
            pass
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self._server.close()


def test_a_stream_migrated_mid_way_gives_the_same_greedy_tokens(
    vllm_cluster: VllmCluster,
) -> None:
    """A decode whose stream breaks after 8 events (a proxy cuts it): the gateway continues
    on a new prefill + decode from prompt ids + the 8 ids sent, and the client's tokens equal
    the uninterrupted greedy run's. Static instances: the stock-server path (vLLM's handshake
    plus ``return_token_ids``)."""
    proxy = _CutProxy(vllm_cluster.decode_url, events=8)
    gateway = Proc(
        ["-m", "pdgate.config.cli", "gateway", "--port", "0",
         "--prefill", f"{vllm_cluster.prefill_url} capacity=1 model={MODEL}",
         "--decode", f"{proxy.url} model={MODEL}"],
        {"PDGATE_GATEWAY_TTFT_TIMEOUT_S": "30", "PDGATE_REGISTRY_URL": ""},
        "gateway-static",
    )  # fmt: skip
    try:
        url = _url(gateway.wait_line("pdgate gateway", 60))
        wait_for(lambda: len(get_instances(url)) == 2, timeout=30, what="static instances up")
        prompt = PROMPTS[0]
        ref = vllm_cluster.reference[prompt]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": REFERENCE_TOKENS,
                "temperature": 0, "stream": True, "return_token_ids": True}  # fmt: skip
        text, ids = _stream_ids(url, body)
        assert proxy.cut.is_set()
        assert ids == ref["token_ids"] and text == ref["text"]
        metrics = httpx.get(url + "/metrics", timeout=10).text
        migrated = sum(
            float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith("pdgate_migrations_total{")
        )
        assert migrated == 1
    finally:
        gateway.stop()
        proxy.close()
    wait_for(lambda: shim_load(vllm_cluster.decode_url)["used"] == 0, what="decode slots free")
    wait_for(lambda: shim_load(vllm_cluster.prefill_url)["used"] == 0, what="prefill slot free")


# -- decodes of another block size and dtype (last: they register more instances) ----------
#
# The cluster's prefill keeps the CPU's default 128-token blocks in float32; the decodes here
# have 32-token blocks (the CPU attention kernel takes multiples of 32 only, so a GPU engine's
# 16 cannot be tried on this machine), one of them in float16. They hand over through the
# connector's token rows, cast to the decode's dtype.

# About 300 tokens of the tiny model's tokenizer: three of the prefill's blocks, ten of the
# decodes', and a last block partly filled on both sides.
PROMPT = " ".join(
    f"Step {i}: the prefill writes token rows and the decode scatters them." for i in range(24)
)
TOKENS = 16


@pytest.fixture(scope="module", params=["float32", "float16"])
def other_layout_decode(vllm_cluster: VllmCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A decode shim like the cluster's, with 32-token blocks and the dtype of the parameter,
    in the cluster's registry (it pulls only from prefills registered there) under a model
    name of its own (its ``/load`` says which), so that the cluster's gateway never sends it
    anything: the test calls it directly."""
    dtype = str(request.param)
    env = {
        **vllm_cluster.procs["decode"].env,
        "PDGATE_SHIM_MODEL": f"{MODEL}-b32-{dtype}",
        "PDGATE_SHIM_VLLM_DTYPE": dtype,
        "PDGATE_SHIM_VLLM_ENGINE_ARGS": json.dumps({"block_size": 32}),
    }
    proc = Proc(
        ["-m", "pdgate.config.cli", "shim", "--role", "decode", "--capacity", "2"],
        env,
        f"decode-b32-{dtype}",
    )
    try:
        yield _url(proc.wait_line("pdgate shim", START_TIMEOUT_S))
    finally:
        proc.stop()


def test_a_decode_of_other_block_size_and_dtype_gives_one_engines_greedy_tokens(
    vllm_cluster: VllmCluster, other_layout_decode: str
) -> None:
    greedy = {"model": MODEL, "temperature": 0, "return_token_ids": True, "stream": True}
    # One engine alone: the cluster's decode prefilling the plain request itself.
    _, alone = _stream_ids(
        vllm_cluster.decode_url, {**greedy, "prompt": PROMPT, "max_tokens": TOKENS}
    )
    assert len(alone) == TOKENS

    first = _prefill_leg(vllm_cluster.prefill_url, PROMPT)
    prompt_ids = first["choices"][0]["prompt_token_ids"]
    assert len(prompt_ids) > 2 * 128, len(prompt_ids)  # several blocks on either side
    assert first["choices"][0]["token_ids"] == alone[:1]

    decode0 = shim_load(other_layout_decode)
    _, ids = _stream_ids(
        other_layout_decode,
        {**greedy, "model": decode0["model"], "prompt": PROMPT, "max_tokens": TOKENS,
         "kv_transfer_params": first["kv_transfer_params"]},
    )  # fmt: skip
    assert ids == alone
    decode = shim_load(other_layout_decode)
    loaded = decode["prefix_cache_hit_tokens"] - decode0["prefix_cache_hit_tokens"]
    assert loaded >= len(prompt_ids) - 1, (loaded, len(prompt_ids))
    assert decode["local_prefills"] == decode0["local_prefills"]
    wait_for(lambda: shim_load(vllm_cluster.prefill_url)["kv_held"] == 0, what="KV taken")


def test_the_gateway_predicts_what_the_prefill_finds_in_its_cache(
    vllm_cluster: VllmCluster,
) -> None:
    """The gateway's precise_sse index follows the vLLM prefill's own KV events: for prompts
    sharing a long prefix, the cached tokens it predicts when it sends each one equal what
    the engine then reports (``usage.prompt_tokens_details.cached_tokens``)."""
    url = vllm_cluster.gateway_url
    wait_for(
        lambda: _value(url, "pdgate_kv_event_subscriptions") == 1,
        timeout=15,
        what="the gateway follows the prefill's KV events",
    )
    time.sleep(0.5)  # the ZeroMQ subscription connects
    before = metric_by_label(url, "pdgate_prefix_predictions_total", "outcome")
    reported = metric_by_label(url, "pdgate_prefix_cached_tokens_total", "source").get(
        "reported", 0
    )
    prefix = "Shared context. " + " ".join([PROMPTS[1]] * 8)
    for i in range(6):
        resp = httpx.post(
            url + "/v1/completions",
            json={"model": MODEL, "prompt": f"{prefix} Question {i}?", "max_tokens": 2},
            timeout=120,
        )
        assert resp.status_code == 200, resp.text
        time.sleep(0.3)  # the step's events reach the gateway before the next request
    after = metric_by_label(url, "pdgate_prefix_predictions_total", "outcome")
    counts = {k: v - before.get(k, 0.0) for k, v in after.items()}
    assert counts.get("exact", 0.0) == 6, counts
    tokens = metric_by_label(url, "pdgate_prefix_cached_tokens_total", "source")
    assert tokens["reported"] - reported >= 5 * 128  # the later five found the prefix's blocks


def _value(url: str, name: str) -> float | None:
    text = httpx.get(url + "/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def test_responses_and_messages_through_pd_equal_the_aggregated_chat(
    vllm_cluster: VllmCluster,
) -> None:
    """The Responses API and Anthropic Messages, translated at the gateway, over pdgate's
    vLLM shims: the greedy text of one engine's ``LLM.chat`` for the same conversation."""
    import openai

    ref = vllm_cluster.chat_reference[0]
    system, user = CHATS[0][0]["content"], CHATS[0][1]["content"]
    client = openai.OpenAI(base_url=vllm_cluster.gateway_url + "/v1", api_key="x", max_retries=0)
    request = {
        "model": MODEL,
        "instructions": system,
        "input": [{"role": "user", "content": user}],
        "max_output_tokens": REFERENCE_TOKENS,
        "temperature": 0,
    }
    response = client.responses.create(**request)  # type: ignore[call-overload]
    assert response.output_text == ref["text"]
    assert response.usage is not None
    assert response.usage.input_tokens == len(ref["prompt_token_ids"])
    with client.responses.stream(**request) as stream:  # type: ignore[call-overload]
        assert (
            "".join(e.delta for e in stream if e.type == "response.output_text.delta")
            == (ref["text"])
        )
    body = greedy_messages_body(system, user, REFERENCE_TOKENS)
    assert_messages_text(vllm_cluster.gateway_url, body, ref["text"])
    wait_for(lambda: shim_load(vllm_cluster.prefill_url)["used"] == 0, what="prefill slot free")
