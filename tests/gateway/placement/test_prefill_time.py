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


# -- hardware types: each prefill estimated at its own type's pace -----------------------


def _two_types(n: int = 8) -> PrefillTimes:
    """An H100 at 1 ms a character and an L20 at 4 ms, `n` samples each."""
    times = PrefillTimes(min_samples=4, quantile=0.0)
    for _ in range(n):
        times.record(1000, 1.0, hardware="h100")
        times.record(1000, 4.0, hardware="l20")
    return times


def test_each_type_is_estimated_at_its_own_pace_once_it_has_samples() -> None:
    times = _two_types()
    assert times.estimate_s(1000, hardware="h100") == pytest.approx(1.0)
    assert times.estimate_s(1000, hardware="l20") == pytest.approx(4.0)
    assert times.rate_s(hardware="l20") == pytest.approx(0.004)
    # A type never seen, or undeclared, gets the fleet's pooled estimate.
    pooled = times.estimate_s(1000)
    assert pooled is not None and 1.0 <= pooled <= 4.0
    assert times.estimate_s(1000, hardware="a100") == pooled
    assert times.upper_bound_s(1000, 0.99, hardware="l20") == pytest.approx(4.0)


def test_a_type_with_too_few_samples_falls_back_to_the_pool() -> None:
    times = _two_types(n=8)
    for _ in range(3):
        times.record(1000, 9.0, hardware="a100")
    assert times.estimate_s(1000, hardware="a100") == times.estimate_s(1000)
    assert set(times.speeds()) == {"h100", "l20"}


def test_speeds_are_relative_and_keep_the_types_ratio() -> None:
    speeds = _two_types().speeds()
    assert speeds == {"h100": 1.0, "l20": pytest.approx(0.25)}  # against the fastest


def test_one_type_or_none_declared_gives_no_speeds() -> None:
    one = PrefillTimes(min_samples=4)
    undeclared = PrefillTimes(min_samples=4)
    for i in range(20):
        one.record(1000, 1.0 + i / 10, hardware="h100")
        undeclared.record(1000, 1.0 + i / 10)
    assert one.speeds() == {} and undeclared.speeds() == {}
    # ... and every estimate is the pooled one, as before types were known.
    assert one.estimate_s(1000, hardware="h100") is not None
    assert one.lower_bound_s(1000) == undeclared.lower_bound_s(1000)


def test_early_drop_judges_by_the_fastest_type() -> None:
    """A request the H100 can still make is not dropped because the pool is slower."""
    times = PrefillTimes(min_samples=4, quantile=0.5)
    for _ in range(4):
        times.record(1000, 1.0, hardware="h100")
    for _ in range(12):
        times.record(1000, 4.0, hardware="l20")
    assert times.estimate_s(1000) == pytest.approx(4.0)  # the pool's median: the L20's
    assert times.lower_bound_s(1000) == pytest.approx(1.0)
    assert not times.hopeless(1000, 1.5) and times.hopeless(1000, 0.5)


def test_shared_samples_carry_their_type_and_types_are_bounded() -> None:
    here, there = _two_types(), PrefillTimes(min_samples=4, quantile=0.0)
    for chars, seconds, hardware in here.take_new():
        there.add_shared(chars, seconds, hardware)
    assert there.speeds() == here.speeds()
    many = PrefillTimes(min_samples=1)
    for i in range(100):
        many.record(1000, 1.0 + i, hardware=f"gpu{i}")
    assert len(many.speeds()) == 16  # the rest count in the pool only
