"""OpenTelemetry tracing shared by the gateway and the shims; off unless asked for.

Configured by the standard variables: ``OTEL_TRACES_EXPORTER=otlp`` (or ``console``) turns
it on, ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` and the rest
of ``OTEL_EXPORTER_OTLP_*`` configure the OTLP/HTTP exporter, ``OTEL_SERVICE_NAME`` and
``OTEL_RESOURCE_ATTRIBUTES`` name the process. Unset, every span is a no-op.

Nothing is global: a `Tracing` is built at start-up and handed down, and spans are parented
explicitly (an asyncio task does not inherit the right request's context: a forwarder's
task serves many requests). W3C ``traceparent`` carries a request's trace to the instances.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from opentelemetry.trace import NoOpTracerProvider, Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = ["Span", "SpanKind", "Tracing"]

_PROPAGATOR = TraceContextTextMapPropagator()


class Tracing:
    def __init__(self, provider: TracerProvider | None, service: str) -> None:
        self._provider = provider
        source: trace.TracerProvider = provider or NoOpTracerProvider()
        self.tracer = source.get_tracer("pdgate", schema_url=None)
        self.service = service

    @classmethod
    def off(cls, service: str = "pdgate") -> Tracing:
        return cls(None, service)

    @classmethod
    def from_env(cls, service: str, env: Mapping[str, str] | None = None) -> Tracing:
        env = os.environ if env is None else env
        exporter = env.get("OTEL_TRACES_EXPORTER", "none").strip().lower()
        if exporter in ("", "none") or env.get("OTEL_SDK_DISABLED", "").lower() == "true":
            return cls.off(service)
        if exporter == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            processor: SpanProcessor = BatchSpanProcessor(OTLPSpanExporter())
        elif exporter == "console":
            processor = BatchSpanProcessor(ConsoleSpanExporter())
        else:
            raise ValueError(
                f"OTEL_TRACES_EXPORTER={exporter!r} is not supported: use otlp, console or none"
            )
        return cls.with_processor(processor, env.get("OTEL_SERVICE_NAME") or service)

    @classmethod
    def with_processor(cls, processor: SpanProcessor, service: str) -> Tracing:
        # Resource.create reads OTEL_RESOURCE_ATTRIBUTES too.
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        provider.add_span_processor(processor)
        return cls(provider, service)

    @property
    def enabled(self) -> bool:
        return self._provider is not None

    def start(
        self,
        name: str,
        *,
        parent: Span | Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
    ) -> Span:
        """A span (ended by the caller), child of `parent` (a span or an extracted context)."""
        if self._provider is None:
            # Off: one shared no-op span. The API's no-op tracer would build a context and a
            # new span object per call, five times per request on the hot path.
            return trace.INVALID_SPAN
        context = trace.set_span_in_context(parent) if isinstance(parent, Span) else parent
        return self.tracer.start_span(name, context=context, kind=kind)

    def inject(self, span: Span, headers: MutableMapping[str, str]) -> None:
        """Add `span`'s W3C ``traceparent`` to outgoing `headers` (nothing when off)."""
        if span.is_recording():
            _PROPAGATOR.inject(headers, context=trace.set_span_in_context(span))

    def serve(self, name: str, headers: Mapping[str, str]) -> Span:
        """The span of a request this process serves (ended by the caller): a child of the
        caller's trace context in `headers`. Off: the headers are not even read."""
        parent = self.extract(headers) if self._provider is not None else None
        return self.start(name, parent=parent, kind=SpanKind.SERVER)

    @staticmethod
    def extract(headers: Mapping[str, str]) -> Context:
        """The caller's trace context from incoming headers (an empty one if none)."""
        return _PROPAGATOR.extract(headers)

    def shutdown(self) -> None:
        """Flush and stop the exporter (at process end)."""
        if self._provider is not None:
            self._provider.shutdown()
