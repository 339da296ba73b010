"""Admission and shedding of a queue (gateway/placement/admission.py): what it takes,
refuses and sheds, and the pace and headroom it judges by.

First the unit alone, on a queue and a made-up pace. Then through a forwarder of one prefill
(`MockUpstream`), where the pace is the forwarder's own grants: drain admission refuses on
arrival (503, Retry-After) a request the queue's recent pace cannot reach before its
deadline instead of letting it wait that deadline out, and queues one the pace can reach or
one that goes first; early drop answers a hopeless request without a prefill call. Last,
as deployed (real shims and gateways): a full queue, the decodes' bound, decode
back-pressure. The pace's own parts are tested in test_drain.py."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import aiohttp
import httpx
import pytest

from pdgate.config import QueueOrder
from pdgate.config.aio import Background
from pdgate.gateway.admission.retry_after import RetryAfter
from pdgate.gateway.api.completions import TTFT_HEADER
from pdgate.gateway.errors import DeadlineExceeded, Overloaded, OverShare, ShuttingDown
from pdgate.gateway.observe.metrics import GatewayMetrics
from pdgate.gateway.placement.admission import AdmissionOptions, QueueAdmission
from pdgate.gateway.placement.drain import ArrivalRate, DecodeCapacity, DecodeWaits
from pdgate.gateway.placement.forwarder import PrefillForwarder
from pdgate.gateway.placement.prefill_time import PrefillTimes
from pdgate.gateway.placement.queue import Waiter, WaitQueue
from pdgate.gateway.upstream.mock import MockUpstream
from tests._cluster import (
    SIM_MODEL,
    Processes,
    ThreadedCluster,
    counts_released,
    hold_prefill_slot,
    release_prefill_slot,
    wait_for,
    wait_instances,
)
from tests.gateway._fakes import (
    FakeCluster,
    decode_fleet,
    eventually,
    forwarder,
    info,
    tracker_for,
    waiter,
)
from tests.gateway.placement.test_forwarding import BODY, health, no_leaks, open_stream

# -- the unit alone ----------------------------------------------------------------------


def _unit(
    *, size: int = 100, decode_waits: DecodeWaits | None = None, **options: object
) -> tuple[QueueAdmission, WaitQueue, GatewayMetrics, PrefillTimes]:
    """A FIFO queue of `size` and its admission, with `options` (`AdmissionOptions`)."""
    queue = WaitQueue(size, QueueOrder.FIFO)
    times = PrefillTimes(quantile=0.9)
    metrics = GatewayMetrics(tracker_for([1]).totals, lambda: 0)
    admission = QueueAdmission(
        queue,
        times,
        metrics,
        AdmissionOptions(**options),  # type: ignore[arg-type]
        model="m",
        group=None,
        decode_waits=decode_waits,
    )
    return admission, queue, metrics, times


def _paced(admission: QueueAdmission, per_s: float, seconds: float) -> None:
    """`per_s` grants a second over the last `seconds`, the queue saturated all along."""
    now = time.monotonic()
    admission.saturated(now - seconds)
    for i in range(1, round(per_s * seconds) + 1):
        admission.granted(now - seconds + i / per_s)


def _tenant(i: int, tenant: str, deadline_s: float = 30.0) -> Waiter:
    w = waiter(i, deadline_s=deadline_s)
    w.info = replace(w.info, tenant=tenant)
    return w


def _sheds(metrics: GatewayMetrics, reason: str) -> float | None:
    return metrics.registry.get_sample_value("pdgate_queue_sheds_total", {"reason": reason})


async def test_the_unit_refuses_on_arrival_what_the_pace_cannot_reach_in_time() -> None:
    admission, queue, metrics, _ = _unit(drain_sweep=False)
    assert admission.drain_view()[0] is None  # no pace yet: nothing is judged
    for i in range(40):
        admission.admit(waiter(i, deadline_s=30))
    _paced(admission, 20.0, 2.0)  # 20 grants a second
    assert admission.drain_view()[0] == pytest.approx(20.0, rel=0.01)
    late = waiter(100, deadline_s=0.5)  # 40 ahead, some 10 reached in half a second
    with pytest.raises(Overloaded, match="would not reach this request") as refused:
        admission.admit(late)
    # Retry-After: until the pace has served all but what it reaches in the request's time
    # (less the headroom it keeps, up to 0.3 of it): the 40 ahead less 7 to 10, at 20 a
    # second.
    assert (40 - 10) / 20 - 0.01 <= refused.value.retry_after <= (40 - 7) / 20 + 0.01
    assert late not in queue.waiters() and _sheds(metrics, "drain") == 1
    admission.admit(waiter(101, deadline_s=20.0))  # reached in some 2 s
    assert len(queue) == 41
    again = waiter(102, deadline_s=1.0)
    again.admitted = True  # a failover: judged once already
    admission.admit(again)
    assert len(queue) == 42 and _sheds(metrics, "drain") == 1


async def test_the_units_sweep_refuses_queued_requests_out_of_reach_but_not_readmitted_ones() -> (
    None
):
    admission, queue, metrics, _ = _unit()
    for i in range(40):
        queue.push(waiter(i, deadline_s=30))
    doomed, kept = waiter(100, deadline_s=1.0), waiter(101, deadline_s=1.0)
    kept.admitted = True
    queue.push(doomed)  # queued before any pace was known
    queue.push(kept)
    _paced(admission, 20.0, 2.0)
    admission.admit(waiter(102, deadline_s=20.0))  # its arrival sweeps the queue
    with pytest.raises(Overloaded, match="would not reach this request") as refused:
        doomed.future.result()
    # Its retry queues behind the 41 left, at 20 a second (it has no TTFT budget of its own).
    assert refused.value.retry_after == pytest.approx(41 / 20, abs=0.01)
    assert doomed not in queue.waiters() and kept in queue.waiters()
    assert not kept.future.done() and _sheds(metrics, "drain") == 1


async def test_the_unit_drops_a_hopeless_request_at_the_head_unless_told_not_to() -> None:
    for early_drop in (True, False):
        admission, queue, metrics, times = _unit(early_drop=early_drop)
        for _ in range(32):  # recent history: 100 characters took 2 s
            times.record(100, 2.0)
        hopeless, fine = waiter(0, deadline_s=1.0), waiter(1, deadline_s=5.0)
        hopeless.info = fine.info = info("x" * 100)
        admission.admit(hopeless)
        admission.admit(fine)
        assert admission.hopeless(hopeless) is early_drop
        assert not admission.hopeless(fine)
        drops = metrics.registry.get_sample_value("pdgate_early_drops_total")
        if early_drop:
            with pytest.raises(DeadlineExceeded, match="cannot be prefilled") as dropped:
                hopeless.future.result()
            assert queue.waiters() == [fine] and drops == 1
            assert dropped.value.retry_after == 1  # no pace measured: the floor
        else:
            assert not hopeless.future.done() and len(queue) == 2 and drops == 0


async def test_the_unit_holds_the_queue_while_a_prefilled_request_waits_for_a_decode() -> None:
    waits = DecodeWaits(tracker_for([1], [1]))
    admission, _, _, _ = _unit(decode_waits=waits)
    held_off, _, _, _ = _unit(decode_waits=waits, decode_backpressure=False)
    aggregated, _, _, _ = _unit()  # an aggregated queue: no decode holds it
    assert not admission.decodes_full()
    turn = waits.join("m", None, 5.0, resumed=False)
    assert admission.decodes_full()
    assert not held_off.decodes_full() and not aggregated.decodes_full()
    waits.join("m", "other", 5.0, resumed=False)
    waits.leave(turn, placed=True)
    assert not admission.decodes_full()  # another group's wait holds another queue


async def test_the_unit_answers_a_full_queue_503_and_a_tenant_over_its_share_429() -> None:
    admission, queue, metrics, _ = _unit(size=2, retry_after=RetryAfter(floor_s=3))
    first, newest = _tenant(0, "a"), _tenant(1, "a")
    admission.admit(first)
    admission.admit(newest)
    with pytest.raises(Overloaded, match="is full") as full:
        admission.admit(_tenant(2, "a"))
    assert full.value.status == 503 and full.value.retry_after == 3  # no pace yet: the floor
    assert _sheds(metrics, "full") == 1
    # Tenant b, under its share, takes the place of a's newest, which is told 429.
    light = _tenant(3, "b")
    admission.admit(light)
    assert {id(w) for w in queue.waiters()} == {id(first), id(light)}
    with pytest.raises(OverShare) as displaced:
        newest.future.result()
    assert displaced.value.status == 429 and displaced.value.retry_after == 3
    with pytest.raises(OverShare, match="holds its share"):
        admission.admit(_tenant(4, "a"))
    assert _sheds(metrics, "over_share") == 1


async def test_the_unit_expires_and_sheds_with_the_right_answers() -> None:
    admission, _, _, _ = _unit(retry_after=RetryAfter(floor_s=2))
    expiring = waiter(0)
    admission.expire(expiring)
    with pytest.raises(DeadlineExceeded, match="before its TTFT deadline") as expired:
        expiring.future.result()
    assert expired.value.retry_after == 2
    queued = [waiter(i) for i in (1, 2)]
    for w in queued:
        admission.admit(w)
    stopping = ShuttingDown("the gateway is stopping")
    assert admission.shedding is None
    admission.shed(stopping)
    assert admission.shedding is stopping
    for w in queued:
        assert w.future.exception() is stopping
    with pytest.raises(ShuttingDown):
        admission.admit(waiter(3))


async def test_the_units_own_grants_go_to_the_fleet_once_and_reports_do_not() -> None:
    admission, _, _, _ = _unit()
    now = time.monotonic()
    admission.saturated(now)
    for _ in range(3):
        admission.granted(now)
    admission.reported(now, 50)  # another gateway's: they count toward the pace only
    assert admission.take_grants() == 3
    assert admission.take_grants() == 0


# -- through a forwarder -----------------------------------------------------------------


@dataclass
class _Paced:
    fwd: PrefillForwarder
    upstream: MockUpstream
    metrics: GatewayMetrics

    @property
    def admission(self) -> QueueAdmission:
        return self.fwd.admission


@contextlib.asynccontextmanager
async def _paced_backlog(
    order: QueueOrder, *, drain: bool, keep_places: bool = False
) -> AsyncIterator[_Paced]:
    """One prefill of one slot, 0.05 s a prompt (about 20 grants a second), and 80 requests
    due in 30 s queued for over a second, so the pace is known; no sweep unless a test
    turns it on; all of it cancelled and closed on exit."""
    upstream = MockUpstream(FakeCluster(prefill_delay_s=0.05))
    fwd, metrics, background = forwarder(
        upstream,
        tracker_for([1]),
        admission=AdmissionOptions(
            drain_admission=drain, drain_sweep=False, retry_keeps_place=keep_places
        ),
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


@pytest.mark.parametrize("keep_places", [True, False])
async def test_a_refused_request_retried_when_told_is_served_where_it_stood(
    keep_places: bool,
) -> None:
    """The same request sent again after its Retry-After goes where its first try stood,
    before the requests that came meanwhile, and is served; were its retry a new arrival,
    those would be ahead of it and it would be refused again."""
    async with _paced_backlog(QueueOrder.FIFO, drain=True, keep_places=keep_places) as p:
        with pytest.raises(Overloaded, match="would not reach this request") as refused:
            await p.fwd.acquire(waiter(100, deadline_s=1.0))
        told = refused.value.retry_after
        assert told is not None and told > 0.5  # some 50 queued, 20 served a second
        later = [
            asyncio.create_task(_take(p.fwd, waiter(200 + i, deadline_s=30))) for i in range(15)
        ]
        try:
            await asyncio.sleep(told + 0.3)
            retry = p.fwd.acquire(waiter(100, deadline_s=1.0))  # the same request again
            if not keep_places:
                with pytest.raises(Overloaded, match="would not reach this request"):
                    await retry
                return
            (await retry).close()  # granted before its deadline
            assert not any(t.done() for t in later)  # all 15 still behind it
            taken = p.metrics.registry.get_sample_value(
                "pdgate_queue_places_total", {"outcome": "taken"}
            )
            assert taken == 1
        finally:
            for t in later:
                t.cancel()
            await asyncio.gather(*later, return_exceptions=True)


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
        admission=AdmissionOptions(drain_sweep=False),
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
        assert p.admission._options.drain_headroom == 0.3  # the default

        def at_the_edge(i: int) -> Waiter:
            pace = p.admission._pace(time.monotonic())
            assert pace is not None and pace.rate
            return waiter(i, deadline_s=1.25 * len(p.fwd.queue) / pace.rate)

        queued = asyncio.create_task(p.fwd.acquire(at_the_edge(100)))
        await asyncio.sleep(0.01)
        assert not queued.done()
        queued.cancel()
        await asyncio.gather(queued, return_exceptions=True)
        assert p.admission.drain_view()[2] == 0.0  # the headroom in force, as /metrics shows it
        for i in range(80):  # a burst: 80 arrivals where the queue drains 20 a second
            with pytest.raises(Overloaded):
                await p.fwd.acquire(waiter(200 + i, deadline_s=0.2))
        pace, arrivals, headroom = p.admission.drain_view()
        assert pace is not None and arrivals > 5 * pace and headroom == 0.3
        with pytest.raises(Overloaded, match="would not reach this request"):
            await p.fwd.acquire(at_the_edge(101))
        # Without the setting, the same arrival is queued however many are refused.
        p.admission._options = replace(p.admission._options, drain_headroom=0.0)
        queued = asyncio.create_task(p.fwd.acquire(at_the_edge(102)))
        await asyncio.sleep(0.01)
        assert not queued.done()
        queued.cancel()
        await asyncio.gather(queued, return_exceptions=True)


async def test_requests_queued_before_the_pace_was_known_are_refused_once_it_is() -> None:
    """A request queued when nothing could be judged (here: drain admission off as it came)
    that the pace shows out of reach is told 503 at the next arrival's sweep, not at its
    deadline."""
    async with _paced_backlog(QueueOrder.FIFO, drain=False) as p:
        doomed = asyncio.create_task(_take(p.fwd, waiter(100, deadline_s=1.5)))
        await asyncio.sleep(0.01)
        assert not doomed.done()  # queued behind some forty requests, 20 served a second
        p.admission._options = replace(p.admission._options, drain_admission=True)
        first = asyncio.create_task(_take(p.fwd, waiter(99, deadline_s=20.0)))
        await asyncio.sleep(0.01)
        assert not doomed.done()  # no sweep unless asked for
        p.admission._options = replace(p.admission._options, drain_sweep=True)
        reached = asyncio.create_task(_take(p.fwd, waiter(101, deadline_s=20.0)))
        # Refused by the sweep (a deadline's would be DeadlineExceeded).
        with pytest.raises(Overloaded, match="would not reach this request"):
            await doomed
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
        pace = p.admission._pace(time.monotonic())
        assert pace is not None and pace.rate
        kept = asyncio.create_task(
            _take(p.fwd, waiter(100, deadline_s=len(p.fwd.queue) / (1.15 * pace.rate)))
        )
        await asyncio.sleep(0.01)
        assert not kept.done()  # queued: nothing judged it on arrival
        p.admission._options = replace(p.admission._options, drain_admission=True)
        for i in range(80):  # a burst, refused on arrival: arrivals at five times the pace
            with pytest.raises(Overloaded):
                await p.fwd.acquire(waiter(200 + i, deadline_s=0.2))
        assert p.admission.drain_view()[2] == 0.3
        p.admission._options = replace(p.admission._options, drain_sweep=True)
        with pytest.raises(Overloaded):
            await p.fwd.acquire(waiter(300, deadline_s=0.2))  # its arrival sweeps the queue
        await asyncio.sleep(0.01)
        assert not kept.done()
        # The same sweep without headroom refuses it.
        p.admission._options = replace(p.admission._options, drain_headroom=0.0)
        p.admission._next_sweep = 0.0
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
        p.admission._next_sweep = 0.0
        with pytest.raises(Overloaded, match="would not reach this request"):
            await p.fwd.acquire(waiter(101, deadline_s=1.5))  # an arrival: refused, sweeps
        await asyncio.sleep(0.01)
        assert not kept.done()
        with pytest.raises(DeadlineExceeded):
            await kept
        sheds = p.metrics.registry.get_sample_value("pdgate_queue_sheds_total", {"reason": "drain"})
        assert sheds == 1  # the arrival only


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


async def _judged_at_a_backlogs_start(*, hard: bool) -> bool:
    """A burst at a backlog's start, before any pace is measured: 12 requests queued
    behind the one a prefill computes, and the decodes (2 of 2 slots, each held 4 s a
    request: 1 a second at most, 4 free now). Whether one more with 2 s left is refused on
    arrival, before its first await."""
    tracker = decode_fleet(hard=hard, decodes=(2, 2))
    capacity = DecodeCapacity(tracker, min_samples=1)
    for _ in range(5):
        capacity.held("d0", 4.0)
    fwd, _, background = forwarder(
        MockUpstream(FakeCluster(prefill_delay_s=0.5)),
        tracker,
        admission=AdmissionOptions(drain_sweep=False),
        order=QueueOrder.FIFO,
        decode_capacity=capacity,
    )
    tasks = [asyncio.create_task(_take(fwd, waiter(i, deadline_s=30))) for i in range(13)]
    try:
        await asyncio.sleep(0.05)
        assert len(fwd.queue) == 12
        assert fwd.admission._drain.rate(time.monotonic()) is None
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


async def _burst(url: str, n: int, *, max_tokens: int, ttft_ms: int) -> list[tuple[int, str, str]]:
    """`n` requests at once: each one's status, Retry-After and error message ("" for a
    200)."""
    body = {"model": SIM_MODEL, "prompt": "burst", "max_tokens": max_tokens}
    headers = {TTFT_HEADER: str(ttft_ms)}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one() -> tuple[int, str, str]:
            async with session.post(f"{url}/v1/completions", json=body, headers=headers) as r:
                answer = await r.json()
                message = "" if r.status == 200 else answer["error"]["message"]
                return r.status, r.headers.get("Retry-After", ""), message

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
    # Told at once, on arrival (the burst's only arrivals, so the only judgement), that the
    # queue would not reach them; the others are served or wait out their deadline.
    refused = [
        message
        for status, after, message in answers
        if status == 503 and after and "would not reach this request" in message
    ]
    # About 2 s x 5 a second beyond 2 free slots are served; at least most of the rest
    # are told at once.
    assert 5 <= statuses[200] <= 30, statuses
    if bound:
        assert len(refused) >= 25, (statuses, Counter(message for _, _, message in answers))
    else:
        assert not refused, Counter(message for _, _, message in answers)
    wait_for(lambda: counts_released(target), timeout=10, what="every count released")
    wait_for(lambda: counts_released(url), timeout=10, what="every count released")


def short_waiter(chars: int, deadline_s: float) -> object:
    w = waiter(0, deadline_s=deadline_s)
    w.info = info("x" * chars)
    return w


async def test_hopeless_request_is_dropped_without_a_prefill_call() -> None:
    upstream = MockUpstream(FakeCluster(prefill_delay_s=0.05))
    fwd, metrics, background = forwarder(
        upstream, tracker_for([1]), admission=AdmissionOptions(early_drop=True)
    )
    for _ in range(32):  # recent history: 100 chars took 2 s
        fwd.prefill_times.record(100, 2.0)
    # Dropped at once: not the expiry's "no prefill instance accepted the request".
    with pytest.raises(DeadlineExceeded, match="cannot be prefilled"):
        await fwd.acquire(short_waiter(100, 1.0))  # type: ignore[arg-type]
    assert upstream.calls == []
    assert fwd.queue.peek() is None and fwd.waiting == 0
    assert metrics.registry.get_sample_value("pdgate_early_drops_total") == 1
    # A request with time enough is sent as usual (and its call time recorded).
    grant = await fwd.acquire(short_waiter(100, 5.0))  # type: ignore[arg-type]
    grant.close()
    assert len(upstream.calls) == 1 and len(fwd.prefill_times) == 33
    await fwd.close()
    await background.aclose()


async def test_without_early_drop_the_same_request_is_sent_and_expires() -> None:
    upstream = MockUpstream(FakeCluster(prefill_delay_s=0.5))
    fwd, metrics, background = forwarder(
        upstream, tracker_for([1]), admission=AdmissionOptions(early_drop=False)
    )
    for _ in range(32):
        fwd.prefill_times.record(100, 0.2)
    with pytest.raises(DeadlineExceeded, match="before its TTFT deadline"):
        await fwd.acquire(short_waiter(100, 0.1))  # type: ignore[arg-type]
    # Sent once; a prefill that answers after the deadline may already have had its KV
    # released (the leg nobody will pull), depending on when the answer came.
    legs = [c.leg for c in upstream.calls]
    assert legs in (["prefill"], ["prefill", "release"]), legs
    assert metrics.registry.get_sample_value("pdgate_early_drops_total") == 0
    await fwd.close()
    await background.aclose()


# -- as deployed ---------------------------------------------------------------------------


def test_full_queue_answers_503_at_once() -> None:
    shim = {"capacity": 1, "kv_hold_timeout_s": 30}
    with ThreadedCluster(prefills=1, decodes=1, shim=shim, gateway={"queue_size": 2}) as c:
        assert c.info is not None
        held = hold_prefill_slot(c.info.prefill_urls[0])
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            waiting = [
                pool.submit(httpx.post, c.url + "/v1/completions", json=BODY, timeout=30)
                for _ in range(2)
            ]
            c.wait_for(lambda: health(c)["queued"] == 2)
            resp = httpx.post(c.url + "/v1/completions", json=BODY, timeout=30)
            # Refused by the full queue (not at a deadline), the two ahead still waiting.
            assert resp.status_code == 503
            error = resp.json()["error"]
            assert error["code"] == "gateway_overloaded"
            assert error["message"] == "the gateway's queue for this model and group is full"
            assert "retry-after" in resp.headers
            assert health(c)["queued"] == 2
            release_prefill_slot(held)
            assert [f.result().status_code for f in waiting] == [200, 200]
        c.wait_for(lambda: no_leaks(c))


def _decode_backpressure(enabled: bool) -> tuple[int, int]:
    """(prefilled requests waiting for a decode, requests queued) with the one decode full
    and three requests sent one after the other."""
    shim = {"capacity": 2, "kv_hold_timeout_s": 30}
    gateway = {"decode_backpressure": enabled}
    with ThreadedCluster(prefills=2, decodes=1, shim=shim, gateway=gateway) as c:
        streams = [open_stream(c.url, f"long {i}") for i in range(2)]  # the decode's slots
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            first = pool.submit(httpx.post, c.url + "/v1/completions", json=BODY, timeout=30)
            c.wait_for(lambda: health(c)["decode_waiting"] == 1)
            rest = [
                pool.submit(httpx.post, c.url + "/v1/completions", json=BODY, timeout=30)
                for _ in range(2)
            ]
            # Four prefill slots are free: only a hold keeps the two in the queue.
            c.wait_for(lambda: health(c)["queued"] + health(c)["decode_waiting"] == 3)
            time.sleep(0.3)  # time enough for a forwarder that does not hold to send them
            seen = health(c)
            for s in streams:
                s.close()
            assert [f.result().status_code for f in [first, *rest]] == [200, 200, 200]
        c.wait_for(lambda: no_leaks(c) and health(c)["decode_waiting"] == 0)
        return seen["decode_waiting"], seen["queued"]


def test_a_request_waiting_for_a_decode_holds_its_queue_s_prefills() -> None:
    """The decodes full, a prefilled request waits for one: the requests behind it stay in
    the gateway's queue (deadline order, drain admission) instead of being prefilled only to
    wait for a decode out of the queue's sight."""
    assert _decode_backpressure(enabled=True) == (1, 2)


