"""Built-in scorers. Each rates candidates in [0, 1] relative to the others (higher is better),
so weights combine signals of different units."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from pdgate.policies.base import NO_NEEDS, Candidates, RequestInfo

__all__ = [
    "FreeRoom",
    "Inflight",
    "InflightTokens",
    "Load",
    "OpenStreams",
    "PrecisePrefix",
    "PrefixAffinity",
    "PrefixHash",
    "lower_is_better",
]


def lower_is_better(values: Sequence[float]) -> list[float]:
    """Min-max normalised so the lowest value scores 1 and the highest 0 (all 1 when equal)."""
    if not values:
        return []
    low, high = min(values), max(values)
    if high == low:
        return [1.0] * len(values)
    span = high - low
    return [(high - v) / span for v in values]


class OpenStreams:
    """P/D-Serve's gateway signal: fewest open SSE connections (they last through decoding,
    so they measure the whole request's footprint, not the prefill's), this request's
    included, per unit of the instance's speed: a prefill twice as fast as another serves
    twice the streams in the same time. Alike instances rank by the count alone."""

    name = "open_streams"
    needs = NO_NEEDS

    def score(self, request: RequestInfo, candidates: Candidates) -> list[float]:
        return lower_is_better([(c.open_streams + 1) / c.speed for c in candidates])


class Inflight:
    """Fewest requests at the instance now (for a prefill: not yet handed to a decode), this
    one included, per unit of its speed."""

    name = "inflight"
    needs = NO_NEEDS

    def score(self, request: RequestInfo, candidates: Candidates) -> list[float]:
        return lower_is_better([(c.inflight + 1) / c.speed for c in candidates])


class InflightTokens:
    """Least prompt-token work in flight, per unit of speed: a long prompt costs a prefill
    more than a short one, which connection counts cannot see."""

    name = "inflight_tokens"
    needs = NO_NEEDS

    def score(self, request: RequestInfo, candidates: Candidates) -> list[float]:
        return lower_is_better([c.inflight_tokens / c.speed for c in candidates])


class Load:
    """Streams plus in-flight requests per slot and unit of speed: comparable across
    instances of different sizes and hardware (used by power-of-two choices)."""

    name = "load"
    needs = NO_NEEDS

    def score(self, request: RequestInfo, candidates: Candidates) -> list[float]:
        return lower_is_better(
            [(c.open_streams + c.inflight) / max(c.capacity, 1) / c.speed for c in candidates]
        )


class FreeRoom:
    """Most free slots (decode: running sequences it can still take)."""

    name = "free_room"
    needs = NO_NEEDS

    def score(self, request: RequestInfo, candidates: Candidates) -> list[float]:
        return lower_is_better([-(c.capacity - c.open_streams) for c in candidates])


class PrefixAffinity:
    """The prefill that most recently computed the most leading characters of this prompt
    (the gateway's own routing history, in blocks of characters): its prefix cache holds
    their KV, so it skips them and frees its slot sooner.

    Affinity alone would pile a hot scenario onto one instance, so a candidate whose open
    streams exceed the least loaded candidate's by more than `load_guard` gets no credit, and
    matches shorter than `min_chars` count for nothing.
    """

    name = "prefix_affinity"
    needs = frozenset({"prefix"})

    def __init__(self, load_guard: int = 4, min_chars: int = 1) -> None:
        if load_guard < 0 or min_chars < 1:
            raise ValueError("load_guard >= 0 and min_chars >= 1 required")
        self._load_guard = load_guard
        self._min_chars = min_chars

    def score(self, request: RequestInfo, candidates: Candidates) -> list[float]:
        if not candidates or not request.cached_chars:
            return [0.0] * len(candidates)
        usable = []
        for c, guarded in zip(candidates, _guarded(candidates, self._load_guard), strict=True):
            hit = request.cached_chars.get(c.id, 0)
            usable.append(hit if hit >= self._min_chars and not guarded else 0)
        best = max(usable)
        return [u / best if best else 0.0 for u in usable]


class PrecisePrefix(PrefixAffinity):
    """The prefill whose prefix cache holds the longest prefix of this prompt, as the engines
    report it in their KV events (token-exact blocks, evictions included), with the gateways'
    own routing filling the moment before an engine's event arrives
    (gateway/instances/kv_index.py). Instances that publish no events are judged by the
    character-block history, as `prefix_affinity`. Guarded the same way."""

    name = "precise_prefix"
    needs = frozenset({"kv_prefix"})


def _guarded(candidates: Candidates, load_guard: int) -> list[bool]:
    """Candidates whose open streams exceed the least loaded one's by more than the guard."""
    floor = min(c.open_streams for c in candidates)
    return [c.open_streams - floor > load_guard for c in candidates]


class PrefixHash:
    """Rendezvous hashing of the prompt's first `prefix_chars` characters: with no shared
    state, every gateway of a fleet rates the same prefill highest for the same prefix, so a
    scenario's new requests meet the cache that holds its system prompt even before any
    gateway has seen it there (the affinity index then takes over). Guarded like
    `PrefixAffinity`, so a hot prefix does not pile onto one instance."""

    name = "prefix_hash"
    needs = NO_NEEDS

    def __init__(self, prefix_chars: int = 256, load_guard: int = 4) -> None:
        if prefix_chars <= 0 or load_guard < 0:
            raise ValueError("prefix_chars > 0 and load_guard >= 0 required")
        self._prefix_chars = prefix_chars
        self._load_guard = load_guard

    def score(self, request: RequestInfo, candidates: Candidates) -> list[float]:
        if not candidates:
            return []
        key = request.prompt[: self._prefix_chars].encode("utf-8", "surrogatepass")
        guarded = _guarded(candidates, self._load_guard)
        weights = [
            -1
            if g
            else int.from_bytes(hashlib.blake2b(key + c.id.encode(), digest_size=8).digest())
            for c, g in zip(candidates, guarded, strict=True)
        ]
        best = max(weights)
        return [1.0 if w == best and w >= 0 else 0.0 for w in weights]
