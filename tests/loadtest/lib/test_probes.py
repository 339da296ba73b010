"""Reading the gateway's Prometheus counters, taking window deltas, and the prefills' KV holds."""

from __future__ import annotations

import math

from pdgate.loadtest.lib.probes import (
    ATTEMPT_KEYS,
    HoldSnapshot,
    bucket_quantile,
    delta,
    histogram_buckets,
    holds_of,
    parse_gateway_metrics,
)
from pdgate.loadtest.lib.stats import RequestResult, summarize
from pdgate.loadtest.scheduling.runner import Holds, Point

_EXPOSITION = """\
# HELP pdgate_prefill_attempts_total Prefill calls by result
# TYPE pdgate_prefill_attempts_total counter
pdgate_prefill_attempts_total{result="accepted"} 120.0
pdgate_prefill_attempts_total{result="rejected"} 33.0
# HELP pdgate_prefill_abandoned_outcomes_total Prefill calls released unanswered
# TYPE pdgate_prefill_abandoned_outcomes_total counter
pdgate_prefill_abandoned_outcomes_total{result="abandoned",outcome="admitted"} 5.0
pdgate_prefill_abandoned_outcomes_total{result="deadline",outcome="admitted"} 2.0
pdgate_prefill_abandoned_outcomes_total{result="abandoned",outcome="unseen"} 1.0
# HELP pdgate_requests_total Completed client requests by outcome
# TYPE pdgate_requests_total counter
pdgate_requests_total{outcome="ok"} 118.0
pdgate_requests_total{outcome="deadline_exceeded"} 2.0
# HELP pdgate_prefill_rejections 429s a request met before a prefill accepted it
# TYPE pdgate_prefill_rejections histogram
pdgate_prefill_rejections_bucket{le="0.0"} 100.0
pdgate_prefill_rejections_bucket{le="+Inf"} 120.0
pdgate_prefill_rejections_count 120.0
pdgate_prefill_rejections_sum 33.0
# HELP pdgate_early_drops_total Queued requests answered 503 before any prefill call
# TYPE pdgate_early_drops_total counter
pdgate_early_drops_total 4.0
# HELP pdgate_fleet_yields_total Freed slots left to another gateway
# TYPE pdgate_fleet_yields_total counter
pdgate_fleet_yields_total 7.0
# HELP pdgate_queue_sheds_total Requests refused on arrival
# TYPE pdgate_queue_sheds_total counter
pdgate_queue_sheds_total{reason="drain"} 3.0
# HELP pdgate_ttft_seconds Request arrival to first byte relayed
# TYPE pdgate_ttft_seconds histogram
pdgate_ttft_seconds_count 118.0
pdgate_ttft_seconds_sum 20.0
"""


def test_parse_gateway_metrics_picks_the_counters_of_interest() -> None:
    got = parse_gateway_metrics(_EXPOSITION)
    assert got == {
        "attempts_accepted": 120.0,
        "attempts_rejected": 33.0,
        "abandoned_admitted": 7.0,
        "abandoned_unseen": 1.0,
        "outcome_ok": 118.0,
        "outcome_deadline_exceeded": 2.0,
        "prefill_rejections_count": 120.0,
        "prefill_rejections_sum": 33.0,
        "early_drops": 4.0,
        "fleet_yields": 7.0,
        "queue_sheds_drain": 3.0,
    }


def test_delta_treats_new_keys_as_starting_at_zero() -> None:
    assert delta({"a": 1.0, "b": 5.0}, {"a": 4.0, "b": 5.0, "c": 2.0}) == {
        "a": 3.0,
        "b": 0.0,
        "c": 2.0,
    }


def test_retries_per_request_is_unknown_without_a_gateways_metrics() -> None:
    ok = RequestResult("chat", 1.0, 200, 0.1, 0.5, True)
    summary = summarize([ok, ok], 1.0)

    def point(counters: dict[str, float]) -> Point:
        return Point("m", 2, summary, counters, 0.0, 0.0, 0.0, {}, 1.0)

    # pdgate in front: a counter that never moved is a real zero.
    zeros = dict.fromkeys(ATTEMPT_KEYS, 0.0)
    assert point(delta(zeros, zeros)).retries_per_request == 0.0
    assert point({"attempts_rejected": 0.0}).retries_per_request == 0.0
    assert point({"attempts_rejected": 3.0}).retries_per_request == 1.5
    # Another router in front: nothing was read, so nothing is known.
    assert math.isnan(point({"shim_rejected": 7.0}).retries_per_request)


