"""PrefillTimes: the prefill estimate behind early drops."""

from __future__ import annotations

import pytest

from pdgate.gateway.placement.prefill_time import PrefillTimes


def test_no_estimate_until_enough_samples() -> None:
    times = PrefillTimes(min_samples=4, quantile=0.0)
    for _ in range(3):
        times.record(100, 1.0)
        assert times.lower_bound_s(100) is None
        assert not times.hopeless(100, 0.0)
    times.record(100, 1.0)
    assert times.lower_bound_s(100) == pytest.approx(1.0)
    assert times.hopeless(100, 0.99) and not times.hopeless(100, 1.0)


def test_low_quantile_is_optimistic() -> None:
    # Ten rates 1..10 ms per char: the 10% quantile is the second smallest.
    times = PrefillTimes(min_samples=1, quantile=0.1)
    for ms in range(10, 0, -1):
        times.record(1000, ms)  # `ms` seconds for 1000 chars = `ms` ms per char
    assert times.lower_bound_s(1000) == pytest.approx(2.0)


def test_rates_are_kept_per_length_class() -> None:
    # Short prompts hit the prefix cache (fast per char), long ones do not: each length
    # class gets its own estimate, and a class without history borrows the overall one.
    times = PrefillTimes(min_samples=4, quantile=0.5)
    for _ in range(8):
        times.record(1_000, 0.01)  # 10 us per char
        times.record(32_000, 1.6)  # 50 us per char
    assert times.lower_bound_s(1_000) == pytest.approx(0.01)
    assert times.lower_bound_s(32_000) == pytest.approx(1.6)
    overall = times.lower_bound_s(200)  # no 128-255 char history: the whole window's median
    assert overall is not None and overall == pytest.approx(200 * 50e-6)


def test_windows_are_bounded_and_forget_old_rates() -> None:
    times = PrefillTimes(window=8, class_window=4, min_samples=4, quantile=1.0)
    for _ in range(8):
        times.record(10, 10.0)  # slow, then the cluster gets fast
    for _ in range(8):
        times.record(10, 0.1)
    assert len(times) == 8
    # Every slow sample left both windows: even the slowest rate kept is a fast one.
    assert times.lower_bound_s(10) == pytest.approx(0.1)


def test_nonsense_samples_are_ignored() -> None:
    times = PrefillTimes(min_samples=1)
    times.record(0, 1.0)
    times.record(10, -1.0)
    assert len(times) == 0
    with pytest.raises(ValueError, match="quantile"):
        PrefillTimes(quantile=1.5)


def test_the_hand_over_to_the_decode_counts_against_the_deadline() -> None:
    """A first token comes after the prefill *and* the KV's hand-over to the decode: a
    request with time for the first alone is dropped once the hand-over is known."""
    times = PrefillTimes(min_samples=4, quantile=0.5)
    for _ in range(4):
        times.record(1000, 0.3)  # 0.3 s for 1,000 characters
    assert not times.hopeless(1000, 0.35)
    for _ in range(3):
        times.record_handover(0.1)
    assert times.handover_s() == 0.0  # too few samples: not guessed
    assert not times.hopeless(1000, 0.35)
    times.record_handover(0.1)
    assert times.handover_s() == 0.1
    assert times.hopeless(1000, 0.35)
    assert not times.hopeless(1000, 0.45)
