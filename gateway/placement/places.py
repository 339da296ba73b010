"""Where a refused request stood in its queue, kept for its retry.

A request the queue refuses (503 or 429) is told the seconds after which it would likely be
served (gateway/admission/retry_after.py): until the pace has served the requests ahead of
it. Were its retry a new arrival, every request that came while it waited would be ahead of
it too, and under sustained overload the figure would seldom come true: about pace /
arrivals of retries would get in, however long they waited. So the queue keeps the refused
request's place (its order value: its deadline in EDF, its arrival in FIFO) until a while
after the time it was told, and the same request sent again (same tenant, priority, model,
group, prompt and `max_tokens`: what the official clients resend) takes it: it is ordered
as its first try was, with the whole TTFT budget of its new arrival. A retry that comes
early finds the same requests ahead and is refused again, told the time left, its place
still kept.

A kept place is not counted as a request ahead of anyone: its client may never come back
(it gave up, or it resends to another gateway), and counting it would turn away requests
that are here for one that is not, while the queue runs dry. A retry that does come back
goes before the requests that came after its first try, and the sweep refuses those that
then fall out of reach, as it refuses any request the pace no longer reaches.

What it costs (`retry_keeps_place`, off by default): the refused are mostly the costly
requests (long prompts the queue could not start in time), and a place gets them served
ahead of cheaper ones, so past capacity fewer requests are served a second
(docs/results/scheduling). And once more are refused than the pace serves, the retries
holding places would alone outrun it: the queue keeps none then (admission.py).

Places cost a request nothing while the queue refuses none. They are bounded (`max_places`,
the oldest dropped first), each kept `_KEEP_FACTOR` times its Retry-After plus
`_KEEP_EXTRA_S`, and taken once.
"""

from __future__ import annotations

from pdgate.policies.base import RequestInfo

__all__ = ["Places"]

# A place is kept until its Retry-After times this, plus `_KEEP_EXTRA_S`: clients come back
# a little late (their own latency, a busy event loop), and one that comes much later than
# told has given the place up.
_KEEP_FACTOR = 1.5
_KEEP_EXTRA_S = 1.0


def _fingerprint(info: RequestInfo) -> int:
    """The same request sent again: what identifies it among the queue's requests. Two
    clients sending the very same request share a place: the first to come back takes it."""
    return hash((info.tenant, info.priority, info.model, info.group, info.max_tokens, info.prompt))


class Places:
    """The places of one queue's refused requests, by request: (order value, kept until)."""

    __slots__ = ("_max", "_places")

    def __init__(self, max_places: int) -> None:
        if max_places <= 0:
            raise ValueError("max_places must be positive")
        self._max = max_places
        self._places: dict[int, tuple[float, float]] = {}  # insertion order: oldest first

    def __len__(self) -> int:
        return len(self._places)

    def keep(self, info: RequestInfo, order: float, retry_after: float, now: float) -> None:
        """`info`'s request was refused where `order` put it, told to come back in
        `retry_after`."""
        places = self._places
        while places:  # the oldest first, while they are past their time
            oldest = next(iter(places))
            if places[oldest][1] >= now:
                break
            del places[oldest]
        fingerprint = _fingerprint(info)
        places.pop(fingerprint, None)  # re-inserted: the newest last
        places[fingerprint] = (order, now + retry_after * _KEEP_FACTOR + _KEEP_EXTRA_S)
        while len(places) > self._max:
            del places[next(iter(places))]

    def take(self, info: RequestInfo, now: float) -> float | None:
        """The place kept for `info`'s request, if it was refused and is back in time; the
        place is then its and no longer kept."""
        if not self._places:
            return None
        place = self._places.pop(_fingerprint(info), None)
        if place is None or place[1] < now:
            return None
        return place[0]
