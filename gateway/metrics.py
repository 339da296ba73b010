"""Prometheus metrics, on a per-app registry (no process-global state)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)


class GatewayMetrics:
    def __init__(self, totals: Callable[[], tuple[int, int]], pending: Callable[[], int]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "pdgate_requests", "Completed client requests by outcome", ["outcome"], registry=r
        )
        self.prefill_attempts = Counter(
            "pdgate_prefill_attempts", "Prefill calls by result", ["result"], registry=r
        )
        self.early_drops = Counter(
            "pdgate_early_drops",
            "Queued requests answered 503 before any prefill call: even an optimistic prefill "
            "would have ended past their deadline",
            registry=r,
        )
        self.decode_attempts = Counter(
            "pdgate_decode_attempts", "Decode calls by result", ["result"], registry=r
        )
        self.ttft = Histogram(
            "pdgate_ttft_seconds",
            "Request arrival to first byte relayed",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.placement = Histogram(
            "pdgate_placement_seconds",
            "Request arrival to a decode accepting it (queueing + retries + prefill)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prefill_rejections = Histogram(
            "pdgate_prefill_rejections",
            "429s a request met before a prefill accepted it",
            buckets=(0, 1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )
        Gauge(
            "pdgate_open_streams", "Open client streams (summed over instances)", registry=r
        ).set_function(lambda: float(totals()[0]))
        Gauge("pdgate_inflight", "Requests in flight at instances", registry=r).set_function(
            lambda: float(totals()[1])
        )
        Gauge(
            "pdgate_pending", "Requests admitted by the gateway and not finished", registry=r
        ).set_function(lambda: float(pending()))
