"""Prometheus metrics, on a per-app registry (no process-global state).

Label values are bounded: outcomes, roles and results are fixed sets; groups and instances
come from the registry (bounded by `max_instances`), never from free client input (a client's
group header is checked against the registry's groups first). Per-instance series are read
from the tracker at scrape time, so departed instances simply stop being reported.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

# Time to first token of LLM serving: tens of ms to seconds, finest around the usual TTFT
# targets (0.2-2 s), up to the longest deadlines.
_TTFT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1, 1.5, 2, 3, 5, 7.5, 10, 20, 30, 60,
)  # fmt: skip
# Inter-token latency: a decode step is 5-50 ms on GPUs; long gaps mean trouble.
_ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5,
)  # fmt: skip

# Event-loop lag: a healthy loop runs a timer within a millisecond or two; 50 ms is already
# felt by every stream the gateway relays.
_LOOP_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

ANY_GROUP = "*"  # the group label of a request that did not name one

_M = TypeVar("_M", bound=Counter)


class Labelled(Generic[_M]):
    """A labelled prometheus_client metric whose children are cached by label values.

    prometheus_client's ``labels()`` converts and checks the values and takes a lock on every
    call (0.9 us; four calls a request), where a cached child is a dict lookup. The cache holds
    what the metric itself keeps (it never forgets a child either), so it is bounded as the
    label values are."""

    __slots__ = ("_children", "metric")

    def __init__(self, metric: _M) -> None:
        self.metric = metric
        self._children: dict[tuple[str, ...], _M] = {}

    def labels(self, *values: str) -> _M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child


class GatewayMetrics:
    def __init__(
        self,
        totals: Callable[[], tuple[int, int]],
        pending: Callable[[], int],
        instances: Callable[[], Iterable[Mapping[str, Any]]] = tuple,
        ratio: Callable[[], Iterable[Any]] = tuple,
        fleet: Callable[[], tuple[Mapping[str, int], Mapping[str, float]]] | None = None,
        queues: Callable[[], Iterable[Mapping[str, Any]]] = tuple,
        decode_waiting: Callable[[], int] = lambda: 0,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry

        def counter(name: str, documentation: str, labels: Sequence[str]) -> Labelled[Counter]:
            return Labelled(Counter(name, documentation, labels, registry=r))

        def histogram(
            name: str, documentation: str, buckets: Iterable[float], labels: Sequence[str] = ()
        ) -> LoopHistogram:
            metric = LoopHistogram(name, documentation, buckets, labels)
            r.register(metric)
            return metric

        self.requests = counter(
            "pdgate_requests",
            "Completed client requests by outcome and scenario group ('*': any group)",
            ["outcome", "group"],
        )
        self.side_requests = counter(
            "pdgate_side_requests",
            "Completed side-endpoint requests (/v1/embeddings, /tokenize, ...) by path, "
            "outcome and scenario group ('*': any group)",
            ["endpoint", "outcome", "group"],
        )
        self.prefill_attempts = counter(
            "pdgate_prefill_attempts", "Prefill calls by result", ["result"]
        )
        self.prefill_abandoned_outcomes = counter(
            "pdgate_prefill_abandoned_outcomes",
            "Prefill calls released unanswered (result: abandoned, deadline, failed), by "
            "what the prefill said it did with them when released: admitted, rejected, "
            "unseen (neither, and never will), unknown (it did not say)",
            ["result", "outcome"],
        )
        self.early_drops = Counter(
            "pdgate_early_drops",
            "Queued requests answered 503 before any prefill call: even an optimistic prefill "
            "would have ended past their deadline",
            registry=r,
        )
        self.prefix_cached_tokens = counter(
            "pdgate_prefix_cached_tokens",
            "Prompt tokens of prefill answers found in the engine's prefix cache, as the "
            "KV-event index predicted when it sent the prompt (predicted) and as the "
            "engine's answer reported (reported); only prefills that publish KV events "
            "and report cached tokens",
            ["source"],
        )
        self.prefix_predictions = counter(
            "pdgate_prefix_predictions",
            "Prefill answers by how the KV-event index's predicted cached tokens compare "
            "with what the engine reported: exact, over (predicted more), under",
            ["outcome"],
        )
        self.ejections = counter(
            "pdgate_ejections",
            "Instances ejected after consecutive failures (outlier ejection)",
            ["role"],
        )
        self.retry_budget_exhausted = Counter(
            "pdgate_retry_budget_exhausted",
            "Failover retries refused because the retry budget was spent",
            registry=r,
        )
        self.decode_attempts = counter(
            "pdgate_decode_attempts", "Decode calls by result", ["result"]
        )
        self.fleet_yields = Counter(
            "pdgate_fleet_yields",
            "Times this gateway left a freed prefill slot to a more urgent request queued at "
            "another gateway (the fleet's deadline order, fleet_window_s)",
            registry=r,
        )
        self.queue_sheds = counter(
            "pdgate_queue_sheds",
            "Requests refused on arrival at a queue, by reason: full (503), over_share "
            "(429, the tenant holds its share), drain (503, the queue's recent pace would "
            "not reach it before its deadline)",
            ["reason"],
        )
        self.queue_places = counter(
            "pdgate_queue_places",
            "Places in a queue kept for refused requests (kept) and taken back by their "
            "retries (taken): the retry goes where its first try stood",
            ["outcome"],
        )
        self.migrations = counter(
            "pdgate_migrations",
            "Streams continued on another decode after theirs broke mid-stream (prompt + "
            "tokens already sent re-submitted), by how it broke: lost (connection), error "
            "(in-band error event), truncated (ended without [DONE])",
            ["reason"],
        )
        self.decode_failovers = counter(
            "pdgate_decode_failovers",
            "Requests placed again, prefill included, after their decode failed before its "
            "first event, by how: status (an error status), lost, error, truncated",
            ["reason"],
        )
        self.ttft = histogram(
            "pdgate_ttft_seconds",
            "Request arrival to the first token relayed, by scenario group",
            _TTFT_BUCKETS,
            ["group"],
        )
        self.itl = histogram(
            "pdgate_inter_token_seconds",
            "Gaps between successive chunks of a relayed stream (inter-token latency)",
            _ITL_BUCKETS,
        )
        self.placement = histogram(
            "pdgate_placement_seconds",
            "Request arrival to a decode accepting it (queueing + retries + prefill)",
            _TTFT_BUCKETS,
        )
        self.prefill_rejections = histogram(
            "pdgate_prefill_rejections",
            "429s a request met before a prefill accepted it",
            (0, 1, 2, 4, 8, 16, 32, 64),
        )
        self.loop_lag = histogram(
            "pdgate_event_loop_lag_seconds",
            "How much later than asked the gateway's event loop ran a periodic timer "
            "(loop_lag_interval_s): its saturation as every request feels it",
            _LOOP_LAG_BUCKETS,
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
        Gauge(
            "pdgate_decode_waiting",
            "Prefilled requests waiting for a decode slot (their queues hold their prefills)",
            registry=r,
        ).set_function(lambda: float(decode_waiting()))
        r.register(_InstanceCollector(instances))
        r.register(_RatioCollector(ratio))
        r.register(_QueueCollector(queues))
        if fleet is not None:
            r.register(_FleetCollector(fleet))

    def abandoned_outcome(self, result: str, admission: str | None) -> None:
        """A prefill call released unanswered (`result`), and what the prefill said it did
        with it (None: it did not say)."""
        self.prefill_abandoned_outcomes.labels(result, admission or "unknown").inc()


class LoopHistogram(Collector):
    """A histogram that only the event loop's thread observes and scrapes: no lock, one bisect
    and two additions an observation. The relay observes one for every relayed chunk, the
    TTFT, placement and rejection ones once a request; prometheus_client's `Histogram` takes
    a lock and costs several times as much an observation. With `labelnames`, `labels()`
    gives a child per label values, as prometheus_client's does (bounded as the label values
    are)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        buckets: Iterable[float],
        labelnames: Sequence[str] = (),
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._labelnames = tuple(labelnames)
        self._bounds = sorted(float(b) for b in buckets)
        self._children: dict[tuple[str, ...], _LoopSeries] = {}
        self._series = None if labelnames else _LoopSeries(self._bounds)

    def observe(self, value: float) -> None:
        series = self._series
        if series is None:
            raise ValueError(f"{self._name} has labels: observe a child of labels()")
        # The series' observe, inline: this runs for every relayed chunk.
        series._counts[bisect_left(self._bounds, value)] += 1
        series.sum += value

    def labels(self, *values: str) -> _LoopSeries:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self._labelnames):
                raise ValueError(f"{self._name} takes labels {self._labelnames}")
            child = self._children[values] = _LoopSeries(self._bounds)
        return child

    def describe(self) -> Iterable[Any]:
        return [HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)]

    def collect(self) -> Iterator[HistogramMetricFamily]:
        if self._series is not None:
            yield HistogramMetricFamily(
                self._name,
                self._documentation,
                buckets=self._series.buckets(),
                sum_value=self._series.sum,
            )
            return
        family = HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)
        for values, series in self._children.items():
            family.add_metric(list(values), series.buckets(), series.sum)
        yield family


