"""Drain admission: a request the queue's recent pace cannot reach before its deadline is
refused on arrival (503, Retry-After), not after waiting out its deadline; one the pace can
reach, or one that goes first, is queued as before."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import aiohttp
import pytest

from pdgate.config import QueueOrder, Role
from pdgate.config.aio import Background
from pdgate.config.wire import EXT_QUEUELESS
from pdgate.gateway.api.completions import TTFT_HEADER
from pdgate.gateway.errors import DeadlineExceeded, Overloaded
from pdgate.gateway.instances.tracker import InstanceTracker
from pdgate.gateway.observe.metrics import GatewayMetrics
from pdgate.gateway.placement.dispatch import client_error
from pdgate.gateway.placement.drain import (
    ArrivalRate,
    DecodeCapacity,
    DecodeWaits,
    Pace,
    QueueDrain,
)
from pdgate.gateway.placement.forwarder import ForwardingOptions, PrefillForwarder
from pdgate.gateway.placement.queue import Waiter, WaitQueue
from pdgate.gateway.upstream.mock import MockUpstream
from pdgate.registry.base import InstanceRecord
from tests._cluster import SIM_MODEL, Processes, counts_released, wait_for, wait_instances
from tests.gateway._fakes import FakeCluster, eventually, forwarder, info, tracker_for, waiter


def _saturated(drain: QueueDrain, begin: float, end: float, per_s: float) -> None:
    """`per_s` grants a second while saturated from `begin` until the queue empties at `end`."""
    drain.saturated(begin)
    n = round((end - begin) * per_s)
    for i in range(1, n + 1):
        drain.granted(begin + i / per_s)
    drain.drained(end)


def test_no_rate_without_saturation_long_enough_and_grants_enough() -> None:
    drain = QueueDrain(window_s=5.0, min_span_s=1.0, min_grants=4)
    for t in (9.5, 9.7, 9.9):
        drain.granted(t)  # not saturated: how fast requests came, not capacity
    assert drain.rate(10.0) is None
    drain.saturated(10.0)
    for t in (10.1, 10.2, 10.3, 10.4, 10.5):
        drain.granted(t)
    assert drain.rate(10.6) is None  # 0.6 saturated seconds: too few to say
    assert drain.rate(11.0) == pytest.approx(5.0)  # 5 grants in its 1 s
    drain.drained(11.0)
    assert drain.rate(11.5) == pytest.approx(5.0)  # a lull counts neither time nor grants


def test_the_pace_carries_across_a_lull() -> None:
    """Near capacity the queue empties every few seconds, and a new backlog begins when
    every prefill has just taken a run: its first second holds few answers. The seconds
    saturated before the lull still count, so that second does not read as the pace."""
    drain = QueueDrain(window_s=5.0, min_span_s=1.0, min_grants=4)
    _saturated(drain, 0.0, 4.0, 20.0)
    drain.saturated(4.2)
    for t in (4.6, 5.0, 5.3):
        drain.granted(t)  # a slow second: long prompts computing everywhere
    # 0.3..4.0 at 20 a second and 3 since 4.2: 77 grants in 4.8 saturated seconds
    assert drain.rate(5.3) == pytest.approx(77 / 4.8, rel=0.02)


def test_the_rate_counts_the_last_window_only() -> None:
    drain = QueueDrain(window_s=2.0, min_span_s=0.5, min_grants=1)
    drain.saturated(0.0)
    for i in range(400):  # 10 a second for 40 s, then 40 a second for 2 s
        drain.granted(i / 10)
    for i in range(80):
        drain.granted(40 + i / 40)
    assert drain.rate(42.0) == pytest.approx(40.0)
    assert len(drain._times) < 200  # the old grants are dropped as the window moves


def test_spans_are_bounded_and_the_window_starts_where_they_do() -> None:
    drain = QueueDrain(window_s=5.0, min_span_s=0.1, min_grants=1)
    for i in range(5000):  # 1,000 saturated spans a second, 0.5 ms each
        _saturated(drain, i / 1000, i / 1000 + 0.0005, 4000.0)
    assert len(drain._ends) - drain._span_head <= 512
    assert len(drain._ends) <= 2 * 512  # the dropped ones go in chunks
    assert drain.rate(5.0) == pytest.approx(4000.0, rel=0.01)


def test_the_saturated_seconds_are_summed_as_walking_the_spans_would() -> None:
    """The rate bisects running totals; any mix of spans, lulls and windows reads what
    summing the spans inside the window reads."""
    rng = random.Random(7)
    drain = QueueDrain(window_s=2.0, min_span_s=0.0, min_grants=1)
    spans: list[tuple[float, float]] = []
    t = 0.0
    for _ in range(3000):
        begin = t + rng.choice((0.0, rng.uniform(0, 0.05)))
        end = begin + rng.uniform(0, 0.03)
        drain.saturated(begin)
        drain.granted(end)
        drain.drained(end)
        if end > begin:
            spans.append((begin, end))
        t = end
        now = t + rng.uniform(0, 0.5)
        kept = spans[-512:]
        start = max(now - 2.0, kept[0][0] if len(kept) == 512 else -1.0)
        held = sum(e - max(b, start) for b, e in kept if e > start)
        rate = drain.rate(now)
        if held > 0:
            grants = sum(1 for _, e in spans if e >= start)
            assert rate == pytest.approx(grants / held, rel=1e-6), (now, held)


def test_a_steady_pace_reads_the_same_before_and_after_old_grants_are_dropped() -> None:
    """The window drops old grants in chunks; whatever is left, the rate counts the window's
    grants only, never those dropped (the whole history would read as a burst)."""
    drain = QueueDrain(window_s=5.0, min_span_s=1.0, min_grants=1)
    drain.saturated(0.0)
    rates = []
    for i in range(2000):  # 100 a second for 20 s
        drain.granted(i / 100)
        if i >= 600:
            rates.append(drain.rate(i / 100))
    assert min(rates) == pytest.approx(100.0, rel=0.01)
    assert max(rates) == pytest.approx(100.0, rel=0.01)


def test_a_report_of_many_grants_counts_each() -> None:
    drain = QueueDrain(window_s=2.0, min_span_s=0.5, min_grants=4)
    drain.saturated(9.0)
    drain.granted(10.0)
    drain.granted(10.5, 30)  # another gateway's sync
    drain.granted(10.2)  # an earlier reading, counted as of the latest
    drain.granted(10.6, 0)
    assert drain.rate(11.0) == pytest.approx(32 / 2.0)
    assert drain.rate(12.4) == pytest.approx(31 / 2.0)  # the first left the window
    assert drain.rate(13.0) is None  # every grant left it


async def test_ahead_counts_what_surely_goes_first() -> None:
    def w(deadline: float, tenant: str = "a", priority: int = 1) -> Waiter:
        return Waiter(
            info=replace(info("p"), tenant=tenant, priority=priority),
            body={},
            request_id="r",
            deadline=deadline,
            future=asyncio.get_running_loop().create_future(),
        )

    edf = WaitQueue(100, QueueOrder.EDF)
    for d in (1, 2, 3, 4):
        edf.push(w(d))
    edf.push(w(5, tenant="b"))  # another tenant: fair sharing may let "a" pass it
    edf.push(w(9, priority=0))  # a more urgent class: always first
    assert edf.ahead(w(2.5)) == 1 + 2
    assert edf.ahead(w(0.5)) == 1
    assert edf.ahead(w(10)) == 1 + 4
    assert edf.ahead(w(10, priority=0)) == 1
    assert edf.ahead(w(10, tenant="c")) == 1
    fifo = WaitQueue(100, QueueOrder.FIFO)
    for d in (4, 3, 2, 1):
        fifo.push(w(d))
    assert fifo.ahead(w(0.5)) == 4


@dataclass
class _Paced:
    fwd: PrefillForwarder
    upstream: MockUpstream
    metrics: GatewayMetrics


@contextlib.asynccontextmanager
async def _paced_backlog(order: QueueOrder, *, drain: bool) -> AsyncIterator[_Paced]:
    """One prefill of one slot, 0.05 s a prompt (about 20 grants a second), and 80 requests
    due in 30 s queued for over a second, so the pace is known; no sweep unless a test
    turns it on; all of it cancelled and closed on exit."""
    upstream = MockUpstream(FakeCluster(prefill_delay_s=0.05))
    fwd, metrics, background = forwarder(
        upstream,
        tracker_for([1]),
        ForwardingOptions(client_error=client_error, drain_admission=drain, drain_sweep=False),
        order=order,
    )
    tasks = [asyncio.create_task(_take(fwd, waiter(i, deadline_s=30))) for i in range(80)]
    try:
        await asyncio.sleep(1.3)  # a second of backlog: the pace is known
        assert len(fwd.queue) > 40
        yield _Paced(fwd, upstream, metrics)
    finally:
        await _stop(fwd, background, tasks)


async def _stop(
    fwd: PrefillForwarder, background: Background, tasks: list[asyncio.Task[None]]
) -> None:
    """Cancel `tasks` and close the forwarder once nothing waits in it."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await eventually(lambda: fwd.waiting == 0)
    await fwd.close()
    await background.aclose()


