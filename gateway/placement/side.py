"""The queue of a side endpoint: which instances its requests may go to.

A pooling request (``/v1/embeddings``, ``/pooling``, ``/score``, ``/rerank``...) is computed
whole by one instance, so it waits for a slot as an aggregated request does
(gateway/placement/dispatch.py, `Dispatcher.side_slot`), in a queue of its own per model,
group and endpoint, ranked by the aggregated policy among the aggregated instances of the
model whose record declares the endpoint (`Declaring`).
"""

from __future__ import annotations

from pdgate.gateway.instances.tracker import InstanceTracker
from pdgate.policies.base import Candidates, Holder, InstanceLoad, Ranker, RequestInfo

__all__ = ["Declaring"]


class Declaring:
    """`inner`'s ranking of the candidates whose registry record declares `endpoint`. It
    holds no request for a busy instance's prefix cache, and needs no prefix index (a pooling
    request leaves nothing in a cache that a later one could use)."""

    def __init__(self, inner: Ranker, tracker: InstanceTracker, endpoint: str) -> None:
        self._inner = inner
        self._tracker = tracker
        self._endpoint = endpoint
        self.name = f"{inner.name}@{endpoint}"

    @property
    def needs(self) -> frozenset[str]:
        return frozenset()

    @property
    def hold(self) -> Holder | None:
        return None

    def describe(self) -> dict[str, object]:
        return {**self._inner.describe(), "endpoint": self._endpoint}

    def rank(self, request: RequestInfo, candidates: Candidates) -> list[InstanceLoad]:
        records = self._tracker.records()
        endpoint = self._endpoint
        declaring = [
            c
            for c in candidates
            if (rec := records.get(c.id)) is not None and endpoint in rec.endpoints
        ]
        return self._inner.rank(request, declaring)
