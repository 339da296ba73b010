"""The gateway's two rankers from before the filter/scorer/picker pipeline, one ``sorted``
each, with the default filters written inline.

The measurement of docs/results/structure/README.md ("What the restructure costs by
itself") runs the gateway with these instead of the filter/scorer/picker pipeline, through
the policy seam (``module:factory``), to price the pipeline end to end::

    PDGATE_GATEWAY_PREFILL_POLICY=pdgate.loadtest.gateway_cost.sorted_rankers:LeastSSE \
    PDGATE_GATEWAY_DECODE_POLICY=pdgate.loadtest.gateway_cost.sorted_rankers:LeastLoaded \
    pdgate bench hotpath --uvloop

They keep what the built-in profiles try (not ejected, not busy, a free slot and, for the
prefill, ``prefill_admit = idle``'s idle instance), so the gateway places requests as it
does with ``least_sse`` and ``least_loaded``; only the ordering is the older sort key.
"""

from __future__ import annotations

from pdgate.policies.base import Candidates, InstanceLoad, RequestInfo


class LeastSSE:
    name = "least_sse_sorted"

    def rank(self, request: RequestInfo, candidates: Candidates) -> list[InstanceLoad]:
        kept = [
            c
            for c in candidates
            if not c.ejected and not c.busy and c.inflight < c.capacity and c.computing == 0
        ]
        return sorted(kept, key=lambda c: (c.open_streams, c.inflight, c.id))


class LeastLoaded:
    name = "least_loaded_sorted"

    def rank(self, request: RequestInfo, candidates: Candidates) -> list[InstanceLoad]:
        kept = [c for c in candidates if not c.ejected and not c.busy and c.inflight < c.capacity]
        return sorted(kept, key=lambda c: (c.open_streams - c.capacity, c.open_streams, c.id))