async def _take(fwd: PrefillForwarder, w: Waiter) -> None:
    (await fwd.acquire(w)).close()


async def test_a_request_the_pace_cannot_reach_in_time_is_refused_at_once() -> None:
    async with _paced_backlog(QueueOrder.FIFO, drain=True) as p:
        calls = len(p.upstream.calls)
        arrival = p.fwd.acquire(waiter(100, deadline_s=1.0))
        with pytest.raises(Overloaded, match="would not reach this request") as refused:
            arrival.send(None)  # refused before its first await: on arrival, not queued
        assert refused.value.retry_after is not None
        sheds = p.metrics.registry.get_sample_value("pdgate_queue_sheds_total", {"reason": "drain"})
        assert sheds == 1
        # One the pace reaches in time is queued and served.
        await _take(p.fwd, waiter(101, deadline_s=20.0))
        assert len(p.upstream.calls) > calls


async def _waits_out_its_deadline(p: _Paced) -> None:
    """A request the pace cannot reach is queued, not refused: a 503 at its deadline."""
    began = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        await p.fwd.acquire(waiter(100, deadline_s=1.0))
    assert time.monotonic() - began >= 0.95
    sheds = p.metrics.registry.get_sample_value("pdgate_queue_sheds_total", {"reason": "drain"})
    assert sheds in (None, 0)