def test_without_decode_backpressure_the_prefills_run_ahead_of_the_decodes() -> None:
    assert _decode_backpressure(enabled=False) == (3, 0)


# -- what a refused request is told to wait (gateway/admission/retry_after.py) -------------


def _with_budget(w: Waiter, tenant: str = "anonymous", ttft_s: float | None = None) -> Waiter:
    w.info = replace(w.info, tenant=tenant, ttft_s=ttft_s)
    return w


async def test_a_full_queue_tells_how_long_until_the_pace_brings_a_retry_within_reach() -> None:
    """40 queued at 20 grants a second, the next due in half a second: the pace reaches 10 of
    them in its time, so 30 must go first, 1.5 s; a fixed second would bring it back to the
    same full queue."""
    admission, _, _, _ = _unit(size=40, drain_admission=False)
    for i in range(40):
        admission.admit(waiter(i, deadline_s=30))
    _paced(admission, 20.0, 2.0)
    with pytest.raises(Overloaded, match="is full") as full:
        admission.admit(waiter(100, deadline_s=0.5))
    assert full.value.retry_after == pytest.approx(1.5, abs=0.01)
    # Past the ceiling, the ceiling: the OpenAI clients give up on longer waits.
    capped, _, _, _ = _unit(size=40, drain_admission=False, retry_after=RetryAfter(ceiling_s=1.2))
    for i in range(40):
        capped.admit(waiter(i, deadline_s=30))
    _paced(capped, 20.0, 2.0)
    with pytest.raises(Overloaded, match="is full") as full:
        capped.admit(waiter(100, deadline_s=0.5))
    assert full.value.retry_after == 1.2


