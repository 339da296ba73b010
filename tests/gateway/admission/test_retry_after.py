"""What a refused request is told to wait (gateway/admission/retry_after.py): the unit's
arithmetic and bounds. Each error path's figure is tested where it is made."""

from __future__ import annotations

import math

import pytest

from pdgate.gateway.admission.retry_after import Departures, RetryAfter


def test_the_figure_is_held_between_the_floor_and_the_ceiling() -> None:
    retry = RetryAfter(floor_s=0.5, ceiling_s=30.0, poll_s=2.0)
    assert retry.bounded(None) == retry.bounded(math.inf) == 0.5
    assert retry.bounded(0.1) == 0.5 and retry.bounded(99) == 30.0
    assert retry.bounded(1.2341) == 1.235  # up to the millisecond retry-after-ms carries
    assert retry.drain(30, 20.0) == 1.5
    assert retry.drain(-5, 20.0) == 0.5  # within reach already: the floor
    assert retry.drain(30, None) == retry.drain(30, 0.0) == 0.5  # no pace known
    assert retry.membership() == 2.0
    assert retry.elsewhere() == 0.5  # another gateway serves it at once
    with pytest.raises(ValueError, match="floor_s <= ceiling_s"):
        RetryAfter(floor_s=5, ceiling_s=1)


def test_departures_are_counted_over_the_time_since_the_first_in_the_window() -> None:
    """Departures every 0.2 s: 5 a second, slowed by a silence since the last one; those
    older than the window are forgotten, and with fewer than two there is no rate."""
    left = Departures(window_s=10.0, keep=64)
    assert left.per_s(100.0) is None
    left.left(100.0)
    assert left.per_s(100.5) is None  # one departure: no interval to go by
    for i in range(1, 11):
        left.left(100.0 + 0.2 * i)
    assert left.per_s(102.0) == pytest.approx(5.0)
    assert left.per_s(104.0) == pytest.approx(10 / 4.0)  # silent for two seconds since
    assert left.per_s(111.5) == pytest.approx(2 / 9.9)  # those of the last 10 s only
    assert left.per_s(112.5) is None  # all out of the window
    kept = Departures(window_s=10.0, keep=4)  # bounded: the last four only
    for i in range(100):
        kept.left(i * 0.1)
    assert kept.per_s(9.9) == pytest.approx(3 / 0.3)
