"""How fast a queue drains, so that a request it cannot serve in time is refused on arrival.

Past capacity, a gateway-held queue grows until its requests wait out their deadlines: with
a bound of a thousand, every client waits its whole TTFT budget for a 503. A client told at
once can go elsewhere or back off. So on arrival a request is refused with 503 and
``Retry-After`` when even the queue's recent pace cannot bring it to the front before its
deadline:

    ahead / rate > time left

``rate`` is the queue's grants per second **while it had a backlog** (a queue that is often
empty drains as fast as requests arrive, which says nothing about capacity), over the last
`window_s`, and only once the backlog has lasted `min_span_s` with at least `min_grants`
grants: below that there is no evidence and the request is queued as before. ``ahead`` is a
lower bound of the requests that go before it (queue.py, `WaitQueue.ahead`): more urgent
classes, and its own tenant's requests due before it. Other tenants' requests are not
counted (fair sharing may let it pass them), so the estimate errs toward admitting; early
drop at the head (forwarder.py) still catches what slips through.

Only a gateway alone in its fleet judges. There the queue's grants are its pace. In a fleet
the fleet's deadline order decides whose requests go, so a gateway's own grants measure
its share of the urgent requests, not how fast its queue can drain: a gateway that refuses
holds fewer requests, gets fewer grants and refuses more. At 2x capacity with four gateways
that locked one gateway into refusing 1,131 requests in 90 s (28% success against 92-94%
at the others), and judging by the fleet's grants instead did no better; without it the
fleet served 3-5% more and its gateways were 1.4-3.5 points apart, against 2.1-67
(docs/results/fleet/README.md, "Drain admission in a fleet"). Past capacity a fleet's
gateways refuse by early drop and their queue bound instead.

With `drain_sweep` (off by default), requests queued before the pace was known (the
backlog's first second) are judged the same way later: at most twice a second, as requests
arrive, the queue is swept for those the pace cannot reach (`WaitQueue.beyond_reach`) and
they are refused too, where they would wait out their deadlines; off by default for the
same reason.
"""

from __future__ import annotations

from bisect import bisect_left

__all__ = ["QueueDrain"]


class QueueDrain:
    """A queue's grant rate while backlogged: `granted(now)` for every request a prefill
    accepted; the backlog's start is the queue's own (`WaitQueue.backlog_since`)."""

    __slots__ = ("_grants", "_head", "_min_grants", "_min_span", "_window")

    def __init__(
        self, *, window_s: float = 5.0, min_span_s: float = 1.0, min_grants: int = 4
    ) -> None:
        if window_s <= 0 or not 0 <= min_span_s <= window_s or min_grants < 1:
            raise ValueError("need window_s > 0, 0 <= min_span_s <= window_s, min_grants >= 1")
        self._window = window_s
        self._min_span = min_span_s
        self._min_grants = min_grants
        # Grant times, ascending; those before `_head` are out of the window. Bounded by
        # what the prefills can grant in one window (compacted as the head moves on).
        self._grants: list[float] = []
        self._head = 0

    def granted(self, now: float) -> None:
        grants = self._grants
        grants.append(now)
        if grants[self._head] < now - self._window:
            self._head = bisect_left(grants, now - self._window, self._head)
            if self._head > 64 and self._head * 2 > len(grants):
                del grants[: self._head]
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
        grants = len(self._grants) - bisect_left(self._grants, start, self._head)
        return grants / span if grants >= self._min_grants else None