class _LoopSeries:
    """One series of a `LoopHistogram`."""

    __slots__ = ("_bounds", "_counts", "sum")

    def __init__(self, bounds: list[float]) -> None:
        self._bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound belongs to that bound's bucket (le = <=).
        self._counts[bisect_left(self._bounds, value)] += 1
        self.sum += value

    def buckets(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        total = 0
        for bound, count in zip(self._bounds, self._counts, strict=False):
            total += count
            out.append((repr(bound), float(total)))  # as prometheus_client: 1 -> "1.0"
        out.append(("+Inf", float(total + self._counts[-1])))
        return out


# Per-instance series: (name, help, the tracker row's field); the flags are booleans there.
_INSTANCE_GAUGES = (
    ("open_streams", "Open client streams through the instance, whole fleet", "fleet_open_streams"),
    (
        "inflight",
        "Requests at the instance, whole fleet (prefill: until KV taken)",
        "fleet_inflight",
    ),
    (
        "computing",
        "Prefill calls the instance has not answered yet, whole fleet",
        "fleet_computing",
    ),
    ("capacity", "Slots the instance declares", "capacity"),
    ("ejected", "1 while the instance is ejected as an outlier", "ejected"),
    ("busy", "1 while the instance is skipped after a 429", "busy"),
    ("speed", "Prefill speed against the fastest hardware type (1: alike or unknown)", "speed"),
)
_INSTANCE_COUNTERS = (
    ("accepted", "Calls this gateway sent to the instance", "accepted"),
    ("rejected", "429s from the instance to this gateway", "rejected"),
    ("failed", "Failed calls to the instance from this gateway", "failed"),
)


class _InstanceCollector(Collector):
    """Per-instance series from the tracker, at scrape time (bounded by membership)."""

    def __init__(self, rows: Callable[[], Iterable[Mapping[str, Any]]]) -> None:
        self._rows = rows

    def describe(self) -> Iterable[Any]:
        return []  # the series come and go with the instances

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["instance", "role", "group"]
        families: list[tuple[GaugeMetricFamily | CounterMetricFamily, str]] = [
            (kind(f"pdgate_instance_{name}", text, labels=labels), field)
            for kind, table in (
                (GaugeMetricFamily, _INSTANCE_GAUGES),
                (CounterMetricFamily, _INSTANCE_COUNTERS),
            )
            for name, text, field in table
        ]
        for row in self._rows():
            values = [str(row["id"]), str(row["role"]), str(row["group"])]
            for family, field in families:
                family.add_metric(values, float(row[field]))
        for family, _ in families:
            yield family


class _QueueCollector(Collector):
    """Per queue, how drain admission judges arrivals now and the retries it awaits
    (`Dispatcher.describe_queues`)."""

    def __init__(self, rows: Callable[[], Iterable[Mapping[str, Any]]]) -> None:
        self._rows = rows

    def describe(self) -> Iterable[Any]:
        return []  # the series come and go with the queues

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["model", "group", "role"]
        pace = GaugeMetricFamily(
            "pdgate_queue_drain_pace",
            "Grants a second drain admission counts on (absent: no pace yet)",
            labels=labels,
        )
        arrivals = GaugeMetricFamily(
            "pdgate_queue_arrival_rate", "Requests a second arriving at the queue", labels=labels
        )
        headroom = GaugeMetricFamily(
            "pdgate_queue_headroom",
            "Fraction of the pace's reach drain admission holds back now",
            labels=labels,
        )
        awaited = GaugeMetricFamily(
            "pdgate_queue_retries_awaited",
            "Refused requests told to come back and not yet due (their Retry-After counts "
            "them ahead of the next one refused)",
            labels=labels,
        )
        as_told = GaugeMetricFamily(
            "pdgate_queue_retries_as_told",
            "Share of the queue's refused requests that came back when told (recent ones "
            "weigh most)",
            labels=labels,
        )
        for row in self._rows():
            values = [str(row["model"]), str(row["group"] or ""), str(row["role"])]
            if row["drain_pace_per_s"] is not None:
                pace.add_metric(values, float(row["drain_pace_per_s"]))
            arrivals.add_metric(values, float(row["arrivals_per_s"]))
            headroom.add_metric(values, float(row["headroom"]))
            awaited.add_metric(values, float(row["retries_awaited"]))
            as_told.add_metric(values, float(row["retries_as_told"]))
        yield from (pace, arrivals, headroom, awaited, as_told)


class _FleetCollector(Collector):
    """This gateway's calls to the fleet's shared store (Redis), by operation."""

    def __init__(self, calls: Callable[[], tuple[Mapping[str, int], Mapping[str, float]]]) -> None:
        self._calls = calls

    def describe(self) -> Iterable[Any]:
        return []

    def collect(self) -> Iterator[CounterMetricFamily]:
        counts, seconds = self._calls()
        calls = CounterMetricFamily(
            "pdgate_fleet_calls", "Calls to the fleet's shared store by operation", labels=["op"]
        )
        took = CounterMetricFamily(
            "pdgate_fleet_call_seconds",
            "Seconds this gateway waited for the fleet's shared store, by operation",
            labels=["op"],
        )
        for op, n in counts.items():
            calls.add_metric([op], float(n))
            took.add_metric([op], float(seconds.get(op, 0.0)))
        yield calls
        yield took


class _RatioCollector(Collector):
    """P/D ratio advice (gateway/observe/ratio.py) as gauges an autoscaler can act on. The desired
    counts are this gateway's share of the traffic: sum them over the gateways."""

    def __init__(self, advice: Callable[[], Iterable[Any]]) -> None:
        self._advice = advice

    def describe(self) -> Iterable[Any]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        desired = GaugeMetricFamily(
            "pdgate_ratio_desired_instances",
            "Instances of each role this gateway's traffic needs at the target utilization "
            "(eq. 1 of P/D-Serve; fractional: sum over gateways)",
            labels=["group", "role"],
        )
        current = GaugeMetricFamily(
            "pdgate_ratio_current_instances",
            "Ready instances of each role",
            labels=["group", "role"],
        )
        capacity = GaugeMetricFamily(
            "pdgate_ratio_capacity_rps",
            "Requests/s each role of the group can serve (n b / T)",
            labels=["group", "role"],
        )
        demand = GaugeMetricFamily(
            "pdgate_ratio_demand_rps",
            "Requests/s this gateway sends to the group",
            labels=["group"],
        )
        advised = GaugeMetricFamily(
            "pdgate_ratio_advised", "Advised prefill:decode instance ratio", labels=["group"]
        )
        reason = GaugeMetricFamily(
            "pdgate_ratio_bottleneck",
            "1 for the group's bottleneck (prefill, decode, balanced, insufficient_data)",
            labels=["group", "bottleneck"],
        )
        for a in self._advice():
            for role, want, have, cap in (
                ("prefill", a.desired_prefills, a.prefills, a.prefill_capacity_rps),
                ("decode", a.desired_decodes, a.decodes, a.decode_capacity_rps),
            ):
                current.add_metric([a.group, role], float(have))
                if want is not None:
                    desired.add_metric([a.group, role], float(want))
                if cap is not None:
                    capacity.add_metric([a.group, role], float(cap))
            demand.add_metric([a.group], a.demand_rps)
            if a.ratio is not None:
                advised.add_metric([a.group], a.ratio)
            reason.add_metric([a.group, a.bottleneck], 1.0)
        yield from (desired, current, capacity, demand, advised, reason)
