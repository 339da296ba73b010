"""Aggregated serving (NoDG): a group whose instances compute prompts and decode them gets
each request whole, from the gateway's queue (deadline, 429 retries, slots), through the
official openai client; embedded, and as separate processes on one Redis."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests._cluster import (
    SIM_MODEL,
    Processes,
    ThreadedCluster,
    assert_serves_openai,
    counts_released,
    get_instances,
    openai_client,
    shim_load,
    wait_for,
    wait_instances,
)
from tests.gateway.stream import test_migration as migration
from tests.registry._stock_server import FAST_PROBES, StockServer, completion_text

PROMPT = "Tell me about aggregated serving."


@pytest.fixture(scope="module")
def cluster() -> Iterator[ThreadedCluster]:
    # Two instances of one slot each, so that a third request waits at the gateway.
    with ThreadedCluster(prefills=1, decodes=1, strategy="aggregated", shim={"capacity": 1}) as c:
        yield c


def test_every_api_is_served_whole_by_the_aggregated_instances(cluster: ThreadedCluster) -> None:
    assert cluster.info is not None
    assert not cluster.info.prefill_urls and not cluster.info.decode_urls
    assert {i["role"] for i in cluster.instances()} == {"aggregated"}
    client = openai_client(cluster.url)
    whole = client.completions.create(model=SIM_MODEL, prompt=PROMPT, max_tokens=8)
    assert whole.usage is not None and whole.usage.completion_tokens == 8
    streamed = client.completions.create(model=SIM_MODEL, prompt=PROMPT, max_tokens=8, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model=SIM_MODEL, messages=messages, max_tokens=5)
    assert chat.choices[0].message.content
    chunks = client.chat.completions.create(
        model=SIM_MODEL,
        messages=messages,
        max_tokens=5,
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        chat.choices[0].message.content
    )
    # The instances computed the prompts themselves: no prefill leg, no KV moved.
    loads = [shim_load(u) for u in cluster.info.aggregated_urls]
    assert sum(x["local_prefills"] for x in loads) == 4
    assert all(x["role"] == "aggregated" for x in loads)
    cluster.wait_for(lambda: counts_released(cluster.url), what="every count back to zero")


def test_requests_beyond_the_slots_wait_at_the_gateway_not_429(cluster: ThreadedCluster) -> None:
    """Three requests at once on two one-slot instances: the third waits in the gateway's
    queue for a slot and is served; the client never sees a 429."""
    client = openai_client(cluster.url)
    results: list[int] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            out = client.completions.create(model=SIM_MODEL, prompt=PROMPT, max_tokens=40)
            assert out.usage is not None
            results.append(out.usage.completion_tokens)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and results == [40, 40, 40]
    rejected = [shim_load(u)["rejected"] for u in cluster.info.aggregated_urls]  # type: ignore[union-attr]
    assert sum(rejected) == 0  # the gateway kept within the slots: nothing was sent to a full one
    cluster.wait_for(lambda: counts_released(cluster.url), what="every count back to zero")


def test_a_request_no_slot_frees_for_in_time_gets_503_at_its_deadline(
    cluster: ThreadedCluster,
) -> None:
    """Both slots held by long streams: a request with a short TTFT deadline is answered
    503 with Retry-After when its deadline passes, and nothing stays counted."""
    long = {"model": SIM_MODEL, "prompt": PROMPT, "max_tokens": 400, "stream": True}
    with httpx.Client(timeout=30) as http:
        holders = [
            http.stream("POST", cluster.url + "/v1/completions", json=long) for _ in range(2)
        ]
        responses = [h.__enter__() for h in holders]
        # Kept: a line iterator that is collected closes its response.
        lines = [r.iter_lines() for r in responses]
        try:
            for r, it in zip(responses, lines, strict=True):
                assert r.status_code == 200
                next(it)  # streaming: the slot is taken
            began = time.monotonic()
            resp = http.post(
                cluster.url + "/v1/completions",
                json={"model": SIM_MODEL, "prompt": PROMPT, "max_tokens": 4},
                headers={"x-pdgate-ttft-timeout-ms": "500"},
            )
            assert resp.status_code == 503, resp.text
            assert "retry-after" in resp.headers
            assert resp.json()["error"]["code"] == "ttft_deadline_exceeded"
            assert time.monotonic() - began > 0.4  # it waited for its deadline ...
            # ... and not for a slot: both long streams still hold theirs.
            assert httpx.get(cluster.url + "/health").json()["open_streams"] == 2
        finally:
            for h in holders:
                h.__exit__(None, None, None)
    cluster.wait_for(lambda: counts_released(cluster.url), what="every count back to zero")


def test_separate_processes_on_redis_serve_aggregated(processes: Processes) -> None:
    """Two aggregated shims and two gateways, each its own process, on one Redis: both
    gateways serve every API whole, and the fleet's counts go back to zero."""
    for _ in range(2):
        processes.shim("aggregated", "--capacity", "2")
    urls = [processes.gateway(), processes.gateway()]
    for url in urls:
        wait_instances(url, 2)
        assert_serves_openai(url, PROMPT)
    for url in urls:
        wait_for(lambda u=url: counts_released(u), what="every count back to zero")  # type: ignore[misc]