async def test_without_drain_admission_it_waits_out_its_deadline() -> None:
    async with _paced_backlog(QueueOrder.FIFO, drain=False) as p:
        await _waits_out_its_deadline(p)


async def test_an_urgent_request_goes_first_however_long_the_queue() -> None:
    """EDF: a request due before everything queued has nobody ahead of it; it is admitted
    and served in time, where counting the whole queue would have refused it."""
    async with _paced_backlog(QueueOrder.EDF, drain=True) as p:
        await _take(p.fwd, waiter(100, deadline_s=1.0))
        assert len(p.fwd.queue) > 20  # it passed the backlog


async def test_a_slow_second_at_a_backlogs_start_does_not_hide_the_pace() -> None:
    """Near capacity a new backlog often begins with a slow second (every prefill has just
    taken a long run). Judged by that second alone, a request the pace reaches in time
    would be refused; judged by the saturated seconds before the lull as well, it is
    queued and served."""
    cluster = FakeCluster(prefill_delay_s=0.05)
    upstream = MockUpstream(cluster)
    fwd, metrics, background = forwarder(
        upstream,
        tracker_for([1]),
        ForwardingOptions(client_error=client_error, drain_sweep=False),
        order=QueueOrder.FIFO,
    )
    slow: list[asyncio.Task[None]] = []
    try:
        # Two seconds at capacity, 20 grants a second, until the queue empties.
        await asyncio.gather(*(_take(fwd, waiter(i, deadline_s=30)) for i in range(40)))
        cluster.prefill_delay_s = 0.2  # then a slow second and a half: 7 grants
        slow = [asyncio.create_task(_take(fwd, waiter(100 + i, deadline_s=30))) for i in range(20)]
        await asyncio.sleep(1.5)
        assert 9 <= len(fwd.queue) <= 14
        cluster.prefill_delay_s = 0.05
        # Some 12 ahead, 1.5 s left: this backlog's 7 grants in 1.5 s reach 7 of them; the
        # 47 of the last 3.5 saturated seconds reach 20, and 20 a second serve them in 0.8 s.
        await _take(fwd, waiter(200, deadline_s=1.5))
        sheds = metrics.registry.get_sample_value("pdgate_queue_sheds_total", {"reason": "drain"})
        assert sheds in (None, 0)
        await asyncio.gather(*slow)
    finally:
        for t in slow:
            t.cancel()
        await asyncio.gather(*slow, return_exceptions=True)
        await fwd.close()
        await background.aclose()


