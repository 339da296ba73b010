"""Where a refused request stood in its queue, kept for its retry.

A request the queue refuses (503 or 429) is told the seconds after which it would likely be
served (gateway/admission/retry_after.py): until the requests ahead of it have gone. Were
its retry a new arrival, every request that came while it waited would be ahead of it too,
and under sustained overload the figure would never come true: about pace / arrivals of
retries would get in, however long they waited. So the queue keeps the refused request's
place (its key in the queue's order: deadline or arrival, then sequence) until a while after
the time it was told, and the same request sent again (same tenant, priority, model, group,
prompt and `max_tokens`: what the official clients resend) takes it: it is ordered as its
first try was, with the whole TTFT budget of its new arrival. A retry that comes early finds
the same requests ahead and is refused again, told the time left, its place still kept.

Places cost a request nothing while the queue refuses none. They are bounded (`max_places`,
the oldest dropped first), each kept at most `_KEEP_FACTOR` times its Retry-After plus
`_KEEP_EXTRA_S`, and taken once. As requests ahead of others (drain admission and the
Retry-After count them beside the queued ones) they are weighted by the share of places
recently taken back: clients that do not resend the same request, or resend it to another
gateway, leave places nobody takes, and those must not turn away the requests that are here.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdgate.policies.base import RequestInfo

__all__ = ["Places"]

# A place is kept until its Retry-After times this, plus `_KEEP_EXTRA_S`: clients come back
# a little late (their own latency, a busy event loop), and one that comes much later than
# told has given the place up.
_KEEP_FACTOR = 1.5
_KEEP_EXTRA_S = 1.0
# The share of places taken back is counted over about this many recent outcomes.
_OUTCOMES = 64


@dataclass(frozen=True, slots=True)
class _Place:
    key: tuple[float, int]  # the refused request's key in its queue's order
    priority: int
    tenant: str
    until: float  # monotonic: kept until then


def _fingerprint(info: RequestInfo) -> int:
    """The same request sent again: what identifies it among the queue's requests. Two
    clients sending the very same request share a place: the first to come back takes it."""
    return hash((info.tenant, info.priority, info.model, info.group, info.max_tokens, info.prompt))


class Places:
    """The places of one queue's refused requests, by request."""

    __slots__ = ("_lapsed", "_max", "_places", "_returned")

    def __init__(self, max_places: int) -> None:
        if max_places <= 0:
            raise ValueError("max_places must be positive")
        self._max = max_places
        self._places: dict[int, _Place] = {}  # insertion order: oldest first
        # Recent outcomes of places, decayed: taken back by a retry, or dropped unused. A
        # new queue assumes half come back.
        self._returned = 1.0
        self._lapsed = 1.0

    def __len__(self) -> int:
        return len(self._places)

    @property
    def return_share(self) -> float:
        """The share of recent places whose request came back for them."""
        return self._returned / (self._returned + self._lapsed)

    def keep(
        self, info: RequestInfo, key: tuple[float, int], retry_after: float, now: float
    ) -> None:
        """`info`'s request was refused at `key` and told to come back in `retry_after`."""
        self._expire(now)
        fingerprint = _fingerprint(info)
        self._places.pop(fingerprint, None)  # re-inserted: the newest last
        until = now + retry_after * _KEEP_FACTOR + _KEEP_EXTRA_S
        self._places[fingerprint] = _Place(key, info.priority, info.tenant, until)
        while len(self._places) > self._max:
            del self._places[next(iter(self._places))]
            self._outcome(returned=False)

    def take(self, info: RequestInfo, now: float) -> tuple[float, int] | None:
        """The place kept for `info`'s request, if it was refused and is back in time; the
        place is then its and no longer kept."""
        if not self._places:
            return None
        place = self._places.pop(_fingerprint(info), None)
        if place is None:
            return None
        if place.until < now:
            self._outcome(returned=False)
            return None
        self._outcome(returned=True)
        return place.key

    def ahead(self, priority: int, tenant: str, key: tuple[float, int], now: float) -> float:
        """The places whose requests would go before one of `priority` and `tenant` at `key`
        (as `WaitQueue.ahead` counts the queued: more urgent classes', and its tenant's in
        its class that its order puts first), weighted by `return_share`."""
        if not self._places:
            return 0.0
        self._expire(now)
        count = sum(
            1
            for p in self._places.values()
            if p.until >= now
            and (
                p.priority < priority
                or (p.priority == priority and p.tenant == tenant and p.key < key)
            )
        )
        return count * self.return_share

    def _expire(self, now: float) -> None:
        """Drop the oldest places while they are past their time (those behind them are
        skipped when counted, and dropped when they reach the front)."""
        places = self._places
        while places:
            fingerprint = next(iter(places))
            if places[fingerprint].until >= now:
                return
            del places[fingerprint]
            self._outcome(returned=False)

    def _outcome(self, *, returned: bool) -> None:
        decay = 1.0 - 1.0 / _OUTCOMES
        self._returned = self._returned * decay + returned
        self._lapsed = self._lapsed * decay + (not returned)
