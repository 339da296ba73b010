"""Retry pacing for the registry's background loops, as a small injected object.

Same shape as `policies.backoff` (``delay(attempt)``), so either can be passed in; the
registry keeps its own copy to stay free of gateway-side imports.
"""

from __future__ import annotations

import random
from typing import Protocol


class Backoff(Protocol):
    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry number `attempt` (1 = first retry)."""
        ...


class ExponentialBackoff:
    """``initial * 2**(attempt-1)`` capped at ``maximum``, with a fraction ``jitter`` randomised.

    Jitter spreads the reconnects of many gateways/instances after a shared Redis restarts.
    """

    def __init__(
        self, initial: float, maximum: float, jitter: float = 0.5, rng: random.Random | None = None
    ) -> None:
        if initial <= 0 or maximum < initial:
            raise ValueError("need 0 < initial <= maximum")
        if not 0 <= jitter <= 1:
            raise ValueError("jitter must be within [0, 1]")
        self._initial = initial
        self._maximum = maximum
        self._jitter = jitter
        self._rng = rng or random.Random()

    def delay(self, attempt: int) -> float:
        # Clamp the exponent: 2.0**huge overflows long before any cap applies.
        base = min(self._maximum, self._initial * 2.0 ** min(max(attempt - 1, 0), 32))
        return base * (1 - self._jitter * self._rng.random())
