"""The gateway's queues: one per (model, group) and kind of instance, each with its forwarder.

A queue is opened on its first request (`Queues.get`) with the parts it is built from: its
bound (the group's ``queue_size``), order and start guard (queue.py), the policy that ranks
its instances (the prefill policy; the aggregated one for an aggregated group; rolling
activation over the group's `PhaseView` for a partial group, partial.py) and the parts every
queue shares (shared.py). Queues exist only for pairs the registry knows, so their bound is
a backstop: past it, the idle ones are closed.

The fleet's other gateways send each queue's prefill-time samples and grants with every sync
(`incoming`); those for a queue not opened here yet are kept, so that its first request is
judged on the fleet's figures (a warm start). The decodes' hold times travel with them
(drain.py, `DecodeCapacity`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from functools import partial

from pdgate.config.settings import GatewaySettings
from pdgate.config.wire import Role
from pdgate.gateway.admission.groups import GroupResolver
from pdgate.gateway.errors import GatewayError
from pdgate.gateway.placement.forwarder import PrefillForwarder
from pdgate.gateway.placement.partial import Mitosis, PhaseView, RollingActivation
from pdgate.gateway.placement.queue import WaitQueue
from pdgate.gateway.placement.shared import Shared
from pdgate.gateway.placement.side import Declaring
from pdgate.policies.base import Ranker, RequestInfo

__all__ = ["Queues"]

# Queues exist only for (model, group) pairs the registry knows, so this bound is a backstop.
_MAX_QUEUES = 1024
# Samples kept per queue this gateway has not served yet, counted one by one: a sync's entry
# may carry a single sample, and a type's pace is known only from `min_samples` of its own.
# Twice a forwarder's window, since prefill and compute times come in pairs.
_EARLY_SAMPLES = 512
# Queues heard of but not served yet whose samples are kept (the least recently heard go).
_EARLY_QUEUES = 256


class Queues:
    def __init__(
        self,
        settings: GatewaySettings,
        shared: Shared,
        groups: GroupResolver,
        *,
        prefill_policy: Ranker,
        aggregated_policy: Ranker,
    ) -> None:
        """`aggregated_policy` ranks an aggregated group's instances (never with the
        `idle` filter: they always compute)."""
        self._settings = settings
        self._shared = shared
        self._groups = groups
        self._prefill_policy = prefill_policy
        self._aggregated_policy = aggregated_policy
        self._forwarders: dict[tuple[str, str | None, str], PrefillForwarder] = {}
        self._phase_views: dict[tuple[str, str | None], PhaseView] = {}
        # Queue -> the fleet's recent samples for a queue with no forwarder here yet.
        self._early_samples: dict[str, deque[str]] = {}
        self._shed: GatewayError | None = None  # the gateway stops: `shed`

    def __iter__(self) -> Iterator[PrefillForwarder]:
        return iter(self._forwarders.values())

    def get(
        self,
        info: RequestInfo,
        role: Role = Role.PREFILL,
        phases: PhaseView | None = None,
        endpoint: str | None = None,
    ) -> PrefillForwarder:
        """The queue of `info`'s model and group towards instances of `role`; with `phases`,
        a partial group's, ranked by rolling activation; with `endpoint`, a side endpoint's,
        among the instances that declare it (side.py)."""
        key = (
            info.model,
            info.group,
            role.value + ("+phases" if phases else "") + (endpoint or ""),
        )
        fwd = self._forwarders.get(key)
        if fwd is None:
            if len(self._forwarders) >= _MAX_QUEUES:
                for k in [k for k, f in self._forwarders.items() if f.idle]:
                    del self._forwarders[k]
            fwd = self._forwarders[key] = PrefillForwarder(
                info.model,
                info.group,
                WaitQueue(
                    self._groups.queue_size(info.group),
                    self._settings.queue_order,
                    guard_s=self._settings.queue_guard_s,
                ),
                self._policy_for(info, role, phases)
                if endpoint is None
                else Declaring(self._aggregated_policy, self._shared.tracker, endpoint),
                self._shared,
                role=role,
            )
            if endpoint is not None:
                fwd.key += endpoint  # its own name in the fleet
            if self._shed is not None:
                fwd.shed(self._shed)
            # What the fleet measured for this queue before we had one (a warm start).
            fwd.samples_in(self._early_samples.pop(fwd.key, ()), fresh=False)
        return fwd

    def _policy_for(self, info: RequestInfo, role: Role, phases: PhaseView | None) -> Ranker:
        if phases is not None:
            return RollingActivation(
                phases,
                ttft_slo_s=self._groups.ttft_timeout_s(info.group),
                members=partial(
                    self._shared.tracker.members, Role.AGGREGATED, info.model, info.group
                ),
            )
        return self._prefill_policy if role is Role.PREFILL else self._aggregated_policy

    def phase_view(self, info: RequestInfo) -> PhaseView:
        """The phases of `info`'s partial group (partial.py)."""
        key = (info.model, info.group)
        view = self._phase_views.get(key)
        if view is None:
            if len(self._phase_views) >= _MAX_QUEUES:
                del self._phase_views[next(iter(self._phase_views))]
            settings = self._settings
            view = self._phase_views[key] = PhaseView(
                tpot_slo_s=self._groups.tpot_slo_s(info.group),
                mitosis=Mitosis(settings.macro_min_instances, settings.macro_max_instances),
            )
        return view

    def shed(self, error: GatewayError) -> None:
        """Every queue's waiting requests, and those that would queue from now on, fail with
        `error` (the gateway stops: `QueueAdmission.shed`)."""
        for fwd in self._forwarders.values():
            fwd.shed(error)
        self._shed = error

    async def close(self) -> None:
        for fwd in self._forwarders.values():
            await fwd.close()
        self._forwarders.clear()

    def heads(self) -> dict[str, float | None]:
        """Per queue, ms to its most urgent request's deadline (the fleet's deadline order)."""
        return {f.key: f.head_in_ms() for f in self._forwarders.values()}

    def queued(self) -> int:
        """Requests waiting at the gateway for a prefill (queued or being tried)."""
        return sum(f.waiting for f in self._forwarders.values())

    def outgoing(self) -> dict[str, str]:
        """Per queue, this gateway's new prefill-time samples (`FleetEstimates`); the
        decodes' hold times (`DecodeCapacity`) go with any one queue's."""
        out: dict[str, str] = {}
        for f in self._forwarders.values():
            packed = f.samples_out()
            if packed:
                out[f.key] = packed
        capacity = self._shared.decode_capacity
        if capacity is not None and self._forwarders:
            held = capacity.samples_out()
            if held:
                key = next(iter(self._forwarders.values())).key
                out[key] = ";".join([out[key], *held] if key in out else held)
        return out

    def incoming(self, queue: str, packed: Sequence[str], *, fresh: bool = True) -> None:
        """The other gateways' samples for `queue` (`FleetEstimates`); kept for a queue this
        gateway has not served yet, so its first request is judged on the fleet's figures.
        The decodes' hold times among them count at once, whatever the queue."""
        capacity = self._shared.decode_capacity
        if capacity is not None:
            packed = [rest for e in packed if (rest := capacity.samples_in(e))]
            if not packed:
                return
        model, _, group = queue.partition("|")
        fwd = self._forwarders.get((model, group or None, Role.PREFILL.value))
        if fwd is None or fwd.key != queue:  # a model name with "|" in it
            fwd = next((f for f in self._forwarders.values() if f.key == queue), None)
        if fwd is not None:
            fwd.samples_in(packed, fresh=fresh)
            return
        kept = self._early_samples.pop(queue, None) or deque(maxlen=_EARLY_SAMPLES)
        kept.extend(item for entry in packed for item in entry.split(";") if item)
        self._early_samples[queue] = kept  # the most recently heard queues last
        while len(self._early_samples) > _EARLY_QUEUES:
            del self._early_samples[next(iter(self._early_samples))]

    def describe(self) -> list[dict[str, object]]:
        """Rows for ``GET /admin/queues``; a partial group's with its macro instances."""
        rows: list[dict[str, object]] = []
        for f in self._forwarders.values():
            pace, arrivals, headroom = f.admission.drain_view()
            awaited, as_told = f.admission.retries_view()
            row: dict[str, object] = {
                "model": f.model,
                "group": f.group,
                "role": f.role.value,
                "policy": f.policy_name,
                "queued": len(f.queue),
                "waiting": f.waiting,
                "head_ms": f.head_in_ms(),
                "drain_pace_per_s": pace,
                "arrivals_per_s": arrivals,
                "headroom": headroom,
                "retries_awaited": awaited,
                "retries_as_told": as_told,
            }
            view = self._phase_views.get((f.model, f.group))
            if f.role is Role.AGGREGATED and view is not None:
                members = self._shared.tracker.members(Role.AGGREGATED, f.model, f.group)
                # Split as routing would, without storing it: `arrange` keeps the split and
                # drops the rolling positions of macro instances that changed, which is
                # routing's to do, never a read's.
                row["macro_instances"] = [list(m) for m in view.mitosis.split(members)]
            rows.append(row)
        return rows
