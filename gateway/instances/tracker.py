"""What this gateway knows about each instance: its own open streams, in-flight requests,
prompt work in flight and recent rejections, plus the rest of the fleet's share of the same
counts (gateway/placement/leases.py), combined with registry membership into policy snapshots.

A ready instance serves its model and each LoRA adapter its record lists: it is indexed under
every one of those names, so a request for an adapter is ranked among the instances that
hold it only (on both legs), and `models` lists adapters with the models. Each name's context
length is the smallest any ready instance of it reports (an adapter's is its model's).

Counts are changed only through `Lease`s, released exactly once whatever path a request
takes; a lease holds its counter object, not an id, so an instance that leaves and rejoins
under the same id starts from zero and old leases cannot drive it negative.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from pdgate.config.wire import EXT_PHASES, KvConnector, Role
from pdgate.policies.base import InstanceLoad
from pdgate.registry.base import InstanceRecord, InstanceState

# Waiters woken for a decode that became ready, at most (its slots, up to this bound).
_MAX_WAKES = 1024


@dataclass(slots=True)
class _Counters:
    open_streams: int = 0
    inflight: int = 0
    computing: int = 0  # of `inflight`, calls the prefill has not answered yet
    inflight_tokens: int = 0
    busy_until: float = 0.0  # monotonic; a 429 makes the instance "busy" until then
    ejected_until: float = 0.0  # monotonic; outlier ejection (gateway/instances/health.py)
    # Ejected before and not yet trusted again: after the cool-down it takes one request (the
    # probe) and stays out of the rankings until that request's outcome (`restore`, `eject`).
    half_open: bool = False
    probe: object | None = None  # the probe in flight (its lease's token)
    accepted: int = 0
    rejected: int = 0
    failed: int = 0
    # The other gateways' share (fleet view, refreshed by gateway/placement/leases.py).
    others_streams: int = 0
    others_tokens: int = 0
    others_slots: int = 0
    others_computing: int = 0
    # This gateway's prefill calls in flight there: call id -> when it is expected to end
    # (monotonic). Bounded by the calls in flight, each removed when its work lease ends.
    work_ends: dict[int, float] = field(default_factory=dict)


class Lease:
    """`weight` units of one count on one instance; `release()` is idempotent."""

    __slots__ = (
        "_also",
        "_counters",
        "_kind",
        "_on_release",
        "_released",
        "_weight",
        "instance_id",
    )

    def __init__(
        self,
        instance_id: str,
        counters: _Counters,
        kind: str,
        on_release: Callable[[], None],
        *,
        weight: int = 1,
        also: Callable[[], None] | None = None,
    ) -> None:
        self.instance_id = instance_id
        self._counters = counters
        self._kind = kind
        self._on_release = on_release
        self._weight = weight
        self._also = also  # released together (a fleet slot lease)
        self._released = False
        setattr(counters, kind, getattr(counters, kind) + weight)

    @property
    def released(self) -> bool:
        return self._released

    def release(self, *, slot_freed: bool = True) -> None:
        """Give the count back. ``slot_freed=False`` for a request the instance never took
        (rejected, unreachable): its end says nothing about free capacity, and treating it
        as a freed slot would send the next request straight into another 429."""
        if self._released:
            return
        self._released = True
        setattr(self._counters, self._kind, getattr(self._counters, self._kind) - self._weight)
        if self._also is not None:
            self._also()
        if slot_freed:
            # A finished request is the best sign the instance has a free slot again.
            self._counters.busy_until = 0.0
            self._on_release()


@dataclass
class InstanceTracker:
    """Per-instance state, bounded by membership: departed instances are dropped."""

    # How long a 429 (or a failure) keeps an instance out of the candidates, unless one of
    # our requests there frees a slot first.
    reject_hold_s: float = 0.2
    _counters: dict[str, _Counters] = field(default_factory=dict)
    _records: Mapping[str, InstanceRecord] = field(default_factory=dict)
    # Derived from the records at each membership change, read on every request: the ready
    # instances' models (sorted), and the ready instances of each role and model with their
    # counters, so a ranking walks its candidates only, not the whole registry view.
    _models: tuple[str, ...] = ()
    _ready: dict[tuple[Role, str], list[tuple[InstanceRecord, _Counters]]] = field(
        default_factory=dict
    )
    # The same records of each role and model in the order they started (`members`).
    _by_start: dict[tuple[Role, str], list[InstanceRecord]] = field(default_factory=dict)
    # (model, group) keys (group None: any) served aggregated: ready aggregated instances
    # and no ready prefill (see `aggregated`).
    _aggregated: set[tuple[str, str | None]] = field(default_factory=set)
    # Of those, the ones whose every ready aggregated instance alternates phases (partial).
    _partial: set[tuple[str, str | None]] = field(default_factory=set)
    # (model, group) keys with a ready prefill that pushes its KV (`pushed`).
    _pushed: set[tuple[str, str | None]] = field(default_factory=set)
    # Per served name (model or adapter): the smallest max_model_len a ready instance reports
    # (names none reports are absent), and each adapter's model.
    _context: dict[str, int] = field(default_factory=dict)
    _parents: dict[str, str] = field(default_factory=dict)
    _default: str | None = None  # the one model ready instances serve (None: none or several)
    _freed: asyncio.Event = field(default_factory=asyncio.Event)
    _sleepers: int = 0  # in `wait_freed` now: a pulse with none wakes nobody
    # Told the instance's id each time one of its slots frees (a request in flight there
    # ended having taken it, here or at another gateway): the decodes' waiting line
    # (gateway/placement/drain.py, `DecodeWaits`) wakes one waiter per freed slot.
    slot_freed: Callable[[str], None] | None = None
    _work_ids: Iterator[int] = field(default_factory=itertools.count)
    # (model, group or None) -> the prefills' speed per hardware type there (`set_speeds`),
    # for the queues that measured any.
    _speeds: dict[tuple[str, str | None], Mapping[str, float]] = field(default_factory=dict)

    def update_membership(
        self, records: Mapping[str, InstanceRecord], departed: set[str] | None = None
    ) -> None:
        """Membership listener: the registry view changed."""
        was_ready = {i for i, r in self._records.items() if r.state == InstanceState.READY}
        self._records = dict(records)
        for gone in [i for i in self._counters if i not in self._records]:
            del self._counters[gone]
        ready: dict[tuple[Role, str], list[tuple[InstanceRecord, _Counters]]] = {}
        context: dict[str, int] = {}
        parents: dict[str, str] = {}
        for rec in self._records.values():
            if rec.state == InstanceState.READY:
                counters = self._counters.setdefault(rec.id, _Counters())
                ready.setdefault((rec.role, rec.model), []).append((rec, counters))
                for adapter in rec.adapters:
                    if adapter != rec.model:
                        ready.setdefault((rec.role, adapter), []).append((rec, counters))
                        parents.setdefault(adapter, rec.model)
                if rec.max_model_len:
                    for name in (rec.model, *rec.adapters):
                        known = context.get(name)
                        if known is None or rec.max_model_len < known:
                            context[name] = rec.max_model_len
        self._ready = ready
        self._by_start = {
            key: sorted((rec for rec, _ in xs), key=lambda r: (r.started_at, r.id))
            for key, xs in ready.items()
        }
        self._models = tuple(sorted({model for _, model in ready}))
        for rec in self._records.values():  # a name some instance serves as its model is one
            parents.pop(rec.model, None)
        self._context, self._parents = context, parents
        bases = {model for _, model in ready if model not in parents}
        self._default = next(iter(bases)) if len(bases) == 1 else None
        prefilled: set[tuple[str, str | None]] = set()
        aggregated: set[tuple[str, str | None]] = set()
        steady: set[tuple[str, str | None]] = set()  # an aggregated one there does not alternate
        pushed: set[tuple[str, str | None]] = set()
        for (role, model), xs in ready.items():
            for rec, _ in xs:
                keys = ((model, None), (model, rec.group))
                if role is Role.PREFILL:
                    prefilled.update(keys)
                    if rec.connector == KvConnector.NIXL_PUSH:
                        pushed.update(keys)
                elif role is Role.AGGREGATED:
                    aggregated.update(keys)
                    if EXT_PHASES not in rec.extensions:
                        steady.update(keys)
        self._aggregated = aggregated - prefilled
        self._partial = self._aggregated - steady
        self._pushed = pushed
        self.pulse()  # a new instance is new capacity
        told = self.slot_freed
        if told is not None:
            # A decode ready now that was not: each of its slots is one freed.
            for rec in self._records.values():
                if (
                    rec.role is Role.DECODE
                    and rec.state == InstanceState.READY
                    and rec.id not in was_ready
                ):
                    for _ in range(min(rec.capacity, _MAX_WAKES)):
                        told(rec.id)

    def _for(self, instance_id: str) -> _Counters:
        c = self._counters.get(instance_id)
        if c is None:
            if instance_id not in self._records:
                # Leases on an instance that just left still need an object to count on.
                return _Counters()
            c = self._counters[instance_id] = _Counters()
        return c

    def records(self) -> Mapping[str, InstanceRecord]:
        return self._records

    def set_speeds(self, model: str, group: str | None, speeds: Mapping[str, float]) -> None:
        """The prefill speed per hardware type that the queue of `model` in `group` (None:
        any group) measured (`PrefillTimes.speeds`; a type not in it counts as 1). Each
        queue sets its own: one that knows none does not clear another's."""
        if speeds:
            self._speeds[(model, group)] = speeds
        else:
            self._speeds.pop((model, group), None)

    def _speed(self, rec: InstanceRecord) -> float:
        if rec.role is not Role.PREFILL:
            return 1.0  # measured from prefill calls only
        if not self._speeds:
            return 1.0
        speeds = self._speeds.get((rec.model, rec.group)) or self._speeds.get((rec.model, None))
        return speeds.get(rec.hardware, 1.0) if speeds else 1.0

    def hardware(self, instance_id: str) -> str:
        """The instance's declared hardware type ("": undeclared, or no longer registered)."""
        rec = self._records.get(instance_id)
        return rec.hardware if rec is not None else ""

    def loads(self, role: Role, model: str | None, group: str | None = None) -> list[InstanceLoad]:
        """Policy snapshot of ready instances of `role` serving `model` (None: any) in `group`
        (None: any), with the whole fleet's counts and each one's measured speed."""
        if model is None:
            ready = [x for (r, _), xs in self._ready.items() if r == role for x in xs]
        else:
            ready = self._ready.get((role, model), [])
        now = time.monotonic()
        out: list[InstanceLoad] = []
        for rec, c in ready:
            if group is not None and rec.group != group:
                continue
            inflight = c.inflight + c.others_slots
            # Positional, in InstanceLoad's field order: a fleet's every candidate, twice a
            # request, and keywords cost twice the time (0.63 against 0.27 µs a load).
            out.append(
                InstanceLoad(
                    rec.id,
                    rec.url,
                    rec.group,
                    # capacity; half-open: room for the one probe (batch forwarding sends no more)
                    min(rec.capacity, inflight + 1) if c.half_open else rec.capacity,
                    c.open_streams + c.others_streams,  # open_streams
                    inflight,
                    c.busy_until > now,  # busy
                    role,
                    c.inflight_tokens + c.others_tokens,  # inflight_tokens
                    c.ejected_until > now or c.probe is not None,  # ejected
                    c.inflight,  # own_inflight
                    c.computing + c.others_computing,  # computing
                    self._speed(rec),  # speed
                )
            )
        return out

    def members(self, role: Role, model: str, group: str | None) -> list[str]:
        """Ids of the ready instances of `role` serving `model` in `group` (None: any), in the
        order they started (the record's ``started_at``, then the id): the same list on
        every gateway that reads the same registry."""
        started = self._by_start.get((role, model), [])
        return [rec.id for rec in started if group is None or rec.group == group]

    def aggregated(self, model: str, group: str | None) -> bool:
        """Whether `model`'s requests in `group` (None: any group) are served aggregated:
        its ready instances there compute prompts and decode them, and no prefill is ready
        (a group's strategy is what its instances are)."""
        return (model, group) in self._aggregated

    def partial(self, model: str, group: str | None) -> bool:
        """Whether an aggregated group is served partially disaggregated: its every ready
        instance alternates prefill and decode phases (``EXT_PHASES``)."""
        return (model, group) in self._partial

    def pushed(self, model: str, group: str | None) -> bool:
        """Whether a ready prefill of `model` in `group` (None: any) pushes its KV into its
        decode's blocks (NixlPushConnector): its requests' decodes are chosen first
        (gateway/placement/push.py)."""
        return (model, group) in self._pushed

    def has_room(self, instance_id: str, capacity: int) -> bool:
        """Worth a try: not recently rejected and fewer requests in flight (this gateway's
        and, as last seen, the fleet's) than its slots."""
        c = self._counters.get(instance_id)
        if c is None:
            return instance_id in self._records
        return c.busy_until <= time.monotonic() and c.inflight + c.others_slots < capacity

    def groups(self, model: str) -> set[str]:
        return {r.group for r in self._records.values() if r.model == model or model in r.adapters}

    def models(self) -> tuple[str, ...]:
        """The models and LoRA adapters ready instances serve, sorted (kept per membership
        change: it was a set and a sort over the whole registry view on every request)."""
        return self._models

    def default_model(self) -> str | None:
        """The model a request that names none is for: the one model ready instances serve
        (its adapters aside, as vLLM takes a request without a model for its base model);
        None when they serve none or several."""
        return self._default

    def max_model_len(self, model: str) -> int | None:
        """The context length of `model` (a model or an adapter): the smallest a ready
        instance of it reports; None when none reports one."""
        return self._context.get(model)

    def parent(self, model: str) -> str | None:
        """The model `model` is a LoRA adapter of (None: a model, or not served)."""
        return self._parents.get(model)

    def open_stream(self, instance_id: str) -> Lease:
        return Lease(instance_id, self._for(instance_id), "open_streams", self.pulse)

    def begin(self, instance_id: str, *, also: Callable[[], None] | None = None) -> Lease:
        """A request now occupies a slot of the instance (`also`: released with it). On a
        half-open instance the first one is its probe."""
        c = self._for(instance_id)
        c.accepted += 1
        if c.half_open and c.probe is None and c.ejected_until <= time.monotonic():
            c.probe = token = object()

            def probe_ended() -> None:
                # Ended with no outcome (a 429, a cancel): the next request probes instead.
                if c.probe is token:
                    c.probe = None
                if also is not None:
                    also()

            return Lease(instance_id, c, "inflight", self._freed_at(instance_id), also=probe_ended)
        return Lease(instance_id, c, "inflight", self._freed_at(instance_id), also=also)

    def _freed_at(self, instance_id: str) -> Callable[[], None]:
        """What a slot of the instance freeing does: wake the forwarders, tell the line."""
        told = self.slot_freed
        if told is None:
            return self.pulse

        def freed() -> None:
            self.pulse()
            told(instance_id)

        return freed

    def computing(self, instance_id: str, *, also: Callable[[], None] | None = None) -> Lease:
        """A call the prefill is computing, from the call until its answer (`also`: released
        with it). Its end wakes the forwarders: an idle prefill takes a new batch."""
        return Lease(instance_id, self._for(instance_id), "computing", self.pulse, also=also)

    def work(self, instance_id: str, tokens: int, expected_s: float | None = None) -> Lease:
        """Prompt tokens the instance is computing for us (token-work load), from the call
        until its answer; `expected_s`: how long the call is expected to take (it tells when
        the instance's next slot is likely to free, see `soonest_end_s`)."""
        c = self._for(instance_id)
        forget_end: Callable[[], None] | None = None
        if expected_s is not None:
            call_id = next(self._work_ids)
            c.work_ends[call_id] = time.monotonic() + max(expected_s, 0.0)

            def forget() -> None:
                c.work_ends.pop(call_id, None)

            forget_end = forget
        return Lease(instance_id, c, "inflight_tokens", _nothing, weight=tokens, also=forget_end)

    def soonest_end_s(self, instance_id: str) -> float | None:
        """Seconds until the first of this gateway's calls computing at the instance is
        expected to answer (0 when overdue); None when none with an estimate is in flight."""
        c = self._counters.get(instance_id)
        if c is None or not c.work_ends:
            return None
        return max(0.0, min(c.work_ends.values()) - time.monotonic())

    def busy_for_s(self, instance_id: str) -> float:
        """Seconds its last 429 (or failure) keeps the instance out of the candidates."""
        c = self._counters.get(instance_id)
        return 0.0 if c is None else max(0.0, c.busy_until - time.monotonic())

    def rejected(self, instance_id: str) -> None:
        c = self._for(instance_id)
        c.rejected += 1
        c.busy_until = time.monotonic() + self.reject_hold_s

    def failed(self, instance_id: str) -> None:
        c = self._for(instance_id)
        c.failed += 1
        c.busy_until = time.monotonic() + self.reject_hold_s

    def eject(self, instance_id: str, until: float) -> None:
        """Out of every ranking until `until` (monotonic), then half-open."""
        c = self._for(instance_id)
        c.ejected_until, c.half_open, c.probe = until, True, None

    def cooling_down(self, instance_id: str) -> bool:
        c = self._counters.get(instance_id)
        return c is not None and c.ejected_until > time.monotonic()

    def restore(self, instance_id: str) -> None:
        """Its probe succeeded: trusted again, with its whole capacity."""
        c = self._counters.get(instance_id)
        if c is not None:
            c.ejected_until, c.half_open, c.probe = 0.0, False, None

    # -- the fleet's share (gateway/placement/leases.py) ----------------------------

    def own_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """This gateway's (open streams, prompt tokens in flight) per instance, non-zero."""
        streams = {i: c.open_streams for i, c in self._counters.items() if c.open_streams}
        tokens = {i: c.inflight_tokens for i, c in self._counters.items() if c.inflight_tokens}
        return streams, tokens

    def set_others(
        self,
        streams: Mapping[str, int],
        tokens: Mapping[str, int],
        slots: Mapping[str, int],
        computing: Mapping[str, int] | None = None,
    ) -> None:
        """The rest of the fleet's counts per instance (totals minus this gateway's)."""
        computing = computing or {}
        for instance_id in self._records:
            c = self._counters.get(instance_id)
            if c is None:
                if not (
                    streams.get(instance_id)
                    or tokens.get(instance_id)
                    or slots.get(instance_id)
                    or computing.get(instance_id)
                ):
                    continue
                c = self._for(instance_id)
            c.others_streams = max(0, streams.get(instance_id, 0))
            c.others_tokens = max(0, tokens.get(instance_id, 0))
            c.others_slots = max(0, slots.get(instance_id, 0))
            c.others_computing = max(0, computing.get(instance_id, 0))

    def others_freed(self, instance_id: str) -> None:
        """Another gateway gave back a slot of `instance_id`: one fewer in its share."""
        c = self._counters.get(instance_id)
        if c is not None and c.others_slots > 0:
            c.others_slots -= 1
            if self.slot_freed is not None:
                self.slot_freed(instance_id)

    def others_idle(self, instance_id: str) -> None:
        """The fleet says `instance_id` computes nothing any more."""
        c = self._counters.get(instance_id)
        if c is not None:
            c.others_computing = 0

    def note_slots(
        self, fleet_used: Mapping[str, int], fleet_computing: Mapping[str, int] | None = None
    ) -> None:
        """Fleet-wide used slots and computing calls just seen (an acquire's answer), this
        gateway's included (its computing ones not yet told to the fleet: subtracted)."""
        for instance_id, used in fleet_used.items():
            c = self._counters.get(instance_id)
            if c is not None:
                c.others_slots = max(0, used - c.inflight)
        for instance_id, n in (fleet_computing or {}).items():
            c = self._counters.get(instance_id)
            if c is not None:
                c.others_computing = max(0, n - c.computing)

    # -- waking forwarders -----------------------------------------------------------------

    def pulse(self) -> None:
        """A slot likely freed somewhere: wake everyone waiting now; later waiters wait for the
        next release."""
        # Every lease's release pulses (four a request): without sleepers it builds nothing.
        if self._sleepers:
            freed, self._freed = self._freed, asyncio.Event()
            freed.set()

    async def wait_freed(self, max_wait_s: float) -> None:
        """Sleep until some in-flight request ends (a slot likely freed), at most `max_wait_s`."""
        if max_wait_s <= 0:
            return
        self._sleepers += 1
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._freed.wait(), max_wait_s)
        finally:
            self._sleepers -= 1

    def totals(self) -> tuple[int, int]:
        """(open streams, in flight) of this gateway over all instances; 0 when nothing leaked."""
        return (
            sum(c.open_streams for c in self._counters.values()),
            sum(c.inflight for c in self._counters.values()),
        )

    def describe(self) -> Iterator[dict[str, object]]:
        """Rows for ``GET /admin/instances``: this gateway's counts and the fleet's."""
        now = time.monotonic()
        for rec in sorted(self._records.values(), key=lambda r: (r.role, r.id)):
            c = self._for(rec.id)
            yield {
                "id": rec.id,
                "role": rec.role.value,
                "url": rec.url,
                "model": rec.model,
                "group": rec.group,
                "state": rec.state.value,
                "capacity": rec.capacity,
                "open_streams": c.open_streams,
                "inflight": c.inflight,
                "computing": c.computing,
                "inflight_tokens": c.inflight_tokens,
                "fleet_open_streams": c.open_streams + c.others_streams,
                "fleet_inflight": c.inflight + c.others_slots,
                "fleet_computing": c.computing + c.others_computing,
                "busy": c.busy_until > now,
                "ejected": c.ejected_until > now,
                "accepted": c.accepted,
                "rejected": c.rejected,
                "failed": c.failed,
                "version": rec.version,
                "started_at": rec.started_at,
                "hardware": rec.hardware,
                "kv_events": rec.kv_events,
                "max_model_len": rec.max_model_len or None,
                "adapters": list(rec.adapters),
                "endpoints": list(rec.endpoints),
                "speed": self._speed(rec),
            }


def _nothing() -> None:
    return None
