"""Back-off between retry rounds, as a small injected object (redis-py style)."""

from __future__ import annotations

import random


class ExponentialBackoff:
    """``initial * 2**attempt`` capped at ``maximum``, with a fraction ``jitter`` randomised.

    Jitter keeps many waiting requests (and several gateways) from retrying in lock-step
    against the same prefill the moment it frees a slot.
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
        base: float = min(self._maximum, self._initial * 2.0 ** min(max(attempt, 0), 32))
        return base * (1 - self._jitter * self._rng.random())


class ConstantBackoff:
    def __init__(self, seconds: float) -> None:
        self._seconds = seconds

    def delay(self, attempt: int) -> float:
        return self._seconds
