"""OpenTelemetry spans of one request through a real gateway server: the request, its queue
wait, every prefill attempt (a 429 then an accept), the decode placement and the relay;
``traceparent`` sent to the instances. Recorded with the SDK's in-memory exporter."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdgate.config import GatewaySettings, RegistrySettings
from pdgate.config.server import bind_socket, bound_port, serving
from pdgate.config.tracing import Tracing
from pdgate.gateway.app import build_gateway_app
from pdgate.gateway.upstream.mock import MockUpstream, Reply
from pdgate.registry import MemoryRegistry
from tests.gateway._fakes import FakeCluster, records


@pytest.fixture
async def traced() -> AsyncIterator[tuple[str, MockUpstream, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    tracing = Tracing.with_processor(SimpleSpanProcessor(exporter), "pdgate-test")
    cluster = FakeCluster(prefill_script=[Reply(status=429, json={"error": {}})])
    upstream = MockUpstream(cluster)
    registry = MemoryRegistry()
    for record in records([1, 1], [4]).values():
        await registry.put(record, ttl_s=60)
    settings = GatewaySettings(port=0, reject_hold_s=0.01, backoff_initial_s=0.001)
    app = build_gateway_app(
        settings, registry, RegistrySettings(poll_interval_s=0.05), upstream=upstream,
        tracing=tracing,
    )  # fmt: skip
    sock = bind_socket("127.0.0.1", 0)
    async with serving(app, sock):
        yield f"http://127.0.0.1:{bound_port(sock)}", upstream, exporter
    tracing.shutdown()


async def test_a_retried_request_is_one_trace_with_a_span_per_step(
    traced: tuple[str, MockUpstream, InMemorySpanExporter],
) -> None:
    url, upstream, exporter = traced
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    async with httpx.AsyncClient() as client:
        resp = await client.post(
            url + "/v1/completions",
            json={"model": "m", "prompt": "trace me", "max_tokens": 3, "stream": True},
            headers={"traceparent": parent},
        )
    assert resp.status_code == 200
    spans = {s.name: s for s in exporter.get_finished_spans() if s.name != "pdgate.prefill_attempt"}
    attempts = [s for s in exporter.get_finished_spans() if s.name == "pdgate.prefill_attempt"]
    root = spans["pdgate.request"]
    # The client's trace continues through the gateway.
    assert f"{root.context.trace_id:032x}" == "0af7651916cd43dd8448eb211c80319c"
    assert root.parent is not None and f"{root.parent.span_id:016x}" == "b7ad6b7169203331"
    assert root.attributes["pdgate.outcome"] == "ok"
    assert root.attributes["pdgate.prefill_rejections"] == 1
    for name in ("pdgate.queue_wait", "pdgate.decode_attempt", "pdgate.relay"):
        assert spans[name].parent.span_id == root.context.span_id, name
    assert [a.attributes["pdgate.outcome"] for a in attempts] == ["rejected", "accepted"]
    assert [a.attributes["http.response.status_code"] for a in attempts] == [429, 200]
    assert all(a.parent.span_id == root.context.span_id for a in attempts)
    assert spans["pdgate.queue_wait"].attributes["pdgate.prefill_attempts"] == 2
    # Each upstream call carried its own span as traceparent, in the same trace.
    for call in upstream.calls:
        if call.leg in ("prefill", "decode"):
            tp = call.headers["traceparent"]
            assert tp.split("-")[1] == "0af7651916cd43dd8448eb211c80319c"


async def test_tracing_is_off_without_otel_variables() -> None:
    tracing = Tracing.from_env("pdgate-gateway", env={})
    assert not tracing.enabled
    span = tracing.start("x")
    assert not span.is_recording()
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER"):
        Tracing.from_env("g", env={"OTEL_TRACES_EXPORTER": "zipkin"})
    otlp = Tracing.from_env("g", env={"OTEL_TRACES_EXPORTER": "otlp"})
    assert otlp.enabled
    otlp.shutdown()
