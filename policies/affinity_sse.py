"""Prefix-cache affinity first, open SSE streams second, with a load guard.

A prefill that recently computed the prompt's leading blocks can skip them (its prefix cache
holds their KV), so it finishes sooner and frees its slot sooner. But affinity alone piles a
hot scenario onto one instance; the guard drops the affinity preference for any candidate
whose open streams exceed the least-loaded candidate's by more than `load_guard`, and a
recently rejected (busy) candidate always goes last.
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.base import InstanceLoad, RequestInfo


class AffinitySSE:
    name = "affinity_sse"

    def __init__(self, load_guard: int = 4, min_blocks: int = 1) -> None:
        if load_guard < 0 or min_blocks < 1:
            raise ValueError("load_guard >= 0 and min_blocks >= 1 required")
        self._load_guard = load_guard
        self._min_blocks = min_blocks

    def rank(self, request: RequestInfo, candidates: Sequence[InstanceLoad]) -> list[InstanceLoad]:
        if not candidates:
            return []
        floor = min(c.open_streams for c in candidates)

        def key(c: InstanceLoad) -> tuple[bool, int, int, int, str]:
            hit = request.prefix_blocks.get(c.id, 0)
            guarded = c.open_streams - floor > self._load_guard
            usable = hit if hit >= self._min_blocks and not guarded else 0
            return (c.busy, -usable, c.open_streams, c.inflight, c.id)

        return sorted(candidates, key=key)
