"""Prometheus exposition of a shim's /load snapshot, on a registry owned by the app.

The collector reads the same numbers as /load at scrape time, so there is nothing to keep
in sync and nothing registered in prometheus_client's global default registry (several
shims share one process in ``pdgate up``). Distributions the shim records itself
(`Histogram`, e.g. how long KV was held) are exported the same way.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

# /load fields that only ever grow; the other numeric fields are gauges.
_COUNTERS = frozenset(
    {
        "admitted",
        "rejected",
        "completed",
        "cancelled",
        "failed",
        "local_prefills",
        "phase_switch_waits",
        "phase_switch_wait_s",
        "kv_fetched",
        "kv_lost",
        "kv_released",
        "withdrawn",
        "kv_expired",
        "kv_gateway_gone",
        "kv_hold_over_5s",
        "engine_aborted",
        "prefix_cache_hit_tokens",
        "prefix_cache_total_tokens",
    }
)
_LABELS = ("role", "instance_id", "model", "group")


class Histogram:
    """Counts of observations per bucket (bounded: one counter per bucket)."""

    __slots__ = ("buckets", "count", "counts", "sum")

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.count += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, float]]:
        out, total = [], 0
        for bound, n in zip([*map(str, self.buckets), "+Inf"], self.counts, strict=True):
            total += n
            out.append((bound, float(total)))
        return out


# name (after pdgate_shim_) -> (help, label name, {label value: histogram})
Histograms = Mapping[str, tuple[str, str, Mapping[str, Histogram]]]


class LoadCollector(Collector):
    def __init__(
        self,
        load: Callable[[], dict[str, Any]],
        histograms: Callable[[], Histograms] = dict,
    ) -> None:
        self._load = load
        self._histograms = histograms

    def collect(self) -> Iterator[Metric]:
        snapshot = self._load()
        labels = [str(snapshot.get(k, "")) for k in _LABELS]
        for name, (doc, label, by_value) in self._histograms().items():
            family = HistogramMetricFamily(f"pdgate_shim_{name}", doc, labels=[*_LABELS, label])
            for value, hist in by_value.items():
                family.add_metric([*labels, value], hist.cumulative(), hist.sum)
            yield family
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


def metrics_registry(
    load: Callable[[], dict[str, Any]], histograms: Callable[[], Histograms] = dict
) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LoadCollector(load, histograms))
    return registry
