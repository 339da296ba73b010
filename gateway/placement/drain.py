"""How fast a queue drains, so that a request it cannot serve in time is refused on arrival.

Past capacity, a gateway-held queue grows until its requests wait out their deadlines: with
a bound of a thousand, every client waits its whole TTFT budget for a 503. A client told at
once can go elsewhere or back off. So on arrival a request is refused with 503 and
``Retry-After`` when even the fleet's recent pace cannot bring it to the front of this
gateway's queue before its deadline:

    ahead / rate > time left

``rate`` is the grants per second (prefills' answers) for this queue's model and group
**while this queue was saturated**: it held requests and the forwarder found no prefill to
send them to (all full, or yielding to another gateway's more urgent request), from that
moment until the queue next emptied. Only then do grants measure capacity: a queue that is
often empty drains as fast as requests arrive, and the grants that fill idle prefills are
not counted either. The saturated seconds and their grants are summed over the last
`window_s`, across the short lulls in between, and a pace is given once there are
`min_span_s` saturated seconds with at least `min_grants` grants: below that there is no
evidence and the request is queued as before.

Why across lulls. A closed loop of users near capacity empties the queue every few seconds,
and a new backlog starts when every prefill has just taken a run: its first second holds
few answers (prefills with long prompts compute), the seconds after a burst of them. A
pace read from the current backlog alone read a third of the real one there and refused
requests that the next second's grants would have reached (docs/results/fleet/README.md,
"Refusal storms").

The grants counted are the whole fleet's: this gateway's as they happen, the other
gateways' as each sync reports them (`samples_out`, within one sync interval). ``ahead`` is
a lower bound of the requests that go before it here (queue.py, `WaitQueue.ahead`): more
urgent classes, and its own tenant's requests due before it. Other tenants' requests are
not counted (fair sharing may let it pass them), nor are the other gateways', so the
estimate errs toward admitting; early drop at the head (admission.py) still catches what
slips through.

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
deadlines. It matters at a backlog's start: the runs of the prefills that were idle when
it began all answer in its first seconds, so those seconds' pace overstates the fleet's,
and what it admits then the steady pace may not reach (docs/results/chaos/README.md).
Under heavy overload admission keeps headroom (`drain_headroom`): it counts on that
fraction less of the reach, and the sweep refuses only what that fraction more misses. A
queue held at the edge of the reach has its tail refused late by every dip of the measured
pace; a dip within the headroom refuses nobody late. The headroom grows with how far
arrivals outrun the pace (`ArrivalRate`), from none at twice the pace to all of it at five
times. The queue then refills at once, so keeping it shorter costs no grant, and a request
refused late has waited for nothing: its place goes to a new arrival, not to a grant. Near
capacity a shorter queue would cost: a lone gateway's refused at once requests it would
have served. The arrivals are measured, not the share of them refused, which says the same
in the steady state (four in five refused: arrivals at five times the pace) but only once
the queue has reached the edge: by then a sudden overload's first second has filled the
queue to the edge, and its tail is refused late.

The decodes bound the pace too (`DecodeCapacity`). A decode that answers 429 when its slots
are full takes at most slots / (the mean time a request holds one) requests a second:
Little's law, from the streams the fleet opened on it. So in the next ``t`` seconds a
queue can count on at most that rate times ``t`` plus the decode slots free now (`Pace`).
That is the bound at a backlog's start, where the grants fill idle decodes (and, before a
second of it, give no pace at all), and it is never above what the decodes can do: their
streams measured with fewer beside them were faster, not slower. A model whose decodes do
not declare their slots hard (stock servers) has no such bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
from bisect import bisect_left, bisect_right, insort
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass

from pdgate.config.wire import EXT_QUEUELESS, Role
from pdgate.gateway.instances.tracker import InstanceTracker
from pdgate.gateway.observe.window import TimeWindow

__all__ = ["ArrivalRate", "DecodeCapacity", "DecodeTurn", "DecodeWaits", "Pace", "QueueDrain"]

# Saturated spans kept: many more than a window holds in practice (each begins when the
# forwarder finds no room and ends when the queue empties). Past this, the oldest go and
# the window starts where the kept history does.
_MAX_SPANS = 512
# Dropped entries stay in their lists until they are this many and half of them: the lists
# are cut in chunks, not on every grant or span.
_COMPACT_AT = 64


class QueueDrain:
    """A queue's grant rate while saturated: `saturated(now)` when the forwarder finds no
    prefill for a queued request, `drained(now)` when the queue empties, `granted(now, n)`
    for every `n` requests a prefill accepted (here or, as reported, at another gateway).

    `rate` is asked on every arrival while requests wait: it bisects running totals of the
    grants and of the saturated seconds, never walks them."""

    __slots__ = (
        "_base",
        "_begins",
        "_ends",
        "_head",
        "_held",
        "_held_base",
        "_min_grants",
        "_min_span",
        "_open",
        "_span_head",
        "_times",
        "_totals",
        "_window",
    )

    def __init__(
        self, *, window_s: float = 5.0, min_span_s: float = 1.0, min_grants: int = 4
    ) -> None:
        if window_s <= 0 or not 0 <= min_span_s <= window_s or min_grants < 1:
            raise ValueError("need window_s > 0, 0 <= min_span_s <= window_s, min_grants >= 1")
        self._window = window_s
        self._min_span = min_span_s
        self._min_grants = min_grants
        # When grants came while saturated, ascending, and the running total of grants up
        # to and including each; those before `_head` are out of the window. Bounded by the
        # grants and reports one window holds (compacted as the head moves on).
        self._times: list[float] = []
        self._totals: list[int] = []
        self._head = 0
        self._base = 0  # the running total before `_times[0]` (grants compacted away)
        # Closed saturated spans, oldest first: where each began and ended, and the running
        # total of their seconds up to and including each; those before `_span_head` are
        # out of the window or past `_MAX_SPANS`. The start of the open one.
        self._begins: list[float] = []
        self._ends: list[float] = []
        self._held: list[float] = []
        self._held_base = 0.0  # the running total before `_ends[0]`
        self._span_head = 0
        self._open: float | None = None

    def saturated(self, now: float) -> None:
        if self._open is None:
            self._open = max(now, self._ends[-1]) if self._ends else now

    def drained(self, now: float) -> None:
        begin, self._open = self._open, None
        if begin is None or now <= begin:
            return
        begins, ends, held = self._begins, self._ends, self._held
        begins.append(begin)
        ends.append(now)
        held.append((held[-1] if held else self._held_base) + now - begin)
        head = max(
            self._span_head,
            len(ends) - _MAX_SPANS,
            bisect_left(ends, now - self._window, self._span_head),
        )
        if head > _COMPACT_AT and head * 2 > len(ends):
            self._held_base = held[head - 1]
            del begins[:head], ends[:head], held[:head]
            head = 0
        self._span_head = head

    def granted(self, now: float, count: int = 1) -> None:
        if count < 1 or self._open is None:
            return  # a grant outside saturation says how fast requests came, not capacity
        times, totals = self._times, self._totals
        if times and now < times[-1]:
            now = times[-1]  # kept ascending
        times.append(now)
        totals.append((totals[-1] if totals else 0) + count)
        if times[self._head] < now - self._window:
            self._head = bisect_left(times, now - self._window, self._head)
            if self._head > _COMPACT_AT and self._head * 2 > len(times):
                self._base = totals[self._head - 1]
                del times[: self._head]
                del totals[: self._head]
                self._head = 0

    def rate(self, now: float) -> float | None:
        """Grants per saturated second over the last `window_s` (None: too few saturated
        seconds or too few grants to say)."""
        start = now - self._window
        ends, head = self._ends, self._span_head
        if len(ends) - head >= _MAX_SPANS:
            start = max(start, self._begins[head])  # the history kept begins there
        span = 0.0 if self._open is None else now - max(self._open, start)
        first = bisect_right(ends, start, head)  # the first span to end inside the window
        if first < len(ends):
            before = self._held[first - 1] if first else self._held_base
            span += self._held[-1] - before - max(0.0, start - self._begins[first])
        if span < self._min_span:
            return None
        first = bisect_left(self._times, start, self._head)
        if first == len(self._times):
            return None
        totals = self._totals
        grants = totals[-1] - (totals[first - 1] if first else self._base)
        return grants / span if grants >= self._min_grants else None


class ArrivalRate:
    """A queue's arrivals per second, each arrival's weight halving every `half_life_s`, and
    how much of the headroom that calls for against the pace the queue drains at."""

    __slots__ = ("_at", "_count", "_decay")

    def __init__(self, half_life_s: float = 0.5) -> None:
        if half_life_s <= 0:
            raise ValueError("need half_life_s > 0")
        self._decay = math.log(2) / half_life_s
        self._count = 0.0  # the arrivals' weights as of `_at`
        self._at = 0.0

    def arrived(self, now: float) -> None:
        self._count = self._weight(now) + 1.0
        self._at = max(now, self._at)

    def _weight(self, now: float) -> float:
        if now <= self._at:
            return self._count
        return self._count * math.exp(self._decay * (self._at - now))

    def per_s(self, now: float) -> float:
        """Arrivals a second (a steady rate reads as itself once a few half-lives in)."""
        return self._weight(now) * self._decay

    def headroom_part(self, now: float, pace_per_s: float) -> float:
        """How much of the headroom applies: none while arrivals come at most twice as fast
        as the pace serves them, all of it from five times on (four in five refused)."""
        if pace_per_s <= 0:
            return 1.0
        return min(1.0, max(0.0, (self.per_s(now) / pace_per_s - 2.0) / 3.0))


@dataclass(frozen=True, slots=True)
class Pace:
    """What a queue can count on: `rate` grants a second (measured while saturated) and at
    most `cap` a second beyond the `free` decode slots (the decodes' bound); None: unknown."""

    rate: float | None
    cap: float | None = None
    free: int = 0

    @property
    def per_s(self) -> float:
        """Grants a second to count on past the free slots (inf: unknown)."""
        measured = math.inf if self.rate is None else self.rate
        return min(measured, math.inf if self.cap is None else self.cap)

    def reach(self, seconds: float) -> float:
        """How many requests ahead it serves in `seconds`."""
        measured = math.inf if self.rate is None else self.rate * seconds
        bound = math.inf if self.cap is None else self.cap * seconds + self.free
        return min(measured, bound)


# (model, decode group) pairs with a hold time kept: they come from the registry, this is a
# backstop. And this gateway's samples kept for the fleet between two syncs.
_MAX_GROUPS = 256
_MAX_NEW = 1024


class DecodeCapacity:
    """The most requests a second a model's decodes can take, by Little's law: each decode
    that enforces its slots (``EXT_QUEUELESS``: 429 when full) serves at most its slots over
    the mean time a request holds one. That time is measured per model and decode group
    over the last `window_s` from every stream opened on a decode, whatever its end (a
    cancelled one frees its slot early, and counting only whole ones would read low): this
    gateway's, and the fleet's other gateways' as their syncs bring them (`samples_out`,
    `samples_in`), so that a gateway new to the fleet is bounded from its first request."""

    def __init__(
        self, tracker: InstanceTracker, *, window_s: float = 60.0, min_samples: int = 20
    ) -> None:
        if window_s <= 0 or min_samples < 1:
            raise ValueError("need window_s > 0 and min_samples >= 1")
        self._tracker = tracker
        self._window_s = window_s
        self._min_samples = min_samples
        self._held: dict[tuple[str, str], TimeWindow] = {}
        self._new: deque[str] = deque(maxlen=_MAX_NEW)  # "h SECONDS DECODE_ID", unsent

    def held(self, instance_id: str, seconds: float) -> None:
        """A request held a slot of decode `instance_id` for `seconds` (its stream ended)."""
        if self._add(instance_id, seconds) and ";" not in instance_id:
            self._new.append(f"h {seconds:.4f} {instance_id}")  # ";" separates samples

    def _add(self, instance_id: str, seconds: float) -> bool:
        rec = self._tracker.records().get(instance_id)
        if rec is None or rec.role is not Role.DECODE or not 0 <= seconds < math.inf:
            return False
        window = self._held.get((rec.model, rec.group))
        if window is None:
            if len(self._held) >= _MAX_GROUPS:
                return False
            window = self._held[rec.model, rec.group] = TimeWindow(self._window_s, 1)
        window.add(seconds)
        return True

    def samples_out(self) -> list[str]:
        """This gateway's hold times since the last call, as the fleet's samples carry them:
        "h SECONDS DECODE_ID" (each receiver finds the decode's model and group)."""
        out = list(self._new)
        self._new.clear()
        return out

    def samples_in(self, packed: str) -> str:
        """Take another gateway's hold times out of one entry of its samples (items split
        by ";"), and give back the rest. Malformed ones and unknown decodes are skipped."""
        if "h " not in packed:
            return packed
        rest = []
        for item in packed.split(";"):
            if not item.startswith("h "):
                rest.append(item)
                continue
            secs, _, instance_id = item[2:].partition(" ")
            with contextlib.suppress(ValueError):
                self._add(instance_id, float(secs))
        return ";".join(rest)

    def hold_s(self, model: str, group: str) -> float | None:
        """The mean time a request held a slot of a decode of `model` in `group` (None: too
        few samples)."""
        window = self._held.get((model, group))
        if window is None:
            return None
        count, (total,) = window.totals()
        return total / count if count >= self._min_samples and total > 0 else None

    def bound(self, model: str, group: str | None) -> Pace | None:
        """The pace the ready decodes of `model` in `group` (None: any) allow, with their
        slots free now as this gateway counts them (another gateway's streams are not
        seen: it errs toward admitting). None where one of them does not enforce its slots
        or its group's hold time is not known yet."""
        records = self._tracker.records()
        cap, free = 0.0, 0
        loads = self._tracker.loads(Role.DECODE, model, group)
        for d in loads:
            rec = records.get(d.id)
            if rec is None or EXT_QUEUELESS not in rec.extensions:
                return None
            hold = self.hold_s(model, rec.group)
            if hold is None:
                return None
            cap += rec.capacity / hold
            free += max(0, rec.capacity - d.inflight)
        return Pace(None, cap, free) if loads else None


class DecodeTurn:
    """One request's place in its line for a decode slot (`DecodeWaits.join`)."""

    __slots__ = ("key", "line", "woken")

    def __init__(self, line: tuple[str, str | None], key: tuple[int, float, int]) -> None:
        self.line = line
        self.key = key  # (0: a resumed stream, else 1; deadline; arrival): lower goes first
        self.woken = asyncio.Event()  # a slot freed for it: its turn to try


class DecodeWaits:
    """Prefilled requests waiting for a decode slot: one line per model and group, resumed
    streams (failover, migration) first, then by deadline, then by arrival. Each slot that
    frees at a decode (`InstanceTracker.slot_freed`) wakes one waiter, the first in the
    lines that decode serves not woken yet; a waiter that leaves having been woken and placed
    nothing passes its turn on to the next, so no freed slot goes unused while some wait.

    While one waits, the decodes are the bottleneck, and the prefill queue of its model and
    group holds its requests (`AdmissionOptions.decode_backpressure`): a request prefilled
    then would wait for a decode behind the queue, where neither the queue's deadline order
    nor drain admission sees it, and be refused at its deadline instead of on arrival. The
    prefills in flight still join the wait, so a decode slot that frees finds a prefilled
    request ready. The last waiter to leave wakes the forwarders. Bounded by the requests
    waiting, each of which leaves exactly once (decode_leg.py)."""

    __slots__ = ("_arrivals", "_lines", "_tracker")

    def __init__(self, tracker: InstanceTracker) -> None:
        self._tracker = tracker
        # (model, group) -> its waiters, sorted by key.
        self._lines: dict[tuple[str, str | None], list[DecodeTurn]] = {}
        self._arrivals = itertools.count()
        tracker.slot_freed = self.freed

    def waiting(self, model: str, group: str | None) -> int:
        return len(self._lines.get((model, group), ()))

    def total(self) -> int:
        return sum(len(line) for line in self._lines.values())

    def join(self, model: str, group: str | None, deadline: float, *, resumed: bool) -> DecodeTurn:
        turn = DecodeTurn((model, group), (0 if resumed else 1, deadline, next(self._arrivals)))
        insort(self._lines.setdefault(turn.line, []), turn, key=_turn_key)
        return turn

    def ahead(self, model: str, group: str | None, deadline: float, *, resumed: bool) -> bool:
        """Whether a request with this deadline would wait behind someone in its line."""
        line = self._lines.get((model, group))
        return line is not None and line[0].key[:2] <= (0 if resumed else 1, deadline)

    async def wait(self, turn: DecodeTurn, max_wait_s: float) -> None:
        """Until a freed slot wakes `turn`, at most `max_wait_s` (a back-off: a slot may
        also free where no release tells, such as a new decode or another gateway's)."""
        turn.woken.clear()
        if max_wait_s > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max_wait_s):
                    await turn.woken.wait()

    def leave(self, turn: DecodeTurn, *, placed: bool) -> None:
        """`turn` leaves its line (exactly once: placed, failed, cancelled or out of time)."""
        line = self._lines.get(turn.line)
        if line is None:
            return
        at = bisect_left(line, turn.key, key=_turn_key)
        if at < len(line) and line[at] is turn:
            del line[at]
        if not line:
            del self._lines[turn.line]
        if turn.woken.is_set() and not placed:
            self._wake((turn.line,))  # the slot freed for it is the next one's
        if not self._lines.get(turn.line):
            self._tracker.pulse()

    def freed(self, instance_id: str) -> None:
        """A slot of `instance_id` freed: if it is a decode, wake the first waiter not woken
        yet among the lines it serves (its model's or adapter's, its group's or any)."""
        rec = self._tracker.records().get(instance_id)
        if rec is None or rec.role is not Role.DECODE or not self._lines:
            return
        names = (rec.model, *rec.adapters)
        self._wake([(n, g) for n in names for g in (rec.group, None)])

    def _wake(self, lines: Collection[tuple[str, str | None]]) -> None:
        first: DecodeTurn | None = None
        for key in lines:
            for turn in self._lines.get(key, ()):
                if not turn.woken.is_set():
                    if first is None or turn.key < first.key:
                        first = turn
                    break
        if first is not None:
            first.woken.set()


def _turn_key(turn: DecodeTurn) -> tuple[int, float, int]:
    return turn.key
