"""``/v1/chat/completions`` through P/D with the official openai client, over real sockets:
the gateway, two sim prefills and two sim decodes (the embedded cluster).

Both legs go to the shims' chat endpoint (the prefill with ``max_tokens = 1``, the decode with
its ``kv_transfer_params``), the decode's ``chat.completion.chunk`` stream is relayed, and a
non-streaming answer is assembled from it. A multi-turn conversation returns to the prefill
that holds its cache (prefix affinity over the rendered conversation).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from pdgate.config import sim_tokenizer as tokenizer
from pdgate.engine_shim.backend import ChatPrompt
from pdgate.engine_shim.sim_engine import render_chat_text
from tests._cluster import ThreadedCluster, shim_load

MODEL = "sim-llama-3.1-8b"
MESSAGES: list[Any] = [
    {"role": "system", "content": "You are a terse assistant for an inference platform."},
    {"role": "user", "content": "Explain disaggregated serving in one sentence."},
]


@pytest.fixture(scope="module")
def cluster() -> Iterator[ThreadedCluster]:
    with ThreadedCluster(prefills=2, decodes=2, gateway={"prefill_policy": "affinity_sse"}) as c:
        yield c


def _idle(cluster: ThreadedCluster) -> None:
    cluster.wait_for(
        lambda: all(r["open_streams"] == 0 and r["inflight"] == 0 for r in cluster.instances()),
        what="every count released",
    )


def test_non_stream_chat_with_usage(client: openai.OpenAI, cluster: ThreadedCluster) -> None:
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12)
    assert out.object == "chat.completion"
    assert out.id.startswith("chatcmpl-")
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason == "length"
    assert out.usage is not None
    assert out.usage.completion_tokens == 12
    # The prompt is the conversation in the sim's chat template, tokenized.
    rendered = render_chat_text(ChatPrompt(MESSAGES))
    assert out.usage.prompt_tokens == tokenizer.count(rendered)
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    _idle(cluster)


def test_stream_matches_non_stream_and_reports_usage(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=10)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_completion_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    token_chunks = [c for c in chunks[1:] if c.choices]
    assert len(token_chunks) == 10  # one event per token: streamed, not one blob
    assert token_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    assert len({c.id for c in chunks}) == 1


def test_chat_equals_a_completion_of_the_rendered_conversation(client: openai.OpenAI) -> None:
    # Same engine, same tokens: the chat template is the only difference between the APIs.
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8)
    rendered = render_chat_text(ChatPrompt(MESSAGES))
    completion = client.completions.create(model=MODEL, prompt=rendered, max_tokens=8)
    assert chat.choices[0].message.content == completion.choices[0].text


def test_stop_sequence_truncates_and_reports_stop(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20)
    text = full.choices[0].message.content or ""
    words = text.split()
    stop = words[len(words) // 2]
    cut = text.index(stop)
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content == text[:cut]
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=20, stop=stop, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs_in_chat_shape(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=3
    )
    assert out.choices[0].logprobs is not None
    content = out.choices[0].logprobs.content
    assert content is not None and len(content) == 5
    assert "".join(e.token for e in content) == out.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the most likely one
        assert entry.bytes == list(entry.token.encode())


def _conversation(index: int) -> list[dict[str, str]]:
    return [
        {
            "role": "system",
            "content": f"You are assistant number {index} of a support team; "
            "answer in the voice of a ship's captain.",
        },
        {"role": "user", "content": f"Question {index}: what is a prefill?"},
    ]


def test_multi_turn_chats_return_to_the_prefill_holding_their_cache(
    client: openai.OpenAI, cluster: ThreadedCluster
) -> None:
    first: dict[int, str] = {}
    histories: dict[int, list[dict[str, str]]] = {}

    def first_turn(i: int) -> None:
        messages = _conversation(i)
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=8
        )
        first[i] = raw.headers["x-pdgate-prefill"]
        reply = raw.parse().choices[0].message.content or ""
        histories[i] = [
            *messages,
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "And a decode, in the same voice?"},
        ]

    # New conversations at once spread over both prefills by their open streams: affinity,
    # not a single favourite. (One after another, every prefill is idle at each choice and
    # the tie goes to the same one by design.)
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(first_turn, range(8)))
    assert len(set(first.values())) == 2, first
    hits_before = {
        r["id"]: shim_load(r["url"])["prefix_cache_hit_tokens"]
        for r in cluster.instances()
        if r["role"] == "prefill"
    }
    for i, messages in histories.items():
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=4
        )
        assert raw.headers["x-pdgate-prefill"] == first[i], i
    # ...and found their earlier turns in that prefill's cache.
    for row in cluster.instances():
        if row["role"] == "prefill":
            assert shim_load(row["url"])["prefix_cache_hit_tokens"] > hits_before[row["id"]]


def test_token_ids_through_the_gateway(cluster: ThreadedCluster) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "return_token_ids": True}
    whole = httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=30).json()
    ids = whole["choices"][0]["token_ids"]
    assert len(ids) == 6
    rendered = render_chat_text(ChatPrompt(MESSAGES))
    assert whole["prompt_token_ids"] == tokenizer.encode(rendered)
    streamed: list[int] = []
    prompt_ids = None
    with httpx.stream(
        "POST", cluster.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=30
    ) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = httpx.Response(200, content=line[6:]).json()
            prompt_ids = prompt_ids or event.get("prompt_token_ids")
            for choice in event["choices"]:
                streamed += choice.get("token_ids") or []
    assert streamed == ids
    assert prompt_ids == whole["prompt_token_ids"]


BAD_CHATS: list[tuple[dict[str, Any] | bytes, str | None]] = [
    (b'{"model": "sim-llama-3.1-8b", "messages": ', None),
    ({"model": MODEL}, "messages"),
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": "hello"}, "messages"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"model": MODEL, "messages": [{"role": "user"}]}, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 7}]}, "messages"),
    (
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
        },
        "messages",
    ),
    ({"model": MODEL, "messages": MESSAGES, "n": 2}, "n"),
    ({"model": MODEL, "messages": MESSAGES, "echo": True}, "echo"),
    ({"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"model": MODEL, "messages": MESSAGES, "max_tokens": 10**9}, "max_tokens"),
    ({"model": MODEL, "messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ({"model": MODEL, "messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (
        {"model": MODEL, "messages": MESSAGES, "stream_options": {"include_usage": True}},
        "stream_options",
    ),
    (
        {"model": MODEL, "messages": MESSAGES, "continue_final_message": True},
        "continue_final_message",
    ),
    ({"model": MODEL, "messages": MESSAGES, "chat_template": "{{ 7*7 }}"}, "chat_template"),
    ({"model": MODEL, "messages": MESSAGES, "kv_transfer_params": {}}, "kv_transfer_params"),
    # Refused by the shims (a tool choice without tools, an output format their engines
    # cannot honour), still a 400 to the client.
    ({"model": MODEL, "messages": MESSAGES, "tool_choice": "required"}, None),
    ({"model": MODEL, "messages": MESSAGES, "response_format": {"type": "json_object"}}, None),
]


@pytest.mark.parametrize(("body", "param"), BAD_CHATS)
def test_bad_chat_bodies_are_400(
    cluster: ThreadedCluster, body: dict[str, Any] | bytes, param: str | None
) -> None:
    if isinstance(body, bytes):
        resp = httpx.post(
            cluster.url + "/v1/chat/completions",
            content=body,
            headers={"content-type": "application/json"},
        )
    else:
        resp = httpx.post(cluster.url + "/v1/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    assert "captain" not in err["message"] and "terse" not in err["message"]  # no prompt echo


def test_bad_chats_release_everything(cluster: ThreadedCluster) -> None:
    for body, _ in BAD_CHATS:
        if isinstance(body, dict):
            httpx.post(cluster.url + "/v1/chat/completions", json=body)
    _idle(cluster)
    for row in cluster.instances():
        load = shim_load(row["url"])
        assert load["used"] == 0, row
