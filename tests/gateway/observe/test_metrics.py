"""The gateway's /metrics, checked by Debian's promtool and scraped by a real Prometheus."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from pdgate.gateway.observe.metrics import LoopHistogram
from tests._cluster import ThreadedCluster, wait_for
from tests._tools import free_port, require_binary

MODEL = "sim-llama-3.1-8b"


def _traffic(url: str) -> None:
    for stream in (False, True):
        resp = httpx.post(
            url + "/v1/completions",
            json={"model": MODEL, "prompt": "metrics", "max_tokens": 4, "stream": stream},
            timeout=10,
        )
        assert resp.status_code == 200
    assert httpx.post(url + "/v1/completions", json={"prompt": 1}).status_code == 400


def test_metrics_pass_promtool_and_carry_per_instance_series() -> None:
    promtool = require_binary("promtool", "it lints the exposition format")
    with ThreadedCluster(prefills=1, decodes=1) as c:
        _traffic(c.url)
        text = httpx.get(c.url + "/metrics").text
    out = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert 'pdgate_requests_total{group="*",outcome="ok"} 2.0' in text
    assert 'pdgate_requests_total{group="*",outcome="client_error"} 1.0' in text
    assert 'pdgate_ttft_seconds_bucket{group="*",le="0.2"}' in text
    assert "pdgate_inter_token_seconds_count" in text
    for role in ("prefill", "decode"):
        assert f'pdgate_instance_capacity{{group="default",instance="{role}-' in text
    # Drain admission's view of the queue the traffic went through: no pace yet, no headroom.
    queue = f'{{group="",model="{MODEL}",role="prefill"}}'
    assert f"pdgate_queue_headroom{queue} 0.0" in text
    assert f"pdgate_queue_arrival_rate{queue} " in text
    assert "pdgate_queue_drain_pace{" not in text
    # Nothing refused: no retry awaited, and none has shown its clients come back.
    assert f"pdgate_queue_retries_awaited{queue} 0.0" in text
    assert f"pdgate_queue_retries_as_told{queue} 0.0" in text


@pytest.mark.parametrize("values", [[], [0.1], [0.0005, 0.1, 0.3, 0.5, 0.7, 2.5, 99.0]])
def test_the_loop_histogram_exposes_what_prometheus_client_would(values: list[float]) -> None:
    """The relay's lock-free histogram: the same buckets (a bound's own value counts in it),
    count and sum as prometheus_client's `Histogram` given the same observations."""
    buckets = (0.1, 0.5, 1, 2.5)
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    loop = LoopHistogram("gap_seconds", "Gaps", buckets)
    ours.register(loop)
    reference = Histogram("gap_seconds", "Gaps", buckets=buckets, registry=theirs)
    for v in values:
        loop.observe(v)
        reference.observe(v)

    def samples(registry: CollectorRegistry) -> list[str]:
        text = generate_latest(registry).decode()
        return [line for line in text.splitlines() if "_created" not in line]

    assert samples(ours) == samples(theirs)


def test_a_real_prometheus_scrapes_the_gateway(tmp_path: Path) -> None:
    prometheus = require_binary("prometheus", "the scrape test runs a real server")
    with ThreadedCluster(prefills=1, decodes=1) as c:
        _traffic(c.url)
        target = c.url.removeprefix("http://")
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n"
            "scrape_configs:\n"
            f"  - job_name: pdgate\n    static_configs:\n      - targets: ['{target}']\n"
        )
        port = free_port()
        proc = subprocess.Popen(
            [
                prometheus,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            api = f"http://127.0.0.1:{port}/api/v1/query"

            def query(q: str) -> list[dict[str, object]]:
                try:
                    resp = httpx.get(api, params={"query": q}, timeout=2)
                except httpx.HTTPError:
                    return []
                if resp.status_code != 200:
                    return []
                result: list[dict[str, object]] = resp.json()["data"]["result"]
                return result

            wait_for(
                lambda: bool(query('pdgate_requests_total{outcome="ok"}')),
                timeout=30,
                what="Prometheus scraped the gateway",
            )
            ok = query('sum(pdgate_requests_total{outcome="ok"})')
            assert float(ok[0]["value"][1]) == 2.0  # type: ignore[index]
            assert len(query("pdgate_instance_capacity")) == 2
            assert query('up{job="pdgate"}')[0]["value"][1] == "1"  # type: ignore[index]
        finally:
            proc.terminate()
            proc.wait(10)


def test_a_labelled_loop_histogram_exposes_what_prometheus_client_would() -> None:
    buckets = (0.1, 1)
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    loop = LoopHistogram("ttft_seconds", "TTFT", buckets, ["group"])
    ours.register(loop)
    reference = Histogram("ttft_seconds", "TTFT", ["group"], buckets=buckets, registry=theirs)
    for group, value in (("a", 0.05), ("b", 2.0), ("a", 1.0), ("*", 0.1)):
        loop.labels(group).observe(value)
        reference.labels(group).observe(value)
    assert loop.labels("a") is loop.labels("a")

    def samples(registry: CollectorRegistry) -> list[str]:
        text = generate_latest(registry).decode()
        return [line for line in text.splitlines() if "_created" not in line]

    assert samples(ours) == samples(theirs)
    with pytest.raises(ValueError, match="labels"):
        loop.observe(1.0)
    with pytest.raises(ValueError, match="takes labels"):
        loop.labels("a", "b")
