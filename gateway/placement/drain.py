"""How fast a queue drains, so that a request it cannot serve in time is refused on arrival.

Past capacity, a gateway-held queue grows until its requests wait out their deadlines: with
a bound of a thousand, every client waits its whole TTFT budget for a 503. A client told at
once can go elsewhere or back off. So on arrival a request is refused with 503 and
``Retry-After`` when even the fleet's recent pace cannot bring it to the front of this
gateway's queue before its deadline:

    ahead / rate > time left

``rate`` is the grants per second for this queue's model and group **while this queue had
a backlog** (a queue that is often empty drains as fast as requests arrive, which says
nothing about capacity), over the last `window_s`, and only once the backlog has lasted
`min_span_s` with at least `min_grants` grants: below that there is no evidence and the
request is queued as before. The grants counted are the whole fleet's: this gateway's as
they happen, the other gateways' as each sync reports them (`samples_out`, within one
sync interval). ``ahead`` is a lower bound of the requests that go before it here
(queue.py, `WaitQueue.ahead`): more urgent classes, and its own tenant's requests due
before it. Other tenants' requests are not counted (fair sharing may let it pass them),
nor are the other gateways', so the estimate errs toward admitting; early drop at the head
(forwarder.py) still catches what slips through.

Why the fleet's grants and only this queue's requests. Alone, the two are the queue's own
pace and the queue. In a fleet the fleet's deadline order decides whose requests go, so
this gateway's own grants are only its share of the urgent requests: a gateway that judged
by them and refused held fewer requests, got fewer grants and refused more, until it
refused most of its clients. Scaling the fleet's pace by this queue's share of the fleet's
queue, or counting the other gateways' requests due first, had the same loop in it
(docs/results/fleet/README.md, "Drain admission in a fleet"). With the fleet's whole pace
and this queue alone, refusing shortens this queue and so refuses less: the judgement
only refuses what no share of the fleet could serve in time, such as a gateway taking ten
times the fleet's capacity while the others are quiet.

With `drain_sweep` (on by default) the requests already queued are judged again, at most
twice a second as requests arrive: the queue is swept for those the pace cannot reach
(`WaitQueue.beyond_reach`) and they are refused too, where they would wait out their
deadlines. It matters at a backlog's start: its first grants fill the prefill and decode
slots that were idle when it began, so the first seconds' pace overstates the fleet's, and
what it admits then the steady pace may not reach (docs/results/chaos/README.md).
"""

from __future__ import annotations

from bisect import bisect_left

__all__ = ["QueueDrain"]


class QueueDrain:
    """A queue's grant rate while backlogged: `granted(now, n)` for every `n` requests a
    prefill accepted (here or, as reported, at another gateway); the backlog's start is the
    queue's own (`WaitQueue.backlog_since`)."""

    __slots__ = ("_base", "_head", "_min_grants", "_min_span", "_times", "_totals", "_window")

    def __init__(
        self, *, window_s: float = 5.0, min_span_s: float = 1.0, min_grants: int = 4
    ) -> None:
        if window_s <= 0 or not 0 <= min_span_s <= window_s or min_grants < 1:
            raise ValueError("need window_s > 0, 0 <= min_span_s <= window_s, min_grants >= 1")
        self._window = window_s
        self._min_span = min_span_s
        self._min_grants = min_grants
        # When grants came, ascending, and the running total of grants up to and including
        # each; those before `_head` are out of the window. Bounded by the grants and
        # reports one window holds (compacted as the head moves on).
        self._times: list[float] = []
        self._totals: list[int] = []
        self._head = 0
        self._base = 0  # the running total before `_times[0]` (grants compacted away)

    def granted(self, now: float, count: int = 1) -> None:
        if count < 1:
            return
        times, totals = self._times, self._totals
        if times and now < times[-1]:
            now = times[-1]  # kept ascending
        times.append(now)
        totals.append((totals[-1] if totals else 0) + count)
        if times[self._head] < now - self._window:
            self._head = bisect_left(times, now - self._window, self._head)
            if self._head > 64 and self._head * 2 > len(times):
                self._base = totals[self._head - 1]
                del times[: self._head]
                del totals[: self._head]
                self._head = 0

    def rate(self, now: float, backlog_since: float | None) -> float | None:
        """Grants per second over the current backlog's last `window_s` (None: no backlog,
        or too short or too few grants to say)."""
        if backlog_since is None:
            return None
        start = max(backlog_since, now - self._window)
        span = now - start
        if span < self._min_span:
            return None
        first = bisect_left(self._times, start, self._head)
        if first == len(self._times):
            return None
        totals = self._totals
        grants = totals[-1] - (totals[first - 1] if first else self._base)
        return grants / span if grants >= self._min_grants else None
