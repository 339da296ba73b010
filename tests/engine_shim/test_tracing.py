"""The shims' OpenTelemetry spans join the caller's trace (W3C ``traceparent``): a prefill's
admission (accepted, or the 429) and compute, a decode's KV pull (bytes) and stream. Real
shims on real sockets, recorded with the SDK's in-memory exporter."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdgate.config import Role, ShimSettings
from pdgate.config.server import bind_socket, bound_port, serving
from pdgate.config.tracing import Tracing
from pdgate.engine_shim.app import build_shim_app
from pdgate.registry.memory import MemoryRegistry
from tests.engine_shim.conftest import MODEL, REGISTRY_SETTINGS, prefill_body, sse_events

TRACE = "0af7651916cd43dd8448eb211c80319c"
OTHER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def _traceparent(trace: str, span: str) -> dict[str, str]:
    return {"traceparent": f"00-{trace}-{span}-01"}


@pytest.fixture
async def traced() -> AsyncIterator[tuple[str, str, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    tracing = Tracing.with_processor(SimpleSpanProcessor(exporter), "pdgate-shim")
    registry = MemoryRegistry()
    urls = []
    async with contextlib.AsyncExitStack() as stack:
        for role in (Role.PREFILL, Role.DECODE):
            sock = bind_socket("127.0.0.1", 0)
            settings = ShimSettings(role=role, host="127.0.0.1", port=bound_port(sock), capacity=1)
            app = build_shim_app(settings, registry, REGISTRY_SETTINGS, tracing=tracing)
            await stack.enter_async_context(serving(app, sock))
            urls.append(f"http://127.0.0.1:{settings.port}")
        yield urls[0], urls[1], exporter
    tracing.shutdown()
    await registry.aclose()


def _by_name(spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def _trace_id(span: ReadableSpan) -> str:
    assert span.context is not None
    return f"{span.context.trace_id:032x}"


def _child_of(span: ReadableSpan, parent: ReadableSpan) -> bool:
    return (
        span.parent is not None
        and parent.context is not None
        and span.parent.span_id == parent.context.span_id
    )


async def test_shim_spans_join_the_callers_trace(
    traced: tuple[str, str, InMemorySpanExporter],
) -> None:
    prefill, decode, exporter = traced
    async with aiohttp.ClientSession() as http:
        async with http.post(
            prefill + "/v1/completions",
            data=orjson.dumps(prefill_body()),
            headers=_traceparent(TRACE, "b7ad6b7169203331"),
        ) as resp:
            assert resp.status == 200
            first = await resp.json()
        # The only slot is held until the KV is pulled: this one is rejected at admission.
        async with http.post(
            prefill + "/v1/completions",
            data=orjson.dumps(prefill_body("x")),
            headers=_traceparent(OTHER_TRACE, "00f067aa0ba902b7"),
        ) as resp:
            assert resp.status == 429
        body = {
            "model": MODEL,
            "prompt": "Hello there, general Kenobi.",
            "max_tokens": 3,
            "stream": True,
            "kv_transfer_params": first["kv_transfer_params"],
        }
        async with http.post(
            decode + "/v1/completions",
            data=orjson.dumps(body),
            headers=_traceparent(TRACE, "a3ce929d0e0e4736"),
        ) as resp:
            assert (await sse_events(resp))[-1] == "[DONE]"
    spans = list(exporter.get_finished_spans())

    accepted, rejected = sorted(
        _by_name(spans, "pdgate.shim.prefill"), key=lambda s: _trace_id(s) != TRACE
    )
    # The prefill's request span continues the caller's trace, under the caller's span.
    assert _trace_id(accepted) == TRACE
    assert accepted.parent is not None and f"{accepted.parent.span_id:016x}" == "b7ad6b7169203331"
    assert accepted.attributes is not None and accepted.attributes["pdgate.outcome"] == "ok"
    (admission,) = [s for s in _by_name(spans, "pdgate.shim.admission") if _child_of(s, accepted)]
    assert admission.attributes is not None and admission.attributes["pdgate.outcome"] == "accepted"
    (compute,) = _by_name(spans, "pdgate.shim.prefill_compute")
    assert _child_of(compute, accepted)
    assert compute.attributes is not None and compute.attributes["pdgate.prompt_tokens"] > 0

    # The rejected one: its own trace, a 429 at admission, no compute.
    assert _trace_id(rejected) == OTHER_TRACE
    assert rejected.attributes is not None
    assert rejected.attributes["http.response.status_code"] == 429
    (refused,) = [s for s in _by_name(spans, "pdgate.shim.admission") if _child_of(s, rejected)]
    assert refused.attributes is not None
    assert refused.attributes["pdgate.outcome"] == "rejected"
    assert refused.attributes["http.response.status_code"] == 429

    # The decode: its request span in the same trace, the KV pull and the stream under it.
    (request,) = _by_name(spans, "pdgate.shim.decode")
    assert _trace_id(request) == TRACE
    assert request.parent is not None and f"{request.parent.span_id:016x}" == "a3ce929d0e0e4736"
    (pull,) = _by_name(spans, "pdgate.shim.kv_pull")
    (stream,) = _by_name(spans, "pdgate.shim.decode_stream")
    assert _child_of(pull, request) and _child_of(stream, request)
    assert pull.attributes is not None and pull.attributes["pdgate.outcome"] == "ok"
    assert pull.attributes["pdgate.kv_bytes"] > 0
    assert stream.attributes is not None and stream.attributes["pdgate.completion_tokens"] == 3
    assert pull.end_time is not None and stream.start_time is not None
    assert pull.end_time <= stream.start_time  # the stream starts once the KV is in
    assert request.attributes is not None and request.attributes["pdgate.outcome"] == "ok"


async def test_one_trace_from_the_gateway_through_both_shims() -> None:
    from pdgate.config import GatewaySettings, RegistrySettings
    from pdgate.gateway.app import build_gateway_app

    exporter = InMemorySpanExporter()
    tracing = Tracing.with_processor(SimpleSpanProcessor(exporter), "pdgate")
    registry = MemoryRegistry()
    async with contextlib.AsyncExitStack() as stack:
        for role in (Role.PREFILL, Role.DECODE):
            sock = bind_socket("127.0.0.1", 0)
            settings = ShimSettings(role=role, host="127.0.0.1", port=bound_port(sock))
            app = build_shim_app(settings, registry, REGISTRY_SETTINGS, tracing=tracing)
            await stack.enter_async_context(serving(app, sock))
        sock = bind_socket("127.0.0.1", 0)
        gateway = build_gateway_app(
            GatewaySettings(port=0), registry, RegistrySettings(poll_interval_s=0.05),
            tracing=tracing,
        )  # fmt: skip
        await stack.enter_async_context(serving(gateway, sock))
        async with aiohttp.ClientSession() as http:
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 3}  # fmt: skip
            async with http.post(
                f"http://127.0.0.1:{bound_port(sock)}/v1/chat/completions",
                data=orjson.dumps(chat),
                headers=_traceparent(TRACE, "b7ad6b7169203331"),
            ) as resp:
                assert resp.status == 200, await resp.text()
    tracing.shutdown()
    await registry.aclose()
    spans = list(exporter.get_finished_spans())
    names = {s.name for s in spans}
    assert {
        "pdgate.request",
        "pdgate.prefill_attempt",
        "pdgate.decode_attempt",
        "pdgate.shim.prefill",
        "pdgate.shim.decode",
        "pdgate.shim.kv_pull",
    } <= names
    assert {_trace_id(s) for s in spans} == {TRACE}  # one trace, end to end
    (attempt,) = _by_name(spans, "pdgate.prefill_attempt")
    (decode_attempt,) = _by_name(spans, "pdgate.decode_attempt")
    assert _child_of(_by_name(spans, "pdgate.shim.prefill")[0], attempt)
    assert _child_of(_by_name(spans, "pdgate.shim.decode")[0], decode_attempt)