async def test_under_heavy_overload_admission_keeps_headroom_below_the_sweeps_reach() -> None:
    """A request the pace reaches with a fifth of its time to spare is queued while requests
    arrive about as fast as the queue drains. Once they arrive five times as fast, the same
    request is refused on arrival: `drain_headroom` 0.3 applies, where a dip of the pace past
    a fifth would have had the sweep refuse it late."""
    async with _paced_backlog(QueueOrder.FIFO, drain=True) as p:
        assert p.fwd._options.drain_headroom == 0.3  # the default

        def at_the_edge(i: int) -> Waiter:
            pace = p.fwd._pace(time.monotonic())
            assert pace is not None and pace.rate
            return waiter(i, deadline_s=1.25 * len(p.fwd.queue) / pace.rate)

        queued = asyncio.create_task(p.fwd.acquire(at_the_edge(100)))
        await asyncio.sleep(0.01)
        assert not queued.done()
        queued.cancel()
        await asyncio.gather(queued, return_exceptions=True)
        assert p.fwd.drain_view()[2] == 0.0  # the headroom in force, as /metrics shows it
        for i in range(80):  # a burst: 80 arrivals where the queue drains 20 a second
            with pytest.raises(Overloaded):
                await p.fwd.acquire(waiter(200 + i, deadline_s=0.2))
        pace, arrivals, headroom = p.fwd.drain_view()
        assert pace is not None and arrivals > 5 * pace and headroom == 0.3
        with pytest.raises(Overloaded, match="would not reach this request"):
            await p.fwd.acquire(at_the_edge(101))
        # Without the setting, the same arrival is queued however many are refused.
        p.fwd._options = replace(p.fwd._options, drain_headroom=0.0)
        queued = asyncio.create_task(p.fwd.acquire(at_the_edge(102)))
        await asyncio.sleep(0.01)
        assert not queued.done()
        queued.cancel()
        await asyncio.gather(queued, return_exceptions=True)


def test_the_arrival_rate_weighs_recent_arrivals_most() -> None:
    arrivals = ArrivalRate(half_life_s=1.0)
    assert arrivals.per_s(0.0) == 0.0
    for i in range(400):  # 20 a second for 20 s: read as 20 a second
        arrivals.arrived(i / 20)
    assert arrivals.per_s(20.0) == pytest.approx(20.0, rel=0.05)
    assert arrivals.per_s(22.0) == pytest.approx(5.0, rel=0.05)  # two half-lives later
    assert arrivals.headroom_part(22.0, pace_per_s=2.5) == 0.0  # at twice the pace: none
    assert arrivals.headroom_part(22.0, pace_per_s=0.9) == 1.0  # past five times: all
    assert arrivals.headroom_part(22.0, pace_per_s=5.0 / 3.5) == pytest.approx(0.5, rel=0.05)


async def test_requests_queued_before_the_pace_was_known_are_refused_once_it_is() -> None:
    """A request queued when nothing could be judged (here: drain admission off as it came)
    that the pace shows out of reach is told 503 at the next arrival's sweep, not at its
    deadline."""
    async with _paced_backlog(QueueOrder.FIFO, drain=False) as p:
        doomed = asyncio.create_task(_take(p.fwd, waiter(100, deadline_s=1.5)))
        await asyncio.sleep(0.01)
        assert not doomed.done()  # queued behind some forty requests, 20 served a second
        p.fwd._options = replace(p.fwd._options, drain_admission=True)
        first = asyncio.create_task(_take(p.fwd, waiter(99, deadline_s=20.0)))
        await asyncio.sleep(0.01)
        assert not doomed.done()  # no sweep unless asked for
        p.fwd._options = replace(p.fwd._options, drain_sweep=True)
        began = time.monotonic()
        reached = asyncio.create_task(_take(p.fwd, waiter(101, deadline_s=20.0)))
        with pytest.raises(Overloaded, match="would not reach this request"):
            await doomed
        assert time.monotonic() - began < 0.5  # long before its deadline
        await reached  # the arrival itself is queued and served
        await first
        sheds = p.metrics.registry.get_sample_value("pdgate_queue_sheds_total", {"reason": "drain"})
        assert sheds == 1


