"""The drain pace drain admission judges by (drain.py): the grants while saturated, the
arrivals, the decodes' bound, the requests surely ahead in the queue and the decode waits
that hold it. Drain admission's decisions themselves: test_admission.py."""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import replace

import pytest

from pdgate.config import QueueOrder
from pdgate.gateway.instances.tracker import InstanceTracker
from pdgate.gateway.placement.drain import (
    ArrivalRate,
    DecodeCapacity,
    DecodeWaits,
    Pace,
    QueueDrain,
)
from pdgate.gateway.placement.queue import Waiter, WaitQueue
from tests.gateway._fakes import decode_fleet, info


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


def test_the_reach_is_the_lower_of_the_measured_pace_and_the_decodes_bound() -> None:
    assert Pace(10.0).reach(2.0) == 20.0
    assert Pace(None, 2.0, 3).reach(2.0) == 7.0  # 2 a second beyond 3 free slots
    assert Pace(10.0, 2.0, 3).reach(2.0) == 7.0  # a backlog's start: grants fill idle slots
    assert Pace(1.0, 2.0, 3).reach(2.0) == 2.0  # the prefills are the bottleneck
    assert Pace(None).reach(2.0) == math.inf


def test_decodes_take_at_most_their_slots_over_the_mean_time_one_is_held() -> None:
    tracker = decode_fleet()
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
    capacity = DecodeCapacity(decode_fleet(hard=False), min_samples=1)
    capacity.held("d0", 2.0)
    assert capacity.hold_s("m", "default") == 2.0
    assert capacity.bound("m", None) is None


def test_hold_times_go_to_the_fleet_once_and_bad_ones_are_skipped() -> None:
    ours = DecodeCapacity(decode_fleet(), min_samples=2)
    theirs = DecodeCapacity(decode_fleet(), min_samples=2)
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


async def test_the_last_request_to_stop_waiting_for_a_decode_wakes_the_forwarders() -> None:
    """While one waits the queue is held; the hold must end the moment the last one leaves,
    not a back-off later."""
    tracker = InstanceTracker(reject_hold_s=0.05)
    waits = DecodeWaits(tracker)
    turns = [waits.join("m", group, 5.0, resumed=False) for group in (None, None, "g")]
    assert (waits.waiting("m", None), waits.waiting("m", "g"), waits.total()) == (2, 1, 3)
    sleeper = asyncio.ensure_future(tracker.wait_freed(10.0))
    await asyncio.sleep(0)
    waits.leave(turns[0], placed=True)
    await asyncio.sleep(0)
    assert not sleeper.done()  # one of the queue's requests still waits: still held
    waits.leave(turns[1], placed=False)
    await asyncio.wait_for(sleeper, 1.0)
    assert (waits.waiting("m", None), waits.total()) == (0, 1)
