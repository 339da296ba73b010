"""Passive health: outlier ejection of failing instances, and a retry budget.

Ejection (Envoy's outlier detection, passive): an instance that fails `consecutive` times in
a row (connection refused or reset, 5xx, a timeout before its first byte) is ejected, i.e.
left out of every ranking, for a cool-down that doubles with each ejection in a row up to a
cap. When the cool-down ends it is half-open: it takes exactly one request, the probe, and
stays out of the rankings while the probe runs (`InstanceTracker.begin` marks it, and ranks
a half-open instance with room for one request only, so batch forwarding sends no more).
The probe's outcome decides: a success closes it (its whole capacity again) and resets the
multiplier; a failure ejects it at once for longer; a probe that ends with neither (a 429,
a cancelled request) lets the next request probe. A success or a failure reported during
the cool-down (a request sent before the ejection, answering late) decides nothing: the
requests in flight when an instance dies fail together, and each would have doubled the
cool-down. A 429 is not a failure: it is the queue-less design working.

Retry budget: failures are retried on other instances (failover), but never beyond a
fraction of the traffic: each request deposits `ratio` of a retry into a bucket (at most
`burst` deep) and each failover retry takes one. When a whole pool fails, the gateway then
fails requests fast instead of multiplying the load on what is left. Rejections (429) are
not budgeted: retrying them until the deadline is the P/D-Serve design. Nor is a failure at an
instance known to be gone (`spends_budget`): a refused connection, which ejects the instance
at once (`Ejector.dead`), or any failure at an instance already ejected (a request sent
before its ejection). Those retries cost the fleet nothing, and the dead instance is out of
the rankings from then on, so they cannot multiply.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from pdgate.gateway.errors import UpstreamError, UpstreamUnreachable
from pdgate.gateway.instances.tracker import InstanceTracker
from pdgate.gateway.observe.metrics import GatewayMetrics

__all__ = ["Ejection", "Ejector", "RetryBudget", "spends_budget"]

log = logging.getLogger("pdgate.health")


@dataclass(slots=True)
class _State:
    failures: int = 0  # consecutive
    ejections: int = 0  # consecutive ejections (grows the cool-down)
    half_open: bool = False


@dataclass(frozen=True, slots=True)
class Ejection:
    """When an instance is ejected and for how long: after `consecutive` failures in a row,
    for `base_s`, doubled with each ejection in a row up to `max_s`."""

    consecutive: int = 5
    base_s: float = 5.0
    max_s: float = 300.0

    def __post_init__(self) -> None:
        if self.consecutive < 1 or self.base_s <= 0 or self.max_s < self.base_s:
            raise ValueError("consecutive >= 1 and 0 < base_s <= max_s required")

    def cool_down_s(self, ejections: int) -> float:
        """The cool-down after `ejections` ejections in a row before this one."""
        return min(self.max_s, self.base_s * 2.0**ejections)


class Ejector:
    def __init__(
        self, tracker: InstanceTracker, metrics: GatewayMetrics, rules: Ejection = Ejection()
    ) -> None:
        self._tracker = tracker
        self._metrics = metrics
        self._rules = rules
        self._states: dict[str, _State] = {}

    def forget(self, departed: set[str]) -> None:
        """Membership listener hook: bounded by the instances that exist."""
        for instance_id in departed:
            self._states.pop(instance_id, None)

    def success(self, instance_id: str) -> None:
        state = self._states.get(instance_id)
        if state is None:
            return
        if state.half_open:
            if self._tracker.cooling_down(instance_id):
                return  # a straggler from before the ejection: not the probe
            log.info("instance %s answered again after its ejection", instance_id)
            self._tracker.restore(instance_id)
        del self._states[instance_id]

    def dead(self, instance_id: str, role: str) -> None:
        """The instance refused a connection: it is gone, so it is ejected at once, not after
        `consecutive` failures (each of which a request would have waited through)."""
        if instance_id not in self._tracker.records() or self._tracker.cooling_down(instance_id):
            return
        state = self._states.setdefault(instance_id, _State())
        state.failures = self._rules.consecutive - 1
        self.failure(instance_id, role)

    def failure(self, instance_id: str, role: str) -> None:
        if instance_id not in self._tracker.records():
            return
        state = self._states.setdefault(instance_id, _State())
        if state.half_open and self._tracker.cooling_down(instance_id):
            return  # a straggler from before the ejection: not the probe
        state.failures += 1
        if state.half_open or state.failures >= self._rules.consecutive:
            cool = self._rules.cool_down_s(state.ejections)
            state.ejections += 1
            state.failures = 0
            state.half_open = True  # after the cool-down, its next outcome decides
            self._tracker.eject(instance_id, time.monotonic() + cool)
            self._metrics.ejections.labels(role).inc()
            log.warning("ejected %s %s for %.0f s after repeated failures", role, instance_id, cool)


class RetryBudget:
    def __init__(self, ratio: float = 0.2, burst: float = 10.0) -> None:
        if not 0 <= ratio <= 1 or burst < 1:
            raise ValueError("0 <= ratio <= 1 and burst >= 1 required")
        self._ratio = ratio
        self._burst = burst
        self._tokens = burst

    def deposit(self) -> None:
        """One request arrived."""
        self._tokens = min(self._burst, self._tokens + self._ratio)

    def withdraw(self) -> bool:
        """May one failover retry happen?"""
        if self._tokens >= 1:
            self._tokens -= 1
            return True
        return False


def spends_budget(tracker: InstanceTracker, instance_id: str, exc: UpstreamError) -> bool:
    """Whether retrying after `exc` at `instance_id` takes from the retry budget: not when
    the instance is known to be gone (refused, or ejected; module docstring)."""
    if isinstance(exc, UpstreamUnreachable) and exc.refused:
        return False
    return not tracker.cooling_down(instance_id)