async def test_a_tenant_over_its_share_waits_for_its_own_requests_at_its_share_of_the_pace() -> (
    None
):
    """Tenant a holds 30 of a queue of 40 beside b's one: its share is half the turns, 10
    grants a second of the 20. Its new request has its 30 ahead, the half second it may wait
    reaches 5 of them: 25 at 10 a second, 2.5 s."""
    admission, _, _, _ = _unit(size=40, drain_admission=False)
    for i in range(30):
        admission.admit(_tenant(i, "a"))
    admission.admit(_tenant(30, "b"))
    _paced(admission, 20.0, 2.0)
    with pytest.raises(OverShare) as over:
        admission.admit(_tenant(100, "a", deadline_s=0.5))
    assert over.value.status == 429
    assert over.value.retry_after == pytest.approx(2.5, abs=0.01)


@pytest.mark.parametrize("clients_come_back", [True, False])
async def test_refused_requests_due_back_count_ahead_of_the_next_one_refused(
    monkeypatch: pytest.MonkeyPatch, clients_come_back: bool
) -> None:
    """40 queued at 20 grants a second: a request due in half a second is told 1.5 s (30
    past the pace's reach). Where the queue's refused requests have been coming back when
    told, the ten refused after it will be back in the queue before the eleventh: it is
    told half a second more, for them. Where they have not (clients that send a new
    request at once, or give up), nothing is added: a fixed queue, a fixed figure."""
    admission, _, _, _ = _unit(drain_sweep=False)
    monkeypatch.setattr(ArrivalRate, "per_s", lambda self, now: 1.0)  # no headroom
    for i in range(40):
        admission.admit(waiter(i, deadline_s=30))
    _paced(admission, 20.0, 2.0)
    past = time.monotonic() - 100.0
    for i in range(200):  # earlier refusals: each back at its time, or never
        admission._awaited.told(info(f"before{i}"), 1.0, past)
        if clients_come_back:
            admission._awaited.back(info(f"before{i}"), past + 1.0)
    figures = []
    for i in range(11):
        with pytest.raises(Overloaded, match="would not reach") as refused:
            admission.admit(waiter(100 + i, deadline_s=0.5))
        figures.append(refused.value.retry_after)
    assert figures[0] == pytest.approx(1.5, abs=0.01)
    came_back = admission._awaited.honour
    assert came_back == (pytest.approx(1.0, abs=0.01) if clients_come_back else 0.0)
    assert figures[-1] == pytest.approx(1.5 + 10 * came_back / 20, abs=0.01)
    assert admission.retries_view() == (11, came_back)  # /admin/queues and /metrics


