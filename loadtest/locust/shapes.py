"""Load shapes as pure functions of elapsed time: how many users should be running at ``t``.

Free of Locust (shape_classes.py wraps them in ``LoadTestShape`` classes) so they
can be tested without it. Each returns the target user count, or None once the run is over.

* ``step``: ``step_users`` more users every ``step_s`` up to ``max_users`` (where a
  service's knee shows).
* ``surge``: a steady base load, a sudden burst to ``peak_users`` for a fifth of the run,
  then back to the base (the gateway must queue or reject, then recover).
* ``tidal``: one day of traffic compressed into ``duration_s``: quiet at night, a morning
  ramp, a midday plateau with a lunch dip and an evening shoulder, the shape of P/D-Serve's
  Fig. 13b (tidal daily load of a production service). The hourly levels below are our
  reading of that shape, not the paper's data.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TIDAL_HOURLY", "ShapeParams", "step_users", "surge_users", "tidal_users"]

# Relative load per hour of the day, 0 (quietest) to 1 (busiest), hours 0..23.
TIDAL_HOURLY: tuple[float, ...] = (
    0.15, 0.10, 0.05, 0.05, 0.05, 0.10, 0.20, 0.40, 0.65, 0.85, 1.00, 0.95,
    0.80, 0.75, 0.90, 1.00, 0.95, 0.85, 0.70, 0.65, 0.60, 0.50, 0.35, 0.20,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class ShapeParams:
    duration_s: float = 60.0
    max_users: int = 32  # the peak, for every shape
    min_users: int = 1  # base load (surge) and night floor (tidal)
    step_users: int = 4
    step_s: float = 10.0

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.step_s <= 0:
            raise ValueError("duration_s and step_s must be positive")
        if not 0 <= self.min_users <= self.max_users or self.max_users < 1 or self.step_users < 1:
            raise ValueError("need 0 <= min_users <= max_users, max_users >= 1, step_users >= 1")


def step_users(t: float, p: ShapeParams) -> int | None:
    if t >= p.duration_s:
        return None
    return min(p.max_users, p.step_users * (int(t // p.step_s) + 1))


def surge_users(t: float, p: ShapeParams) -> int | None:
    if t >= p.duration_s:
        return None
    start = 0.4 * p.duration_s
    return p.max_users if start <= t < start + 0.2 * p.duration_s else p.min_users


def tidal_users(t: float, p: ShapeParams) -> int | None:
    if t >= p.duration_s:
        return None
    hour = 24.0 * t / p.duration_s
    i = int(hour) % 24
    frac = hour - int(hour)
    # Linear between hourly levels, wrapping midnight to midnight.
    level = TIDAL_HOURLY[i] + (TIDAL_HOURLY[(i + 1) % 24] - TIDAL_HOURLY[i]) * frac
    return max(p.min_users, round(p.min_users + (p.max_users - p.min_users) * level))