def test_holds_are_the_longest_and_the_sums_over_prefills() -> None:
    loads = [
        {"kv_hold_max_s": 0.4, "kv_hold_over_5s": 0, "kv_held": 1},
        {"kv_hold_max_s": 31.0, "kv_hold_over_5s": 2, "kv_held": 0},
    ]
    assert holds_of(loads) == HoldSnapshot(max_s=31.0, over_5s=2.0, held=1.0)


def test_holds_not_reported_are_unknown_not_zero() -> None:
    # An older shim (or a stock server) has no hold keys: n/a, never a reassuring 0.
    old = holds_of([{"kv_held": 0}, {"kv_held": 2}])
    assert math.isnan(old.max_s) and math.isnan(old.over_5s) and old.held == 2.0
    # One prefill lacking a key makes the whole figure unknown: a part is not a measurement.
    mixed = holds_of([{"kv_hold_max_s": 1.0}, {}])
    assert math.isnan(mixed.max_s)
    assert math.isnan(holds_of([]).max_s)


def test_a_points_holds_are_the_growth_over_the_point() -> None:
    before = HoldSnapshot(max_s=0.5, over_5s=3.0, held=0.0)
    after = HoldSnapshot(max_s=30.1, over_5s=5.0, held=2.0)
    assert Holds.between(before, after) == Holds(max_s=30.1, over_5s=2.0, stranded=2.0)


def test_each_gateways_drops_and_yields_are_kept_apart() -> None:
    """Summed for the run, and per gateway where there are several: a gateway left behind
    shows in its own counters."""
    ok = RequestResult("chat", 1.0, 200, 0.1, 0.5, True)
    counters = {
        "early_drops": 9.0,
        "gw0_early_drops": 1.0,
        "gw1_early_drops": 8.0,
        "gw0_fleet_yields": 2.0,
        "gw1_fleet_yields": 30.0,
        "gw1_attempts_x": 5.0,  # not a per-gateway counter
    }
    point = Point("m", 2, summarize([ok], 1.0), counters, 0.0, 0.0, 0.0, {}, 1.0)
    assert point.per_gateway() == {
        "early_drops_gateway0": 1.0,
        "early_drops_gateway1": 8.0,
        "fleet_yields_gateway0": 2.0,
        "fleet_yields_gateway1": 30.0,
    }
    alone = Point("m", 1, summarize([ok], 1.0), {"gw0_early_drops": 1.0}, 0.0, 0.0, 0.0, {}, 1.0)
    assert alone.per_gateway() == {}


def test_histogram_buckets_reads_one_histogram_cumulatively() -> None:
    assert histogram_buckets(_EXPOSITION, "pdgate_prefill_rejections") == {
        0.0: 100.0,
        math.inf: 120.0,
    }
    assert histogram_buckets(_EXPOSITION, "pdgate_event_loop_lag_seconds") == {}


def test_the_loop_lag_quantile_is_the_bound_of_its_bucket() -> None:
    buckets = [(0.005, 90.0), (0.1, 99.0), (float("inf"), 100.0)]
    assert bucket_quantile(buckets, 0.5) == 0.005
    assert bucket_quantile(buckets, 0.99) == 0.1
    assert bucket_quantile(buckets, 0.999) == float("inf")
    assert math.isnan(bucket_quantile([], 0.99))
    assert math.isnan(bucket_quantile([(float("inf"), 0.0)], 0.99))


def test_a_points_sheds_by_reason_are_zero_unless_unmeasured() -> None:
    """Summed over the gateways; a reason nobody was shed for has no sample (0); behind
    another router there are no gateway metrics at all (NaN)."""
    ok = RequestResult("chat", 1.0, 200, 0.1, 0.5, True)
    served = {"outcome_ok": 10.0, "early_drops": 3.0, "queue_sheds_drain": 2.0}
    point = Point("m", 1, summarize([ok], 1.0), served, 0.0, 0.0, 0.0, {}, 1.0)
    assert point.sheds() == {"early_drops": 3.0, "queue_sheds_drain": 2.0, "queue_sheds_full": 0.0}
    behind = Point("m", 1, summarize([ok], 1.0), {}, 0.0, 0.0, 0.0, {}, 1.0)
    assert all(math.isnan(v) for v in behind.sheds().values())
