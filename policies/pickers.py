"""Built-in pickers: from weighted scores to the order in which candidates are tried."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

from pdgate.policies.base import NO_NEEDS, Candidates, InstanceLoad, RequestInfo

__all__ = ["MaxScore", "PowerOfTwo", "RoundRobin"]


def _best_first(candidates: Candidates, scores: Sequence[float]) -> list[InstanceLoad]:
    # Ties go by id: deterministic, so tests and operators can reason about a ranking. Two
    # stable sorts (by id, then by score) with C-level keys instead of one with a Python key
    # function: no Python call per candidate, which a large fleet's rankings pay for most.
    ids = [c.id for c in candidates]
    order = sorted(range(len(candidates)), key=ids.__getitem__)
    negated = [-s for s in scores]
    order.sort(key=negated.__getitem__)
    return [candidates[i] for i in order]


class MaxScore:
    """Highest weighted score first."""

    name = "max_score"
    needs = NO_NEEDS

    def order(
        self, request: RequestInfo, candidates: Candidates, scores: Sequence[float]
    ) -> list[InstanceLoad]:
        return _best_first(candidates, scores)


class RoundRobin:
    """Rotate the first choice on every call (scores ignored). The only state a policy keeps
    is its own cursor."""

    name = "round_robin"
    needs = NO_NEEDS

    def __init__(self) -> None:
        self._counter = itertools.count()

    def order(
        self, request: RequestInfo, candidates: Candidates, scores: Sequence[float]
    ) -> list[InstanceLoad]:
        if not candidates:
            return []
        ordered = sorted(candidates, key=lambda c: c.id)
        start = next(self._counter) % len(ordered)
        return ordered[start:] + ordered[:start]


class PowerOfTwo:
    """Sample two, try the better-scored first, the rest after them best first.

    Spreads load almost as well as always taking the best while tolerating stale counts from
    other gateways (Mitzenmacher, "The Power of Two Choices in Randomized Load Balancing",
    2001).
    """

    name = "power_of_two"
    needs = NO_NEEDS

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def order(
        self, request: RequestInfo, candidates: Candidates, scores: Sequence[float]
    ) -> list[InstanceLoad]:
        if len(candidates) <= 2:
            return _best_first(candidates, scores)
        pair = set(self._rng.sample(range(len(candidates)), 2))
        sampled = _best_first([candidates[i] for i in pair], [scores[i] for i in pair])
        rest = [i for i in range(len(candidates)) if i not in pair]
        return sampled + _best_first([candidates[i] for i in rest], [scores[i] for i in rest])
