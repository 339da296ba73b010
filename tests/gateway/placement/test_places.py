"""Places kept for refused requests (gateway/placement/places.py): the same request sent
again takes its first try's place, once, within its time, and places are bounded. Through a
queue's admission: a retry goes where its first try stood, ahead of the requests that came
since; one that comes early finds the same requests ahead and is told the time left; kept
places never turn away requests that are here. The refused requests told to come back
count ahead of the next one refused, as far as they come back when told."""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from dataclasses import replace

import pytest

from pdgate.config import QueueOrder
from pdgate.gateway.errors import Overloaded
from pdgate.gateway.observe.metrics import GatewayMetrics
from pdgate.gateway.placement.admission import AdmissionOptions, QueueAdmission
from pdgate.gateway.placement.drain import ArrivalRate
from pdgate.gateway.placement.places import AwaitedRetries, Places
from pdgate.gateway.placement.prefill_time import PrefillTimes
from pdgate.gateway.placement.queue import WaitQueue
from tests.gateway._fakes import info, tracker_for, waiter


def test_the_same_request_takes_its_place_once_within_its_time() -> None:
    places = Places(8)
    now = 100.0
    places.keep(info("a"), 5.0, retry_after=2.0, now=now)
    assert places.take(info("b"), now + 1) is None  # another request
    assert places.take(replace(info("a"), tenant="t2"), now + 1) is None
    assert places.take(replace(info("a"), max_tokens=5), now + 1) is None
    assert places.take(info("a"), now + 2) == 5.0
    assert places.take(info("a"), now + 2) is None  # taken once
    # Kept for 1.5 times its Retry-After and a second: a retry far later has none.
    places.keep(info("a"), 5.0, retry_after=2.0, now=now)
    assert places.take(info("a"), now + 4.1) is None
    assert not places


def test_places_are_bounded_oldest_and_lapsed_first() -> None:
    places = Places(4)
    for i in range(10):
        places.keep(info(f"p{i}"), float(i), retry_after=60.0, now=0.0)
    assert len(places) == 4  # the oldest dropped
    assert places.take(info("p5"), 1.0) is None and places.take(info("p9"), 1.0) == 9.0
    places.keep(info("late"), 10.0, retry_after=1.0, now=200.0)  # the others lapsed by now
    assert len(places) == 1


def _admission(*, keep_places: bool = True, size: int = 100) -> QueueAdmission:
    """A FIFO queue's admission at 20 grants a second over the last 2 s, saturated."""
    admission = QueueAdmission(
        WaitQueue(size, QueueOrder.FIFO),
        PrefillTimes(quantile=0.9),
        GatewayMetrics(tracker_for([1]).totals, lambda: 0),
        AdmissionOptions(drain_sweep=False, retry_keeps_place=keep_places),
        model="m",
        group=None,
    )
    now = time.monotonic()
    admission.saturated(now - 2.0)
    for i in range(1, 41):
        admission.granted(now - 2.0 + i / 20)
    return admission


@pytest.mark.parametrize("keep_places", [True, False])
async def test_a_retry_goes_where_its_first_try_stood(keep_places: bool) -> None:
    """40 queued at 20 a second: a request due in half a second is refused. 35 of the 40
    are served and 20 more arrive; sent again, it has the 5 left ahead of it, which the pace
    reaches in its time (7 to 10), not the 20 behind them too."""
    admission = _admission(keep_places=keep_places)
    queue = admission.queue
    for i in range(40):
        queue.push(waiter(i, deadline_s=30))  # queued before: not arrivals it judges now
    with pytest.raises(Overloaded):
        admission.admit(waiter(100, deadline_s=0.5))
    for _ in range(35):
        queue.pop()
    for i in range(20):
        queue.push(waiter(200 + i, deadline_s=30))
    retry = waiter(100, deadline_s=0.5)
    if not keep_places:
        with pytest.raises(Overloaded):  # a new arrival: behind all 25
            admission.admit(retry)
        return
    admission.admit(retry)
    order = [queue.pop() for _ in range(len(queue))]
    assert order.index(retry) == 5  # after the 5 that were ahead of it, before the 20
    taken = admission._metrics.registry.get_sample_value(
        "pdgate_queue_places_total", {"outcome": "taken"}
    )
    assert taken == 1


async def test_an_early_retry_is_refused_again_and_told_the_time_left() -> None:
    admission = _admission()
    for i in range(40):
        admission.queue.push(waiter(i, deadline_s=30))
    with pytest.raises(Overloaded) as first:
        admission.admit(waiter(100, deadline_s=0.5))
    for _ in range(10):
        admission.queue.pop()
    with pytest.raises(Overloaded) as again:  # back at once: 30 still ahead of its place
        admission.admit(waiter(100, deadline_s=0.5))
    assert first.value.retry_after is not None and again.value.retry_after is not None
    # Ten fewer ahead at 20 a second: half a second less.
    assert again.value.retry_after == pytest.approx(first.value.retry_after - 0.5, abs=0.05)
    # Still kept: once the rest have gone, it is admitted at its place.
    for _ in range(25):
        admission.queue.pop()
    admission.admit(waiter(100, deadline_s=0.5))


