"""How fast a queue drains, so that a request it cannot serve in time is refused on arrival.

Past capacity, a gateway-held queue grows until its requests wait out their deadlines: with
a bound of a thousand, every client waits its whole TTFT budget for a 503. A client told at
once can go elsewhere or back off. So on arrival a request is refused with 503 and
``Retry-After`` when even the queue's recent pace cannot bring it to the front before its
deadline:

    ahead / rate > time left

``rate`` is the fleet's grants per second for this queue (this gateway's and, as each sync
brings them, the other gateways') **while this gateway's queue had a backlog** (a queue that
is often empty drains as fast as requests arrive, which says nothing about capacity), over
the last `window_s`, and only once the backlog has lasted `min_span_s` with at least
`min_grants` grants: below that there is no evidence and the request is queued as before.
``ahead`` is a lower bound of the requests the fleet serves before it, in its one deadline
order: here (queue.py, `WaitQueue.ahead`), the more urgent classes and its own tenant's
requests due before it (other tenants' are not counted: fair sharing may let it pass
them); at the other gateways, the requests their last sync said are due before it
(`DUE_EDGES_S` buckets, whole buckets only). So the estimate errs toward admitting; early
drop at the head (forwarder.py) still catches what slips through. (Its own grants alone
would refuse what the fleet serves whenever this gateway's share of them lags; the fleet's
rate scaled by its share of the queue would refuse ever more as its queue shrinks.)

With `drain_sweep` (off by default), requests queued before the pace was known (the
backlog's first second) are judged the same way later: at most twice a second, as requests
arrive, the queue is swept for those the pace cannot reach (`WaitQueue.beyond_reach`) and
they are refused too, where they would wait out their deadlines. Off by default: clients
that resend at once after a 503 turn each early refusal into another request, and the
gateway that sweeps ends up answering most of the failures.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

__all__ = ["DUE_EDGES_S", "QueueDrain", "due_before"]

# How the fleet's gateways tell each other what their queues hold: counts of requests due
# within each of these seconds (and later), as of each sync. Coarse on purpose: a count per
# bucket a sync is cheap, and a bucket only counts once all of it is due first.
DUE_EDGES_S = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)


def due_before(counts: Sequence[int], within_s: float) -> int:
    """Of `counts` (per `DUE_EDGES_S` bucket, the last one later than all), the requests
    surely due within `within_s`: whole buckets only, a lower bound."""
    return sum(c for edge, c in zip(DUE_EDGES_S, counts, strict=False) if edge <= within_s)


class QueueDrain:
    """A queue's grant rate while backlogged: `granted(now, n)` for every `n` requests a
    prefill accepted; the backlog's start is the queue's own (`WaitQueue.backlog_since`)."""

    __slots__ = ("_counted", "_head", "_min_grants", "_min_span", "_times", "_window")

    def __init__(
        self, *, window_s: float = 5.0, min_span_s: float = 1.0, min_grants: int = 4
    ) -> None:
        if window_s <= 0 or not 0 <= min_span_s <= window_s or min_grants < 1:
            raise ValueError("need window_s > 0, 0 <= min_span_s <= window_s, min_grants >= 1")
        self._window = window_s
        self._min_span = min_span_s
        self._min_grants = min_grants
        # When grants came, ascending, and the grants counted up to and including each;
        # those before `_head` are out of the window. Bounded by the calls to `granted` in
        # one window (compacted as the head moves on).
        self._times: list[float] = []
        self._counted: list[int] = []
        self._head = 0

    def granted(self, now: float, n: int = 1) -> None:
        if n <= 0:
            return
        times = self._times
        if times and now < times[-1]:
            now = times[-1]  # kept ascending
        times.append(now)
        self._counted.append((self._counted[-1] if self._counted else 0) + n)
        if times[self._head] < now - self._window:
            self._head = bisect_left(times, now - self._window, self._head)
            if self._head > 64 and self._head * 2 > len(times):
                del times[: self._head]
                del self._counted[: self._head]
                self._head = 0

    def rate(self, now: float, backlog_since: float | None) -> float | None:
        """Grants per second over the current backlog's last `window_s` (None: no backlog,
        or too short or too few grants to say)."""
        if backlog_since is None or not self._times:
            return None
        start = max(backlog_since, now - self._window)
        span = now - start
        if span < self._min_span:
            return None
        first = bisect_left(self._times, start, self._head)
        before = self._counted[first - 1] if first else 0
        grants = self._counted[-1] - before
        return grants / span if grants >= self._min_grants else None
