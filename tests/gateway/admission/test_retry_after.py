"""What a refused request is told to wait (gateway/admission/retry_after.py): the unit's
arithmetic and bounds. Each error path's figure is tested where it is made."""

from __future__ import annotations

import math

import pytest

from pdgate.gateway.admission.retry_after import RetryAfter


def test_the_figure_is_held_between_the_floor_and_the_ceiling() -> None:
    retry = RetryAfter(floor_s=0.5, ceiling_s=30.0, poll_s=2.0)
    assert retry.bounded(None) == retry.bounded(math.inf) == 0.5
    assert retry.bounded(0.1) == 0.5 and retry.bounded(99) == 30.0
    assert retry.bounded(1.2341) == 1.235  # up to the millisecond retry-after-ms carries
    assert retry.drain(30, 20.0) == 1.5
    assert retry.drain(-5, 20.0) == 0.5  # within reach already: the floor
    assert retry.drain(30, None) == retry.drain(30, 0.0) == 0.5  # no pace known
    assert retry.membership() == 2.0
    with pytest.raises(ValueError, match="floor_s <= ceiling_s"):
        RetryAfter(floor_s=5, ceiling_s=1)
