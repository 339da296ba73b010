"""The cluster's capacity, and loads as a fraction of it, so that a load level says how
close the cluster is to the most it can serve.

**Capacity** = the maximum goodput (successful requests per second) of the cluster under
the reference mode (`CapacityPlan.mode`, default ``least_sse``: on-demand forwarding),
found by a sweep: closed-loop user counts in ascending order on one fresh cluster (by
default ``SWEEP_MULTIPLES`` x A), each a calibration window long, until goodput stops
rising: `CapacityPlan.patience` points in a row that do not beat the best so far by more
than `CapacityPlan.gain` (relative). The capacity is the best goodput seen; if the sweep
ends while goodput still rises, it is flagged (``plateau: false``: capacity may be higher).

**Offered load** of a closed-loop level = users x `Capacity.user_rps`, the demand of one
user nobody makes wait: the sweep's highest goodput per user (its lightest points). So
``load_fraction = users x user_rps / capacity``: 1.0 is as much demand as the cluster can
serve at best. An open-loop level of k x A users is sent at exactly that offered rate,
``k x A x user_rps`` requests/s, so closed and open rows of one level are the same load.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "SWEEP_MULTIPLES",
    "Capacity",
    "CapacityPlan",
    "from_sweep",
    "plateaued",
    "sweep_users",
]

# The default sweep, in multiples of A: from light load (where user_rps is read) to well
# past the 4A of the main run.
SWEEP_MULTIPLES = (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0)


@dataclass(frozen=True, slots=True)
class Capacity:
    rps: float  # maximum goodput, successful requests/s
    user_rps: float  # one unimpeded closed-loop user's demand, requests/s
    source: str = "fixed"  # "measured" (a sweep of this run) or "fixed" (given)
    users: int = 0  # measured: the user count at which goodput peaked
    mode: str = ""  # measured: the mode swept
    plateau: bool = True  # measured: goodput stopped rising within the sweep

    def __post_init__(self) -> None:
        if not (self.rps > 0 and self.user_rps > 0):
            raise ValueError("capacity and per-user demand must be positive")

    def rate(self, users: float) -> float:
        """The offered load of `users` closed-loop users, requests/s."""
        return users * self.user_rps

    def load_fraction(self, users: float) -> float:
        return self.rate(users) / self.rps

    def as_json(self) -> dict[str, Any]:
        return {
            "rps": self.rps,
            "user_rps": self.user_rps,
            "source": self.source,
            "users": self.users,
            "mode": self.mode,
            "plateau": self.plateau,
        }


@dataclass(frozen=True, slots=True)
class CapacityPlan:
    how: str = "measure"  # measure | off | fixed
    fixed: Capacity | None = None  # how == "fixed"
    mode: str = "least_sse"
    users: tuple[int, ...] = ()  # the sweep's user counts; () = SWEEP_MULTIPLES x A
    gain: float = 0.03
    patience: int = 2

    def __post_init__(self) -> None:
        if self.how not in ("measure", "off", "fixed"):
            raise ValueError("capacity: measure, off or fixed")
        if (self.how == "fixed") != (self.fixed is not None):
            raise ValueError("a fixed capacity needs its value (and only then)")
        if self.patience < 1 or not 0 <= self.gain < 1:
            raise ValueError("capacity sweep: patience >= 1 and 0 <= gain < 1")


def sweep_users(plan: CapacityPlan, base_users: int) -> list[int]:
    """The sweep's user counts, ascending, each once."""
    users = plan.users or tuple(max(1, round(m * base_users)) for m in SWEEP_MULTIPLES)
    return sorted(set(users))


def plateaued(goodputs: Sequence[float], gain: float, patience: int) -> bool:
    """Have the last `patience` points each failed to beat the best before them by more
    than `gain` (relative)?"""
    if len(goodputs) <= patience:
        return False
    best = max(goodputs[:-patience])
    for g in goodputs[-patience:]:
        if g > best * (1 + gain):
            return False
        best = max(best, g)
    return True


def from_sweep(
    users: Sequence[int], goodputs: Sequence[float], *, mode: str, gain: float, patience: int
) -> Capacity:
    """The capacity a sweep found (`users` ascending, their goodputs)."""
    if not users or len(users) != len(goodputs):
        raise ValueError("a sweep needs one goodput per user count")
    known = [(u, g) for u, g in zip(users, goodputs, strict=True) if not math.isnan(g)]
    if not known or max(g for _, g in known) <= 0:
        raise ValueError("the capacity sweep served nothing in time: no capacity to measure")
    peak_users, peak = max(known, key=lambda ug: ug[1])
    return Capacity(
        rps=peak,
        user_rps=max(g / u for u, g in known),
        source="measured",
        users=peak_users,
        mode=mode,
        plateau=plateaued(goodputs, gain, patience),
    )
