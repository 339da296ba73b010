"""The worked example of docs/extending.md: a scorer that lives outside pdgate.

Headroom: the fraction of an instance's slots that is free. Open streams and in-flight
counts are absolute, so an 8-slot and a 32-slot prefill with 6 requests each look equally
loaded to them; relative headroom prefers the bigger one. Named in configuration as
``tests.policies._example_scorer:Headroom``; options come from the table of that name.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdgate.policies.base import InstanceLoad, RequestInfo


class Headroom:
    name = "headroom"
    needs = frozenset[str]()  # reads only the candidates' loads

    def __init__(self, floor: float = 0.0) -> None:
        if not 0 <= floor < 1:
            raise ValueError("floor must be in [0, 1)")
        self._floor = floor  # below this much headroom an instance scores 0

    def score(self, request: RequestInfo, candidates: Sequence[InstanceLoad]) -> list[float]:
        out = []
        for c in candidates:
            free = max(0.0, 1 - c.inflight / max(c.capacity, 1))
            out.append(free if free > self._floor else 0.0)
        return out
