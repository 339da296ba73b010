"""A scenario group's own TTFT deadline and queue bound take effect, per group, in a real
``pdgate gateway`` process (groups from a TOML ``--config``) in front of sim shims in two
groups on a real Redis; and the request's trace carries its group (``pdgate.group``)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from pathlib import Path
from typing import Any

import httpx
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdgate.config import GatewaySettings, RegistrySettings, ScenarioGroup
from pdgate.config.server import bind_socket, bound_port, serving
from pdgate.config.tracing import Tracing
from pdgate.config.wire import kv_release_url
from pdgate.gateway.app import build_gateway_app
from pdgate.gateway.upstream.mock import MockUpstream
from pdgate.registry import MemoryRegistry
from tests._cluster import (
    Subprocess,
    gateway_url,
    hold_prefill_slot,
    queued_heads,
    registry_env,
    start,
    wait_for,
)
from tests.gateway._fakes import FakeCluster, records

MODEL = "sim-llama-3.1-8b"
CONFIG = """
[gateway]
ttft_timeout_s = 1.0          # the default: shorter than the long group's wait below

[[gateway.groups]]
name = "short"
headers = ["short"]
ttft_timeout_s = 0.5
queue_size = 1

[[gateway.groups]]
name = "long"
headers = ["long"]
ttft_timeout_s = 20
"""


def _post(url: str, group: str, prompt: str) -> httpx.Response:
    return httpx.post(
        url + "/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 2},
        headers={"x-pdgate-group": group},
        timeout=30,
    )


def test_each_group_has_its_own_deadline_and_queue_bound(
    redis_url: str, registry_prefix: str, procs: list[Subprocess], tmp_path: Path
) -> None:
    env = registry_env(redis_url, registry_prefix)
    shim = ["shim", "--host", "127.0.0.1", "--port", "0", "--capacity", "1"]
    prefills: dict[str, str] = {}
    for group in ("short", "long"):
        p = start(procs, [*shim, "--role", "prefill", "--group", group], env)
        prefills[group] = p.lines[-1].split()[-1].strip()
        start(procs, [*shim, "--role", "decode", "--group", group], env)
    config = tmp_path / "pdgate.toml"
    config.write_text(CONFIG)
    url = gateway_url(start(procs, ["gateway", "--port", "0", "--config", str(config)], env))
    wait_for(
        lambda: len(httpx.get(url + "/admin/instances", timeout=5).json()["instances"]) == 4,
        what="instances seen",
    )
    # Both groups' only prefill slot is taken (as by another client): everyone must wait.
    held = {g: hold_prefill_slot(u, f"hold {g}") for g, u in prefills.items()}

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        began = time.monotonic()
        first = pool.submit(_post, url, "short", "first")
        # Queued with the short group's deadline (0.5 s, not the default 1 s).
        assert max(queued_heads(url, 1, "short")) <= 500
        # The short group's queue (1) is full: refused at once, while ...
        full = _post(url, "short", "second")
        assert full.status_code == 503 and "Retry-After" in full.headers
        assert full.json()["error"]["code"] == "gateway_overloaded"
        # ... the long group's queue still admits.
        longs = [pool.submit(_post, url, "long", f"long {i}") for i in range(3)]
        assert min(queued_heads(url, 3, "long")) > 1000  # the long group's 20 s

        # The short group's deadline ends its wait.
        timed_out = first.result()
        assert timed_out.status_code == 503, timed_out.text
        assert timed_out.json()["error"]["code"] == "ttft_deadline_exceeded"
        assert int(timed_out.headers["Retry-After"]) >= 1

        # The long group waits past the default deadline; its slot frees, and all succeed.
        time.sleep(max(0.0, began + 1.5 - time.monotonic()))
        assert all(not f.done() for f in longs)
        release = kv_release_url(prefills["long"], held["long"]["remote_request_id"])
        httpx.delete(release, timeout=5).raise_for_status()
        assert [f.result().status_code for f in longs] == [200, 200, 200]
    assert time.monotonic() - began > 1.5


async def test_the_request_span_carries_its_group() -> None:
    exporter = InMemorySpanExporter()
    tracing = Tracing.with_processor(SimpleSpanProcessor(exporter), "pdgate-test")
    registry = MemoryRegistry()
    for record in records([1], [4]).values():
        await registry.put(dataclasses.replace(record, group="chat"), ttl_s=60)
    settings = GatewaySettings(port=0, groups=[ScenarioGroup(name="chat", max_prompt_chars=100)])
    app = build_gateway_app(
        settings, registry, RegistrySettings(), upstream=MockUpstream(FakeCluster()),
        tracing=tracing,
    )  # fmt: skip
    sock = bind_socket("127.0.0.1", 0)
    async with serving(app, sock), httpx.AsyncClient() as client:
        url = f"http://127.0.0.1:{bound_port(sock)}"
        body: dict[str, Any] = {"model": "m", "prompt": "short prompt", "max_tokens": 2}
        assert (await client.post(url + "/v1/completions", json=body)).status_code == 200
    tracing.shutdown()
    (root,) = [s for s in exporter.get_finished_spans() if s.name == "pdgate.request"]
    assert root.attributes is not None
    assert root.attributes["pdgate.group"] == "chat"  # resolved by the rule, not a header
