"""A queue's refused requests, followed to their retries: where each stood (kept for its
retry, `Places`) and when each is due back (`AwaitedRetries`).

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

`AwaitedRetries`, whatever `retry_keeps_place` says, follows the same requests for the
figure they are told. While a refused request waits out its Retry-After it is not in the
queue, but its retry will be, ahead of a request refused after it: the pace must serve it
first. A figure that counts only the requests queued now sits at the floor under sustained
overload (the queue is held at the edge of the pace's reach, so the excess over the reach
is a few requests), and every refused client comes back at once into the queue that
refused it. So the requests told to come back and not yet due count as ahead of the next
one refused, as many of them as the queue's refused requests have been coming back when
told: clients that send a new request at once, or never come back, add nothing. They
count in what a refused request is told, never in whether one is admitted (for the reason
a kept place does not).
"""

from __future__ import annotations

import heapq

from pdgate.policies.base import RequestInfo

__all__ = ["AwaitedRetries", "Places"]

# A place is kept until its Retry-After times this, plus `_KEEP_EXTRA_S`: clients come back
# a little late (their own latency, a busy event loop), and one that comes much later than
# told has given the place up.
_KEEP_FACTOR = 1.5
_KEEP_EXTRA_S = 1.0
# A retry this much before its time (a share of its Retry-After, and at least the seconds)
# came back early, not as told: clients round, and their clocks start a little apart.
_EARLY_SHARE = 0.05
_EARLY_S = 0.05
# How fast the share of retries that come back as told follows a change: each outcome
# weighs this much of the running share.
_HONOUR_WEIGHT = 1 / 32


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


class AwaitedRetries:
    """The refused requests of one queue told to come back, until they do or lapse (module
    docstring): how many to count ahead of the next one refused (`expected`).

    A refused request is awaited from when it is told until `_KEEP_FACTOR` times its
    Retry-After plus `_KEEP_EXTRA_S` (as a place is kept). It counts ahead of others only
    until its time comes: by then its retry, if it comes, is in the queue. The share of
    them that came back at their time, neither early nor never, weighs the count; it starts
    at none, so a queue's figure counts them only once its clients show they retry as told.
    At most `max_awaited` are followed, the longest awaited dropped first."""

    __slots__ = ("_awaited", "_dues", "_ends", "_honour", "_max", "_serial", "_waiting")

    def __init__(self, max_awaited: int) -> None:
        if max_awaited <= 0:
            raise ValueError("max_awaited must be positive")
        self._max = max_awaited
        # By request, oldest first: (serial, told to wait, due, awaited until).
        self._awaited: dict[int, tuple[int, float, float, float]] = {}
        # (due, serial, request) and (awaited until, serial, request), as told; one whose
        # serial is no longer its request's (told again, come back, dropped) is skipped when
        # its time comes, and both are rebuilt when such entries outnumber the rest.
        self._dues: list[tuple[float, int, int]] = []
        self._ends: list[tuple[float, int, int]] = []
        self._serial = 0
        self._waiting = 0  # awaited requests whose time has not come
        self._honour = 0.0  # the share of retries that came back as told

    def __len__(self) -> int:
        return len(self._awaited)

    @property
    def honour(self) -> float:
        """The share of the refused requests that came back when told (recent ones weigh
        most)."""
        return self._honour

    def told(self, info: RequestInfo, retry_after: float, now: float) -> None:
        """`info`'s request was refused and told to come back in `retry_after`."""
        self._lapse(now)
        request = _fingerprint(info)
        self._forget(request, now)
        self._serial += 1
        due = now + retry_after
        until = now + retry_after * _KEEP_FACTOR + _KEEP_EXTRA_S
        self._awaited[request] = (self._serial, retry_after, due, until)
        self._waiting += 1
        heapq.heappush(self._dues, (due, self._serial, request))
        heapq.heappush(self._ends, (until, self._serial, request))
        while len(self._awaited) > self._max:
            self._forget(next(iter(self._awaited)), now)
        if len(self._ends) > 4 * len(self._awaited) + 64:
            awaited = self._awaited.items()
            self._dues = [(d, n, r) for r, (n, _, d, _) in awaited if d > now]
            self._ends = [(u, n, r) for r, (n, _, _, u) in awaited]
            heapq.heapify(self._dues)
            heapq.heapify(self._ends)

    def back(self, info: RequestInfo, now: float) -> None:
        """A request arrives: if it was told to come back, it has, at its time or early."""
        if not self._awaited:
            return
        self._lapse(now)
        request = _fingerprint(info)
        told = self._awaited.get(request)
        if told is None:
            return
        _, retry_after, due, _ = told
        self._forget(request, now)
        self._outcome(due - now <= max(_EARLY_S, _EARLY_SHARE * retry_after))

    def waiting(self, now: float) -> int:
        """The requests awaited whose time has not come."""
        self._lapse(now)
        return self._waiting

    def expected(self, now: float) -> float:
        """The retries to count ahead of a request refused now: those awaited whose time
        has not come, weighed by the share that come back as told."""
        return self.waiting(now) * self._honour

    def _forget(self, request: int, now: float) -> None:
        told = self._awaited.pop(request, None)
        if told is not None and told[2] > now:
            self._waiting -= 1

    def _outcome(self, as_told: bool) -> None:
        self._honour += _HONOUR_WEIGHT * (float(as_told) - self._honour)

    def _lapse(self, now: float) -> None:
        awaited, dues, ends = self._awaited, self._dues, self._ends
        while dues and dues[0][0] <= now:
            _, serial, request = heapq.heappop(dues)
            told = awaited.get(request)
            if told is not None and told[0] == serial:
                self._waiting -= 1
        while ends and ends[0][0] < now:
            _, serial, request = heapq.heappop(ends)
            told = awaited.get(request)
            if told is not None and told[0] == serial:
                del awaited[request]
                self._outcome(False)  # never came back
