"""Built-in filters: which candidates may be tried now. The same filters serve both legs."""

from __future__ import annotations

from pdgate.policies.base import NO_NEEDS, Candidates, InstanceLoad, RequestInfo

__all__ = ["HasRoom", "Idle", "NotBusy", "NotEjected"]


class HasRoom:
    """Fewer requests in flight than its slots. A prefill's slot is held until its KV was
    taken, a decode's for the whole stream; the count is a lower bound of the instance's
    load when other clients share it (a 429 corrects it)."""

    name = "has_room"
    needs = NO_NEEDS

    def filter(self, request: RequestInfo, candidates: Candidates) -> list[InstanceLoad]:
        return [c for c in candidates if c.inflight < c.capacity]


class Idle:
    """Computing nothing, for any gateway: P/D-Serve's prefill that accepts only when idle,
    for prefills with several slots. A prefill computing a batch takes a new prompt into its
    next batch, so the request waits there, out of the gateway's deadline order; with this
    filter it waits in the gateway's queue instead, and batch forwarding still sends an idle
    prefill several requests at once. A prefill whose slots only hold KV for decodes to pull
    is idle (it can compute a new batch in its free slots). The fleet's view is optimistic
    (a prefill that stops computing is announced at once); the slot lease re-checks it
    atomically (gateway/placement/leases.py)."""

    name = "idle"
    needs = NO_NEEDS

    def filter(self, request: RequestInfo, candidates: Candidates) -> list[InstanceLoad]:
        return [c for c in candidates if c.computing == 0]


class NotBusy:
    """Not rejected (429) recently: it is the least likely to accept now."""

    name = "not_busy"
    needs = NO_NEEDS

    def filter(self, request: RequestInfo, candidates: Candidates) -> list[InstanceLoad]:
        return [c for c in candidates if not c.busy]


class NotEjected:
    """Not ejected as an outlier (consecutive failures), until its cool-down ends."""

    name = "not_ejected"
    needs = NO_NEEDS

    def filter(self, request: RequestInfo, candidates: Candidates) -> list[InstanceLoad]:
        return [c for c in candidates if not c.ejected]