async def test_places_whose_requests_never_come_back_turn_nobody_away(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """200 refused requests, their places kept, never sent again: an arrival the queue
    reaches is admitted as it would be with no place kept. (The arrivals' rate is held low,
    as if they had come over a while: a burst keeps no place, below.)"""
    admission = _admission()
    monkeypatch.setattr(ArrivalRate, "per_s", lambda self, now: 1.0)
    for i in range(40):
        admission.queue.push(waiter(i, deadline_s=30))
    for i in range(200):
        with pytest.raises(Overloaded):
            admission.admit(waiter(1000 + i, deadline_s=0.5))
    assert admission._places is not None and len(admission._places) == 100  # the bound
    admission.admit(waiter(2000, deadline_s=10.0))  # 40 ahead, some 140 reached in 10 s
    assert len(admission.queue) == 41


async def test_no_place_is_kept_once_arrivals_outrun_twice_the_pace() -> None:
    """More refused than the pace serves: the retries holding places would alone outrun it.
    A burst of 100 arrivals at a pace of 20 a second keeps places only for the first."""
    admission = _admission()
    for i in range(40):
        admission.queue.push(waiter(i, deadline_s=30))
    for i in range(100):
        with pytest.raises(Overloaded):
            admission.admit(waiter(1000 + i, deadline_s=0.5))
    kept = admission._metrics.registry.get_sample_value(
        "pdgate_queue_places_total", {"outcome": "kept"}
    )
    assert kept is not None and 0 < kept < 60
    pace = admission.drain_view()[0]
    assert pace is not None and admission._arrivals.per_s(time.monotonic()) > 2 * pace


async def test_a_swept_request_retried_at_its_place_beside_its_dead_entry() -> None:
    """A queued request refused by the sweep leaves its entry in the queue's heaps until
    compacted; its retry, at the same place, must sort beside it (a key of its own)."""
    admission = _admission(size=1000)
    for i in range(60):
        admission.queue.push(waiter(i, deadline_s=30))
    doomed = waiter(100, deadline_s=1.0)
    admission.queue.push(doomed)
    for late in admission.queue.beyond_reach(lambda s: 20 * s, time.monotonic()):
        admission.queue.remove(late)
        admission._tell(late, 1.0)
    assert doomed.done
    for _ in range(58):
        admission.queue.pop()
    retry = waiter(100, deadline_s=1.0)
    admission.admit(retry)
    assert retry.key[0] == doomed.key[0] and retry.key != doomed.key
    assert [admission.queue.pop() for _ in range(3)][-1] is retry


# -- the retries awaited (AwaitedRetries) -----------------------------------------------


def test_awaited_retries_count_as_far_as_refused_requests_come_back_when_told() -> None:
    awaited = AwaitedRetries(100)
    for i in range(10):
        awaited.told(info(f"a{i}"), 2.0, now=0.0)
    assert awaited.expected(1.0) == 0  # nothing shown yet: counted as none
    for i in range(10):  # each back at its time
        awaited.back(info(f"a{i}"), now=2.0)
    assert awaited.honour == pytest.approx(1 - (31 / 32) ** 10)
    for i in range(10):
        awaited.told(info(f"b{i}"), 2.0, now=3.0)
    assert awaited.expected(4.0) == pytest.approx(10 * awaited.honour)
    assert awaited.expected(5.0) == 0  # their time came: their retries are in the queue
    shown = awaited.honour
    awaited.back(info("b0"), now=5.0)
    awaited.back(info("b0"), now=5.0)  # a second time is a new request: no outcome
    assert awaited.honour > shown
    shown = awaited.honour
    # Early (a client that resends at once) and never (one that gives up) both lower it.
    awaited.told(info("early"), 2.0, now=5.0)
    awaited.back(info("early"), now=5.5)
    assert awaited.honour < shown
    lowered = awaited.honour
    assert len(awaited) == 9  # b1..b9, awaited until 3 + 1.5 x 2 + 1 = 7
    assert awaited.expected(7.1) == 0
    assert len(awaited) == 0 and awaited.honour < lowered  # they never came back


def test_awaited_retries_are_bounded_and_match_a_plain_model() -> None:
    """Random refusals, retries (on time, early, late, never, twice) and queries against a
    model that keeps every request in a list: the same count waiting and the same share."""
    rng = random.Random(7)
    bound = 20
    awaited = AwaitedRetries(bound)
    model: OrderedDict[str, tuple[float, float, float]] = OrderedDict()  # (told, due, until)
    honour = 0.0
    now = 0.0

    def lapse() -> None:
        nonlocal honour
        for name, (_, _, until) in sorted(model.items(), key=lambda kv: kv[1][2]):
            if until < now:
                del model[name]
                honour += (0.0 - honour) / 32

    for _ in range(5000):
        now += rng.expovariate(20.0)
        name = f"r{rng.randrange(60)}"
        op = rng.random()
        if op < 0.5:
            retry_after = rng.choice([1.0, 1.0, 2.5, 4.0])
            awaited.told(info(name), retry_after, now)
            lapse()
            model.pop(name, None)
            model[name] = (retry_after, now + retry_after, now + 1.5 * retry_after + 1.0)
            while len(model) > bound:
                model.popitem(last=False)
        elif op < 0.9:
            awaited.back(info(name), now)
            lapse()
            if name in model:
                retry_after, due, _ = model.pop(name)
                as_told = due - now <= max(0.05, 0.05 * retry_after)
                honour += (float(as_told) - honour) / 32
        else:
            waiting = awaited.expected(now)
            lapse()
            assert waiting == pytest.approx(sum(d > now for _, d, _ in model.values()) * honour)
        assert len(awaited) == len(model) <= bound
        assert awaited.honour == pytest.approx(honour)
        assert len(awaited._ends) <= 4 * bound + 64 + 1
