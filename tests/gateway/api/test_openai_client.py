"""The official openai client against the embedded cluster, over real sockets."""

from __future__ import annotations

from collections.abc import Iterator

import httpx2
import openai
import pytest

from tests._cluster import ThreadedCluster, hold_prefill_slot

PROMPT = "Tell me about prefill and decode disaggregation."


@pytest.fixture(scope="module")
def cluster() -> Iterator[ThreadedCluster]:
    with ThreadedCluster(prefills=2, decodes=2) as c:
        yield c


def test_models_lists_what_the_registry_has(
    client: openai.OpenAI, cluster: ThreadedCluster
) -> None:
    models = [m.id for m in client.models.list()]
    assert models == [cluster.shim_settings.model]


def test_non_stream_completion_with_usage(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="sim-llama-3.1-8b", prompt=PROMPT, max_tokens=12, temperature=0
    )
    assert out.object == "text_completion"
    assert out.choices[0].text.strip()
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None
    assert out.usage.completion_tokens == 12
    assert out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12


def test_stream_matches_non_stream_and_reports_usage(client: openai.OpenAI) -> None:
    whole = client.completions.create(model="sim-llama-3.1-8b", prompt=PROMPT, max_tokens=10)
    chunks = list(
        client.completions.create(
            model="sim-llama-3.1-8b",
            prompt=PROMPT,
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    token_chunks = [c for c in chunks if c.choices]
    assert len(token_chunks) == 10  # one SSE event per token: really streamed, not one blob
    assert token_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10


def test_stop_sequence_truncates_and_reports_stop(client: openai.OpenAI) -> None:
    full = (
        client.completions.create(model="sim-llama-3.1-8b", prompt=PROMPT, max_tokens=20)
        .choices[0]
        .text
    )
    words = full.split()
    stop = words[len(words) // 2]
    cut = full.index(stop)
    out = client.completions.create(
        model="sim-llama-3.1-8b", prompt=PROMPT, max_tokens=20, stop=[stop]
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == full[:cut]
    streamed = client.completions.create(
        model="sim-llama-3.1-8b", prompt=PROMPT, max_tokens=20, stop=stop, stream=True
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_client_retries_a_503_with_retry_after() -> None:
    """Deadline passes while the only prefill slot is held; the client honours Retry-After
    and its retry succeeds once the slot is free."""
    with ThreadedCluster(
        prefills=1, decodes=1, shim={"capacity": 1, "kv_hold_timeout_s": 0.5}
    ) as c:
        statuses: list[int] = []
        retry_after: list[str | None] = []

        def seen(response: httpx2.Response) -> None:
            statuses.append(response.status_code)
            retry_after.append(response.headers.get("retry-after"))

        http = httpx2.Client(event_hooks={"response": [seen]})
        client = openai.OpenAI(
            base_url=c.url + "/v1", api_key="unused", max_retries=2, http_client=http
        )
        assert c.info is not None
        hold_prefill_slot(c.info.prefill_urls[0])
        out = client.completions.create(
            model="sim-llama-3.1-8b",
            prompt=PROMPT,
            max_tokens=4,
            extra_headers={"x-pdgate-ttft-timeout-ms": "200"},
        )
        assert out.choices[0].text
        assert statuses[0] == 503
        assert retry_after[0] is not None and 1 <= int(retry_after[0]) <= 120
        assert statuses[-1] == 200
        c.wait_for(
            lambda: all(r["open_streams"] == 0 and r["inflight"] == 0 for r in c.instances())
        )