def test_a_plain_server_given_by_url_is_served_aggregated(processes: Processes) -> None:
    """``--aggregated URL`` in front of a stock-like server (no registration, no pdgate
    extension, vLLM's API): every request goes to it whole, none as a prefill leg."""
    server = StockServer("stock-agg").start()
    try:
        url = processes.gateway("--aggregated", f"{server.url} capacity=2", env={**FAST_PROBES})
        wait_instances(url, 1)
        assert [i["role"] for i in get_instances(url)] == ["aggregated"]
        client = openai_client(url)
        out = client.completions.create(model="stock-agg", prompt=PROMPT, max_tokens=5)
        assert out.choices[0].text == completion_text(PROMPT, 5)
        streamed = client.completions.create(
            model="stock-agg", prompt=PROMPT, max_tokens=5, stream=True
        )
        assert "".join(c.choices[0].text for c in streamed if c.choices) == out.choices[0].text
        stats = server.stats()
        assert stats["decode_legs"] == 2 and stats["prefill_legs"] == 0
        assert stats["decode_with_kv"] == 0
        wait_for(lambda: counts_released(url), what="every count back to zero")
    finally:
        server.kill()


def test_losing_an_aggregated_instance_mid_stream_goes_unnoticed(processes: Processes) -> None:
    """kill -9 one of two aggregated instances while twelve clients stream: each broken
    stream continues on the other instance (it computes prompt + tokens sent so far), and
    every client gets exactly the text of an undisturbed run."""
    sim = {"PDGATE_SHIM_SIM_PROFILE": "llama-3.1-8b-a100"}
    instances = {
        name: processes.shim("aggregated", "--capacity", "16", "--instance-id", name, env=sim)
        for name in ("d0", "d1")
    }
    url = processes.gateway()
    wait_instances(url, 2)
    expected = asyncio.run(migration.undisturbed_texts(url))
    results, victim = asyncio.run(migration.stream_and_break(url, instances))
    assert instances[victim].proc.wait(5) == -signal.SIGKILL
    migration.assert_unnoticed(url, results, expected)


def test_a_lone_gateway_counts_aggregated_slots_itself(processes: Processes) -> None:
    """Aggregated shims answer 429 themselves when full (queue-less): a gateway alone in its
    fleet counts their slots without a Redis round trip per request."""
    processes.shim("aggregated", "--capacity", "2")
    url = processes.gateway()
    wait_instances(url, 1)
    client = openai_client(url)
    for _ in range(3):
        out = client.completions.create(model=SIM_MODEL, prompt=PROMPT, max_tokens=3)
        assert out.usage is not None and out.usage.completion_tokens == 3
    metrics = httpx.get(url + "/metrics", timeout=5).text
    acquires = [
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith('pdgate_fleet_calls_total{op="acquire"}')
    ]
    assert acquires in ([], [0.0]), acquires
