"""The paper's gateway: the prefill with the fewest open SSE connections first."""

from __future__ import annotations

from collections.abc import Sequence

from policies.base import InstanceLoad, RequestInfo


class LeastSSE:
    """Rank by (recently rejected, open streams, in flight).

    Open streams alone cannot tell whether a prefill is done with a request (they last through
    decoding, P/D-Serve section 3.5), so in-flight prefills break ties, and instances that just
    answered 429 go last: they are the least likely to accept.
    """

    name = "least_sse"

    def rank(self, request: RequestInfo, candidates: Sequence[InstanceLoad]) -> list[InstanceLoad]:
        return sorted(candidates, key=lambda c: (c.busy, c.open_streams, c.inflight, c.id))