async def test_under_heavy_overload_the_sweep_spares_what_the_headroom_covers() -> None:
    """A queued request some 15% beyond the pace's reach is refused by the sweep near
    capacity. Under heavy overload the sweep gives as much headroom above the reach as
    admission keeps below it: a dip of the pace does not refuse late a request admitted
    near the edge, whose place would only go to a new arrival."""
    async with _paced_backlog(QueueOrder.FIFO, drain=False) as p:
        pace = p.fwd._pace(time.monotonic())
        assert pace is not None and pace.rate
        kept = asyncio.create_task(
            _take(p.fwd, waiter(100, deadline_s=len(p.fwd.queue) / (1.15 * pace.rate)))
        )
        await asyncio.sleep(0.01)
        assert not kept.done()  # queued: nothing judged it on arrival
        p.fwd._options = replace(p.fwd._options, drain_admission=True)
        for i in range(80):  # a burst, refused on arrival: arrivals at five times the pace
            with pytest.raises(Overloaded):
                await p.fwd.acquire(waiter(200 + i, deadline_s=0.2))
        assert p.fwd.drain_view()[2] == 0.3
        p.fwd._options = replace(p.fwd._options, drain_sweep=True)
        with pytest.raises(Overloaded):
            await p.fwd.acquire(waiter(300, deadline_s=0.2))  # its arrival sweeps the queue
        await asyncio.sleep(0.01)
        assert not kept.done()
        # The same sweep without headroom refuses it.
        p.fwd._options = replace(p.fwd._options, drain_headroom=0.0)
        p.fwd._next_sweep = 0.0
        with pytest.raises(Overloaded):
            await p.fwd.acquire(waiter(301, deadline_s=0.2))
        with pytest.raises(Overloaded, match="would not reach this request"):
            await kept


async def test_a_request_admitted_before_is_neither_refused_nor_swept() -> None:
    """A failover or a stream continuing after its decode broke queues again: drain
    admission judged it like an arrival and cut streams that had sent hundreds of tokens
    (chaos run). It waits for its turn, at worst until its deadline."""
    async with _paced_backlog(QueueOrder.FIFO, drain=True) as p:
        again = waiter(100, deadline_s=1.5)
        again.admitted = True
        kept = asyncio.create_task(_take(p.fwd, again))  # the pace cannot reach it in time
        await asyncio.sleep(0.01)
        assert not kept.done()
        p.fwd._next_sweep = 0.0
        with pytest.raises(Overloaded, match="would not reach this request"):
            await p.fwd.acquire(waiter(101, deadline_s=1.5))  # an arrival: refused, sweeps
        await asyncio.sleep(0.01)
        assert not kept.done()
        with pytest.raises(DeadlineExceeded):
            await kept
        sheds = p.metrics.registry.get_sample_value("pdgate_queue_sheds_total", {"reason": "drain"})
        assert sheds == 1  # the arrival only


def test_beyond_reach_counts_each_waiter_as_ahead_does() -> None:
    loop = asyncio.new_event_loop()
    try:

        def w(deadline: float, tenant: str = "a", priority: int = 1) -> Waiter:
            return Waiter(
                info=replace(info("p"), tenant=tenant, priority=priority),
                body={},
                request_id=f"{tenant}{deadline}",
                deadline=deadline,
                future=loop.create_future(),
            )

        q = WaitQueue(100, QueueOrder.EDF)
        urgent = [w(50, priority=0) for _ in range(3)]
        late = [w(d) for d in (1.0, 2.0, 3.0, 4.0)]
        other = w(1.0, tenant="b")
        for x in (*urgent, *late, other):
            q.push(x)
        # 2 grants a second from t=0: the urgent three are reached; of tenant a's, the one
        # due at 1.0 has 3 ahead (2 reachable), at 2.0 4 ahead (4: reached), at 3.0 5 (6),
        # at 4.0 6 (8); b's has the 3 urgent ahead only, with 2 reachable.
        assert set(map(id, q.beyond_reach(Pace(2.0).reach, 0.0))) == {id(late[0]), id(other)}
        q.remove(late[0])
        assert set(map(id, q.beyond_reach(Pace(2.0).reach, 0.0))) == {id(other)}
        # The decodes' bound counts their free slots on top: 1 a second beyond 1 free
        # reaches 2 by 1.0 (b's has 3 ahead), 3 by 2.0, 4 by 3.0 and 5 by 4.0 (a's: 3-5).
        assert set(map(id, q.beyond_reach(Pace(None, 1.0, 1).reach, 0.0))) == {id(other)}
    finally:
        loop.close()


