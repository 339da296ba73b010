"""Prometheus exposition of a shim's /load snapshot, on a registry owned by the app.

The collector reads the same numbers as /load at scrape time, so there is nothing to keep
in sync and nothing registered in prometheus_client's global default registry (several
shims share one process in ``pdgate up``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# /load fields that only ever grow; the other numeric fields are gauges.
_COUNTERS = frozenset(
    {
        "admitted",
        "rejected",
        "completed",
        "cancelled",
        "failed",
        "kv_fetched",
        "kv_lost",
        "kv_released",
        "kv_expired",
        "engine_aborted",
        "prefix_cache_hit_tokens",
        "prefix_cache_total_tokens",
    }
)
_LABELS = ("role", "instance_id", "model", "group")


class LoadCollector(Collector):
    def __init__(self, load: Callable[[], dict[str, Any]]) -> None:
        self._load = load

    def collect(self) -> Iterator[Metric]:
        snapshot = self._load()
        labels = [str(snapshot.get(k, "")) for k in _LABELS]
        for name, value in snapshot.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or name in _LABELS:
                if isinstance(value, bool):
                    gauge = GaugeMetricFamily(
                        f"pdgate_shim_{name}", f"/load field {name}", labels=_LABELS
                    )
                    gauge.add_metric(labels, float(value))
                    yield gauge
                continue
            metric: GaugeMetricFamily | CounterMetricFamily
            if name in _COUNTERS:
                metric = CounterMetricFamily(
                    f"pdgate_shim_{name}", f"/load field {name}", labels=_LABELS
                )
            else:
                metric = GaugeMetricFamily(
                    f"pdgate_shim_{name}", f"/load field {name}", labels=_LABELS
                )
            metric.add_metric(labels, float(value))
            yield metric


def metrics_registry(load: Callable[[], dict[str, Any]]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LoadCollector(load))
    return registry