async def test_a_request_shed_after_waiting_is_told_when_a_retry_would_be_reached() -> None:
    """Early drop and expiry: the retry queues behind the 60 requests queued now, with its
    whole TTFT budget (a quarter second: some 5 of them reached, less the headroom a burst of
    arrivals calls for), 55 to 57 at 20 a second (the pace as measured, 19 to 20 a second by
    the time each is shed)."""
    admission, queue, _, times = _unit()
    for i in range(60):
        admission.admit(waiter(i, deadline_s=30))
    _paced(admission, 20.0, 2.0)
    for _ in range(32):  # 100 characters take 2 s
        times.record(100, 2.0)
    lowest, highest = (60 - 20 / 4) / 20 - 0.01, (60 - 0.7 * 19 / 4) / 19 + 0.01
    hopeless = _with_budget(waiter(100, deadline_s=0.25, prompt="x" * 100), ttft_s=0.25)
    queue.push(hopeless)
    assert admission.hopeless(hopeless)
    with pytest.raises(DeadlineExceeded, match="cannot be prefilled") as dropped:
        hopeless.future.result()
    assert dropped.value.retry_after is not None
    assert lowest <= dropped.value.retry_after <= highest
    expiring = _with_budget(waiter(101, deadline_s=0.25), ttft_s=0.25)
    queue.push(expiring)
    admission.expire(expiring)  # its deadline passed, still queued
    with pytest.raises(DeadlineExceeded, match="before its TTFT deadline") as expired:
        expiring.future.result()
    assert expired.value.retry_after is not None
    assert lowest <= expired.value.retry_after <= highest