async def test_in_a_fleet_what_no_share_of_its_pace_reaches_is_refused_at_once() -> None:
    """One gateway of two takes all the load (the other is quiet): the fleet's pace is this
    gateway's, and a request it cannot reach is refused on arrival, as when alone."""
    async with _paced_backlog(QueueOrder.FIFO, drain=True) as p:
        p.fwd._shared.fleet.gateways = 2  # as the sync says once another gateway shares it
        p.fwd.samples_in(["p 100 0.05"])  # the other gateway's sync: samples, no grants
        arrival = p.fwd.acquire(waiter(100, deadline_s=1.0))
        with pytest.raises(Overloaded, match="would not reach this request"):
            arrival.send(None)  # refused before its first await: on arrival, not queued


async def test_the_other_gateways_grants_count_toward_the_pace() -> None:
    """In a fleet the fleet's deadline order decides whose requests go: this gateway's own
    grants are only its share, so a request the fleet's pace would reach is queued (early
    drop and the deadline still bound it), not refused; a gateway that judged by its own
    grants would refuse ever more of its clients."""
    async with _paced_backlog(QueueOrder.FIFO, drain=True) as p:
        p.fwd._shared.fleet.gateways = 2
        p.fwd.samples_out()  # our own so far
        p.fwd.samples_in(["g 150", "g 100;p 100 0.05"])  # two syncs' worth, fresh
        assert _grants_in(p.fwd.samples_out()) < 5  # the others' are not sent back
        await _waits_out_its_deadline(p)


async def test_a_warm_starts_history_of_grants_is_not_the_pace() -> None:
    async with _paced_backlog(QueueOrder.FIFO, drain=True) as p:
        p.fwd._shared.fleet.gateways = 2
        p.fwd.samples_in(["g 250"], fresh=False)  # what the first sync read: history
        with pytest.raises(Overloaded, match="would not reach this request"):
            await p.fwd.acquire(waiter(100, deadline_s=1.0))


async def test_own_grants_go_out_with_the_next_sync_once() -> None:
    async with _paced_backlog(QueueOrder.FIFO, drain=True) as p:
        assert _grants_in(p.fwd.samples_out()) >= 10  # some 26 in 1.3 s at 20 a second
        assert _grants_in(p.fwd.samples_out()) < 5  # each grant is reported once


def _grants_in(packed: str) -> int:
    grants = [int(x[2:]) for x in packed.split(";") if x.startswith("g ")]
    assert len(grants) <= 1
    return sum(grants)


def _decode_fleet(*, hard: bool = True, decodes: tuple[int, ...] = (4, 4)) -> InstanceTracker:
    """One prefill of one slot and decodes of the given slots, which enforce them (429 when
    full) if `hard`, as pdgate's shims declare."""
    ext = (EXT_QUEUELESS,) if hard else ()
    recs = [InstanceRecord(id="p0", role=Role.PREFILL, url="http://p0", model="m")]
    recs += [
        InstanceRecord(
            id=f"d{i}", role=Role.DECODE, url=f"http://d{i}", model="m", capacity=c, extensions=ext
        )
        for i, c in enumerate(decodes)
    ]
    tracker = InstanceTracker(reject_hold_s=0.05)
    tracker.update_membership({r.id: r for r in recs})
    return tracker


def test_the_reach_is_the_lower_of_the_measured_pace_and_the_decodes_bound() -> None:
    assert Pace(10.0).reach(2.0) == 20.0
    assert Pace(None, 2.0, 3).reach(2.0) == 7.0  # 2 a second beyond 3 free slots
    assert Pace(10.0, 2.0, 3).reach(2.0) == 7.0  # a backlog's start: grants fill idle slots
    assert Pace(1.0, 2.0, 3).reach(2.0) == 2.0  # the prefills are the bottleneck
    assert Pace(None).reach(2.0) == math.inf


