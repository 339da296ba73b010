"""docs/observability.md documents every Prometheus metric the gateway and the shims export:
a real cluster (gateway, prefill and decode shims on real sockets) serves some traffic, each
process's ``/metrics`` is scraped, and every metric family must appear in the page under its
exposed name (counters with ``_total``)."""

from __future__ import annotations

from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests._cluster import ThreadedCluster

DOC = Path(__file__).resolve().parents[1] / "docs" / "observability.md"


def _exported(url: str) -> set[str]:
    resp = httpx.get(url + "/metrics", timeout=5)
    resp.raise_for_status()
    names = set()
    for family in text_string_to_metric_families(resp.text):
        if family.name.endswith("_created"):
            continue  # the client library's creation timestamps, documented once
        names.add(family.name + "_total" if family.type == "counter" else family.name)
    return names


def test_every_exported_metric_is_documented() -> None:
    doc = DOC.read_text()
    with ThreadedCluster(prefills=1, decodes=1) as cluster:
        for i in range(4):
            resp = httpx.post(
                cluster.url + "/v1/completions",
                json={
                    "model": "sim-llama-3.1-8b",
                    "prompt": f"observe me {i} " * 20,
                    "max_tokens": 4,
                    "stream": i % 2 == 0,
                },
                timeout=30,
            )
            assert resp.status_code == 200, resp.text
        shims = [row["url"] for row in cluster.instances()]
        gateway, shim = _exported(cluster.url), set().union(*(_exported(u) for u in shims))
    assert {"pdgate_requests_total", "pdgate_ttft_seconds"} <= gateway
    assert {"pdgate_shim_admitted_total", "pdgate_shim_kv_hold_seconds"} <= shim
    missing = sorted(name for name in gateway | shim if f"`{name}`" not in doc)
    assert not missing, f"add these to docs/observability.md: {missing}"
