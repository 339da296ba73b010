"""Percentiles and the success rule of the scheduling experiment."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdgate.loadtest.lib.stats import DROPPED, RequestResult, Spread, percentile, summarize


def _result(
    *,
    status: int = 200,
    ttft: float | None = 0.1,
    e2e: float = 0.5,
    completed: bool = True,
    deadline: float = 1.0,
    scenario: str = "chat",
) -> RequestResult:
    return RequestResult(scenario, deadline, status, ttft, e2e, completed)


@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(q: float) -> None:
    values = [0.3, 5.0, 1.2, 0.7, 2.2, 9.1, 0.05, 4.4, 3.3]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_edges() -> None:
    assert math.isnan(percentile([], 50))
    assert percentile([7.0], 0) == percentile([7.0], 99) == 7.0
    assert percentile([1.0, 2.0], 50) == 1.5
    with pytest.raises(ValueError, match="within"):
        percentile([1.0], 101)


def test_a_tpot_slo_is_judged_beside_the_ttft_deadline() -> None:
    """TPOT = (E2E - TTFT) / (tokens - 1) within the request's SLO, where it has one; a request
    of one token has no TPOT to judge."""
    slow = RequestResult("chat", 1.0, 200, 0.1, 2.0, True, tpot_s=0.15, tpot_slo_s=0.1)
    assert slow.ttft_met and not slow.tpot_met and not slow.success
    fast = RequestResult("chat", 1.0, 200, 0.1, 2.0, True, tpot_s=0.05, tpot_slo_s=0.1)
    assert fast.success
    assert RequestResult("chat", 1.0, 200, 0.1, 0.2, True, tpot_slo_s=0.1).success
    assert RequestResult("chat", 1.0, 200, 0.1, 2.0, True, tpot_s=0.15).success  # not judged
    late = RequestResult("chat", 1.0, 200, 1.5, 2.0, True, tpot_s=0.05, tpot_slo_s=0.1)
    assert late.tpot_met and not late.success
    s = summarize([slow, fast, late, _result(status=503, ttft=None, completed=False)], 1.0)
    assert s.success_rate == 0.25
    assert (s.ttft_attainment, s.tpot_attainment) == (0.5, 0.5)
    assert s.tpot_p50_s == pytest.approx(0.05) and s.tpot_p99_s == pytest.approx(0.148)


def test_success_needs_status_first_token_in_time_and_completion() -> None:
    assert _result().success
    assert _result(ttft=1.0, deadline=1.0).success  # "TTFT <= deadline"
    assert not _result(ttft=1.0001, deadline=1.0).success  # late first token
    assert not _result(status=503, ttft=None, completed=False).success  # gateway gave up
    assert not _result(completed=False).success  # in-band error or no [DONE]
    assert not _result(ttft=None).success
    assert not _result(status=0, ttft=None, completed=False).success  # connection failed


def test_summarize_counts_every_issued_request() -> None:
    rows = [
        _result(ttft=0.1, e2e=0.4),
        _result(ttft=0.3, e2e=0.6, scenario="doc", deadline=4.0),
        _result(ttft=1.5, e2e=2.0),  # late: a failure, but its latencies count
        _result(status=503, ttft=None, e2e=1.0, completed=False),
        _result(ttft=0.2, e2e=0.2, completed=False),  # errored mid-stream
    ]
    s = summarize(rows, window_s=2.0)
    assert s.requests == 5
    assert s.successes == 2
    assert s.success_rate == pytest.approx(0.4)
    assert s.goodput_rps == pytest.approx(1.0)
    assert s.throughput_rps == pytest.approx(1.5)  # three completed streams
    assert s.ttft_p50_s == pytest.approx(0.25)  # over the four that got a first token
    assert s.e2e_p50_s == pytest.approx(0.6)  # over the three completed
    assert s.status_counts == {200: 4, 503: 1}
    assert s.success_by_scenario == {"chat": 0.25, "doc": 1.0}


def test_summarize_empty_and_bad_window() -> None:
    s = summarize([], window_s=1.0)
    assert s.requests == 0
    assert math.isnan(s.success_rate)
    assert math.isnan(s.ttft_p99_s)
    with pytest.raises(ValueError, match="window_s"):
        summarize([], window_s=0)


def test_success_by_gateway() -> None:
    rows = [
        RequestResult("chat", 1.0, 200, 0.1, 0.5, True, gateway=0),
        RequestResult("chat", 1.0, 503, None, 1.0, False, gateway=0),
        RequestResult("chat", 1.0, 200, 0.1, 0.5, True, gateway=1),
    ]
    assert summarize(rows, 1.0).success_by_gateway == {0: 0.5, 1: 1.0}


def test_gateway_mix_and_where_its_failures_ended() -> None:
    """Gateway 0's users drew the failing scenario: its mix predicts its lower success, and
    its failures are told apart by their end (refused: no 200; late: a 200 past its
    deadline)."""
    ok = RequestResult("chat", 1.0, 200, 0.1, 0.5, True, gateway=0)
    rows = [
        RequestResult("doc", 4.0, 503, None, 1.0, False, gateway=0),
        RequestResult("doc", 4.0, 200, 4.5, 5.0, True, gateway=0),
        RequestResult("doc", 4.0, 200, 1.0, 2.0, True, gateway=0),
        RequestResult("doc", 4.0, 200, 1.0, 2.0, True, gateway=1),
        ok, ok, RequestResult("chat", 1.0, 200, 0.1, 0.5, True, gateway=1),
    ]  # fmt: skip
    s = summarize(rows, 1.0)
    assert s.success_by_scenario == {"chat": 1.0, "doc": 0.5}
    # gateway 0: three docs and two chats at 50% and 100%; gateway 1: one of each
    assert s.mix_by_gateway == {0: (3 * 0.5 + 2 * 1.0) / 5, 1: (0.5 + 1.0) / 2}
    assert s.success_by_gateway == {0: 3 / 5, 1: 1.0}
    assert s.refused_by_gateway == {0: 1, 1: 0}
    assert s.late_by_gateway == {0: 1, 1: 0}


def test_spread_over_seeds() -> None:
    s = Spread.of([0.97, 1.0, 0.94, 0.99, 0.98])
    assert (s.min, s.median, s.max, s.n) == (0.94, 0.98, 1.0, 5)
    assert Spread.of([2.0, 4.0]).median == 3.0  # even count: the middle two's mean
    assert s.as_dict() == {"min": 0.94, "median": 0.98, "max": 1.0}


def test_spread_leaves_out_what_was_not_measured() -> None:
    s = Spread.of([math.nan, 3.0, 1.0])
    assert (s.min, s.median, s.max, s.n) == (1.0, 2.0, 3.0, 2)
    empty = Spread.of([math.nan])
    assert empty.n == 0 and math.isnan(empty.median)


def test_success_by_tenant_dropped_and_offered_rate() -> None:
    rows = [
        RequestResult("chat", 1.0, 200, 0.1, 0.5, True, tenant="heavy"),
        RequestResult("chat", 1.0, 200, 0.1, 0.5, True, tenant="light"),
        RequestResult("chat", 1.0, DROPPED, None, 0.0, False, tenant="light"),
        RequestResult("chat", 1.0, 200, 0.1, 0.5, True),  # no tenant: not in the tally
    ]
    s = summarize(rows, 2.0)
    assert s.success_by_tenant == {"heavy": 1.0, "light": 0.5}
    assert s.dropped == 1 and s.success_rate == 0.75  # a dropped request is a failure
    assert s.offered_rps == 2.0  # every request issued, dropped included, per second
    assert summarize(rows[-1:], 1.0).success_by_tenant == {}