def test_decodes_take_at_most_their_slots_over_the_mean_time_one_is_held() -> None:
    tracker = _decode_fleet()
    capacity = DecodeCapacity(tracker, min_samples=4)
    assert capacity.bound("m", None) is None  # nothing measured yet
    for held in (1.0, 3.0, 1.0, 3.0):
        capacity.held("d0", held)
    capacity.held("p0", 100.0)  # a prefill's call holds no decode slot
    capacity.held("gone", 100.0)  # no longer registered
    bound = capacity.bound("m", None)
    assert bound is not None
    assert bound.cap == pytest.approx(8 / 2.0)  # both decodes of the group, 2 s a request
    assert bound.free == 8
    taken = tracker.begin("d1")
    bound = capacity.bound("m", None)
    assert bound is not None and bound.free == 7
    taken.release()
    assert capacity.bound("other", None) is None  # no decode of that model: no bound


def test_no_bound_where_a_decode_does_not_enforce_its_slots() -> None:
    """A stock server queues past its declared slots (a static decode's default is a
    guess): its slots bound nothing, so no pace is made of them."""
    capacity = DecodeCapacity(_decode_fleet(hard=False), min_samples=1)
    capacity.held("d0", 2.0)
    assert capacity.hold_s("m", "default") == 2.0
    assert capacity.bound("m", None) is None


def test_hold_times_go_to_the_fleet_once_and_bad_ones_are_skipped() -> None:
    ours = DecodeCapacity(_decode_fleet(), min_samples=2)
    theirs = DecodeCapacity(_decode_fleet(), min_samples=2)
    ours.held("d0", 1.0)
    ours.held("d1", 3.0)
    ours.held("p0", 9.0)  # not a decode
    packed = ours.samples_out()
    assert packed == ["h 1.0000 d0", "h 3.0000 d1"]
    assert ours.samples_out() == []  # each goes out once
    bad = ["h bogus d0", "h nan d0", "h -1 d0", "h inf d1", "h 5 unknown", "h 5 p0"]
    # The other samples of the entry are given back as they were.
    entry = ";".join(["p 100 0.05", *packed, *bad, "g 3"])
    assert theirs.samples_in(entry) == "p 100 0.05;g 3"
    assert theirs.hold_s("m", "default") == pytest.approx(2.0)
    assert theirs.hold_s("other", "default") is None  # another model's decodes
    assert theirs.samples_in("p 100 0.05") == "p 100 0.05"


async def _judged_at_a_backlogs_start(*, hard: bool) -> bool:
    """A burst at a backlog's start, before any pace is measured: 12 requests queued
    behind the one a prefill computes, and the decodes (2 of 2 slots, each held 4 s a
    request: 1 a second at most, 4 free now). Whether one more with 2 s left is refused on
    arrival, before its first await."""
    tracker = _decode_fleet(hard=hard, decodes=(2, 2))
    capacity = DecodeCapacity(tracker, min_samples=1)
    for _ in range(5):
        capacity.held("d0", 4.0)
    fwd, _, background = forwarder(
        MockUpstream(FakeCluster(prefill_delay_s=0.5)),
        tracker,
        ForwardingOptions(client_error=client_error, drain_sweep=False),
        order=QueueOrder.FIFO,
        decode_capacity=capacity,
    )
    tasks = [asyncio.create_task(_take(fwd, waiter(i, deadline_s=30))) for i in range(13)]
    try:
        await asyncio.sleep(0.05)
        assert len(fwd.queue) == 12
        assert fwd._drain.rate(time.monotonic()) is None
        arrival = fwd.acquire(waiter(100, deadline_s=2.0))
        try:
            arrival.send(None)
        except Overloaded:
            return True
        arrival.close()  # queued: it goes, as a client that left would
        return False
    finally:
        await _stop(fwd, background, tasks)


async def test_past_what_the_decodes_can_take_in_time_a_request_is_refused_at_once() -> None:
    """A backlog's first second gives no measured pace, and its grants fill idle slots
    anyway. The decodes bound what it can reach: 1 a second beyond 4 free slots is 6 in
    2 s, and 12 are ahead."""
    assert await _judged_at_a_backlogs_start(hard=True)


