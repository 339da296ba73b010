"""Power of two choices: sample two candidates, try the less loaded first.

Spreads load almost as well as least-loaded while tolerating stale counts from other
gateways (Mitzenmacher, "The Power of Two Choices in Randomized Load Balancing", 2001).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from policies.base import InstanceLoad, RequestInfo


def _load(c: InstanceLoad) -> tuple[bool, float, int]:
    return (c.busy, (c.open_streams + c.inflight) / max(c.capacity, 1), c.inflight)


class PowerOfTwo:
    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def rank(self, request: RequestInfo, candidates: Sequence[InstanceLoad]) -> list[InstanceLoad]:
        if len(candidates) <= 2:
            return sorted(candidates, key=_load)
        pair = self._rng.sample(list(candidates), 2)
        picked = sorted(pair, key=_load)
        chosen = {c.id for c in pair}
        # The rest stay as fallbacks, least loaded first, for when both sampled ones reject.
        rest = sorted((c for c in candidates if c.id not in chosen), key=_load)
        return picked + rest
