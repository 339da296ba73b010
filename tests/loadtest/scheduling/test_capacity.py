"""Capacity from a sweep: the plateau rule, the peak, one user's demand, and loads as a
fraction of capacity (capacity.py)."""

from __future__ import annotations

import math

import pytest

from pdgate.loadtest.scheduling.capacity import (
    SWEEP_MULTIPLES,
    Capacity,
    CapacityPlan,
    from_sweep,
    plateaued,
    sweep_users,
)


def test_plateau_needs_patience_points_without_a_real_rise() -> None:
    assert not plateaued([5.0, 9.0], gain=0.03, patience=2)  # too few points
    assert not plateaued([5.0, 9.0, 12.0, 15.0], gain=0.03, patience=2)  # still rising
    assert plateaued([5.0, 9.0, 12.0, 12.2, 12.1], gain=0.03, patience=2)  # +1.7%, then less
    # One rise above the gain inside the last points restarts the count.
    assert not plateaued([5.0, 9.0, 12.0, 12.1, 13.0], gain=0.03, patience=2)
    # A collapse past the peak is a plateau too: goodput no longer rises.
    assert plateaued([5.0, 12.0, 7.0, 3.0], gain=0.03, patience=2)


def test_capacity_from_a_sweep() -> None:
    # The shape of the committed full run: demand per user falls as users wait.
    users = [6, 12, 24, 36, 48, 60, 72]
    goodput = [3.9, 7.2, 12.8, 16.7, 17.3, 17.1, 17.0]
    cap = from_sweep(users, goodput, mode="least_sse", gain=0.03, patience=2)
    assert (cap.rps, cap.users, cap.mode, cap.source) == (17.3, 48, "least_sse", "measured")
    assert cap.user_rps == pytest.approx(0.65)  # the lightest point: 3.9 / 6
    assert cap.plateau
    # Offered load = users x user_rps; an open loop at kA sends exactly that.
    assert cap.rate(12) == pytest.approx(7.8)
    assert cap.load_fraction(12) == pytest.approx(7.8 / 17.3)
    rising = from_sweep(users[:3], goodput[:3], mode="m", gain=0.03, patience=2)
    assert not rising.plateau and rising.rps == 12.8
    with pytest.raises(ValueError, match="served nothing"):
        from_sweep([2, 4], [0.0, math.nan], mode="m", gain=0.03, patience=2)


def test_sweep_users_and_plan_checks() -> None:
    assert sweep_users(CapacityPlan(), 12) == sorted({round(m * 12) for m in SWEEP_MULTIPLES})
    assert sweep_users(CapacityPlan(), 1)[0] == 1  # never 0 users
    assert sweep_users(CapacityPlan(users=(8, 4, 8)), 12) == [4, 8]
    with pytest.raises(ValueError, match="fixed"):
        CapacityPlan(how="fixed")
    with pytest.raises(ValueError, match="positive"):
        Capacity(rps=0.0, user_rps=1.0)
