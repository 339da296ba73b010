"""Hold or go: the choice a queued request faces when the prefill holding its prefix is busy.

Under overload every prefill is full, and a slot frees on whichever prefill finishes first.
Taking it makes the request pay for its whole prompt; the prefill that holds its prefix
(prefix-cache affinity) would compute only the uncached part, once one of its own slots
frees. `ExpectedCompletion` compares the two by expected completion time, from estimates the
gateway passes in (this module does no I/O and reads no clock):

* **go**: the free prefill the policy ranked first: no wait, its prefill time for this
  request (the uncached part there; usually the whole prompt);
* **hold**: a busy prefill with a cache hit: its expected wait (until one of its slots frees)
  plus the prefill time of only the uncached part there.

It holds when the best busy option is expected to finish sooner by at least `min_gain` (a
fraction of the go option's time), within the request's remaining time. The time already
spent holding counts against the hold (`held_s`): a request is never held longer than its
cache hit was expected to save, so a wrong wait estimate (a prefill that does not free)
costs at most that saving. While the head of the queue is held, a free prefill goes to the
first of the next `scan` queued requests that would rather go now (one that has nothing to
hold for, or its hit on that very prefill): holding one request never idles the fleet for
the others.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdgate.policies.base import Option

__all__ = ["ExpectedCompletion"]


class ExpectedCompletion:
    """Chooses between sending a request now and holding it for a busy prefill's cache."""

    name = "expected_completion"
    # Without the prefix-affinity index there is no cache hit to hold a request for.
    needs = frozenset({"prefix"})

    def __init__(self, min_gain: float = 0.1, scan: int = 8) -> None:
        if not 0.0 <= min_gain < 1.0 or not 0 <= scan <= 256:
            raise ValueError("min_gain must be in [0, 1) and scan in [0, 256]")
        self._min_gain = min_gain
        self.scan = scan

    def choose(
        self, now: Option, busy: Sequence[Option], *, remaining_s: float, held_s: float = 0.0
    ) -> Option:
        """`now` (send it there at once) or the busy option to hold the request for.

        `busy`: prefills without a free slot where the request would compute less than at
        `now`; `remaining_s`: time to the request's deadline; `held_s`: how long it has
        already been held (for any prefill)."""
        best: Option | None = None
        for option in busy:
            if option.prefill_s >= now.prefill_s:
                continue  # no cache advantage: waiting for it can only be slower
            if best is None or option.finish_s < best.finish_s:
                best = option
        if best is None:
            return now
        # Measured from the moment it was first held: going then would have ended at
        # `now.prefill_s`, holding ends `held_s + finish` after it.
        if held_s + best.finish_s >= now.finish_s * (1.0 - self._min_gain):
            return now
        if best.finish_s > remaining_s:
            return now  # holding would miss the deadline: take the sure slot
        return best
