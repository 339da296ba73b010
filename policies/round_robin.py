"""Round-robin: rotate the starting candidate on every call; recently rejected go last."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from policies.base import InstanceLoad, RequestInfo


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        # The only state a policy keeps is its own cursor; it sees no I/O.
        self._counter = itertools.count()

    def rank(self, request: RequestInfo, candidates: Sequence[InstanceLoad]) -> list[InstanceLoad]:
        if not candidates:
            return []
        ordered = sorted(candidates, key=lambda c: c.id)
        start = next(self._counter) % len(ordered)
        rotated = ordered[start:] + ordered[:start]
        return [c for c in rotated if not c.busy] + [c for c in rotated if c.busy]
