"""Decode choice: the worker with the most free room, then the fewest open streams."""

from __future__ import annotations

from collections.abc import Sequence

from policies.base import InstanceLoad, RequestInfo


class LeastLoaded:
    name = "least_loaded"

    def rank(self, request: RequestInfo, candidates: Sequence[InstanceLoad]) -> list[InstanceLoad]:
        return sorted(
            candidates,
            key=lambda c: (c.busy, -(c.capacity - c.open_streams), c.open_streams, c.id),
        )
