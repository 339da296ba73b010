"""How long a refused request should wait before it would likely be served: the figure every
503 and 429 of the gateway carries (``Retry-After``, ``retry-after-ms`` and the error body's
``retry_after``).

A fixed second sends every refused client of an overloaded fleet back at once, into the same
queue that refused it; a figure from the queue spreads them over the time it needs. Each
error path asks this unit with what it knows (docs/scheduling.md, "Retry-After"):

- `drain`: ``excess`` requests must leave before this one would be admitted (or reached in
  time), at ``per_s`` a second: ``excess / per_s``. The queue's refusals (drain admission
  and its sweep, a full queue, early drop, expiry) count as excess the requests ahead of it
  in deadline order, and the refused requests due back before it as far as the queue's
  refused come back when told (placement/places.py, `AwaitedRetries`), less what the
  fleet's pace (while saturated, bounded by the decodes') serves within its TTFT budget;
  a tenant over its share counts its own requests ahead and its share of those due back,
  at its share of the pace; an aggregated instance that did not answer in time, the queue's
  requests as expiry does. A request no decode took (or, pushed, no decode had room for)
  counts the others waiting for a decode beyond the free slots, at the decodes' pace. At
  ``max_pending`` or ``max_uploads`` the excess is the count past the limit, one more for
  this request, at the rate those requests have been finishing (`Departures`).
- `membership`: no instance serves it; the gateway sees a new one at its next read of the
  fleet's membership.
- `elsewhere`: the gateway stops; another gateway of the fleet serves it at once.
- `bounded`: a figure found elsewhere (a key's rate limit: until its bucket holds a token).

With nothing to go by (no pace measured yet) it is the floor; every figure is held between
the floor and the ceiling (settings ``retry_after_s``, ``retry_after_max_s``). The ceiling's
default is the longest wait the official OpenAI clients honour: past it they give up.
"""

from __future__ import annotations

import math
from collections import deque

__all__ = ["Departures", "RetryAfter"]


class RetryAfter:
    """Seconds to tell a refused client, between `floor_s` and `ceiling_s`; `poll_s` is how
    often the gateway reads the fleet's membership."""

    __slots__ = ("_ceiling", "_floor", "_poll")

    def __init__(
        self, *, floor_s: float = 1.0, ceiling_s: float = 120.0, poll_s: float = 1.0
    ) -> None:
        if not 0 < floor_s <= ceiling_s or poll_s <= 0:
            raise ValueError("need 0 < floor_s <= ceiling_s and poll_s > 0")
        self._floor = floor_s
        self._ceiling = ceiling_s
        self._poll = poll_s

    @property
    def floor_s(self) -> float:
        return self._floor

    def bounded(self, seconds: float | None) -> float:
        """`seconds` held within the floor and the ceiling (None or not finite: the floor),
        rounded up to the millisecond that ``retry-after-ms`` carries."""
        if seconds is None or not math.isfinite(seconds):
            return self._floor
        return min(self._ceiling, max(self._floor, math.ceil(seconds * 1000) / 1000))

    def drain(self, excess: float, per_s: float | None) -> float:
        """Until `excess` requests have left at `per_s` a second (unknown pace: the floor)."""
        if per_s is None or not 0 < per_s < math.inf:
            return self._floor
        return self.bounded(max(0.0, excess) / per_s)

    def membership(self) -> float:
        """Until the gateway's next read of the fleet's members: a new instance shows then."""
        return self.bounded(self._poll)

    def elsewhere(self) -> float:
        """The gateway stops: another gateway serves the request at once, so the shortest
        wait, the floor."""
        return self._floor


class Departures:
    """How fast requests leave a bounded count (``max_pending``, ``max_uploads``): the
    departures of the last `window_s`, at most `keep` of them, over the time since the first
    of them (so a silence since the last one slows it). None: fewer than two to go by."""

    __slots__ = ("_times", "_window")

    def __init__(self, *, window_s: float = 10.0, keep: int = 64) -> None:
        if window_s <= 0 or keep < 2:
            raise ValueError("need window_s > 0 and keep >= 2")
        self._window = window_s
        self._times: deque[float] = deque(maxlen=keep)

    def left(self, now: float) -> None:
        """One request left the count."""
        self._times.append(now)

    def per_s(self, now: float) -> float | None:
        times = self._times
        while times and times[0] < now - self._window:
            times.popleft()
        if len(times) < 2 or now <= times[0]:
            return None
        return (len(times) - 1) / (now - times[0])