async def test_decodes_that_do_not_enforce_their_slots_bound_nothing() -> None:
    assert not await _judged_at_a_backlogs_start(hard=False)  # queued: no evidence either way


async def _burst(
    url: str, n: int, *, max_tokens: int, ttft_ms: int
) -> list[tuple[int, float, str]]:
    """`n` requests at once: each one's status, seconds to its answer's status line (to its
    whole answer for a 200) and Retry-After."""
    body = {"model": SIM_MODEL, "prompt": "burst", "max_tokens": max_tokens}
    headers = {TTFT_HEADER: str(ttft_ms)}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one() -> tuple[int, float, str]:
            began = time.monotonic()
            async with session.post(f"{url}/v1/completions", json=body, headers=headers) as r:
                await r.read()
                return r.status, time.monotonic() - began, r.headers.get("Retry-After", "")

        return await asyncio.gather(*(one() for _ in range(n)))


@pytest.mark.parametrize("case", ["bound", "drain_decode_bound=false", "new gateway in a fleet"])
def test_a_burst_past_what_the_decodes_take_is_refused_on_arrival(
    processes: Processes, case: str
) -> None:
    """As deployed: a burst of 60 requests with 2 s to their first token, on one decode of
    2 slots that serves some 5 a second. A second of backlog would pass before the queue's
    pace is measured, and its grants would fill the idle slots: the decodes' bound is what
    refuses the requests they cannot take in time at once, with Retry-After, while those it
    admits are served. Without it none is refused in the first second. A gateway that has
    relayed no stream yet is bounded by the hold times the fleet's other gateways saw."""
    bound = case != "drain_decode_bound=false"
    processes.shim("prefill", "--capacity", "4")
    processes.shim("decode", "--capacity", "2")
    url = processes.gateway(env={"PDGATE_GATEWAY_DRAIN_DECODE_BOUND": str(bound).lower()})
    wait_instances(url, 2)
    target = url
    if case == "new gateway in a fleet":
        target = processes.gateway()
        wait_instances(target, 2)
    # Some 0.35 s a stream: the gateway learns how long a request holds a decode slot.
    warm = asyncio.run(_burst(url, 2, max_tokens=50, ttft_ms=10_000))
    for _ in range(11):
        warm += asyncio.run(_burst(url, 2, max_tokens=50, ttft_ms=10_000))
    assert {status for status, _, _ in warm} == {200}, warm
    time.sleep(0.5)  # a few fleet syncs: the other gateway hears of those hold times

    answers = asyncio.run(_burst(target, 60, max_tokens=50, ttft_ms=2000))
    statuses = Counter(status for status, _, _ in answers)
    assert set(statuses) <= {200, 503}, statuses
    fast = [took for status, took, after in answers if status == 503 and after and took < 0.6]
    # About 2 s x 5 a second beyond 2 free slots are served; at least most of the rest
    # are told at once.
    assert 5 <= statuses[200] <= 30, statuses
    if bound:
        assert len(fast) >= 25, (statuses, sorted(took for _, took, _ in answers))
    else:
        assert not fast, sorted(fast)
    wait_for(lambda: counts_released(target), timeout=10, what="every count released")
    wait_for(lambda: counts_released(url), timeout=10, what="every count released")


async def test_the_last_request_to_stop_waiting_for_a_decode_wakes_the_forwarders() -> None:
    """While one waits the queue is held; the hold must end the moment the last one leaves,
    not a back-off later."""
    tracker = InstanceTracker(reject_hold_s=0.05)
    waits = DecodeWaits(tracker)
    waits.enter("m", None)
    waits.enter("m", None)
    waits.enter("m", "g")
    assert (waits.waiting("m", None), waits.waiting("m", "g"), waits.total()) == (2, 1, 3)
    sleeper = asyncio.ensure_future(tracker.wait_freed(10.0))
    await asyncio.sleep(0)
    waits.leave("m", None)
    await asyncio.sleep(0)
    assert not sleeper.done()  # one of the queue's requests still waits: still held
    waits.leave("m", None)
    await asyncio.wait_for(sleeper, 1.0)
    assert (waits.waiting("m", None), waits.total()) == (0, 1)
