"""Places kept for refused requests (gateway/placement/places.py): the same request sent
again takes its first try's place, once, within its time; places are bounded; as requests
ahead they count by the share that comes back. Through a queue's admission: a refused
request's Retry-After counts the places before it, and an early retry finds the same
requests ahead and is told the time left."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from pdgate.config import QueueOrder
from pdgate.gateway.errors import Overloaded
from pdgate.gateway.observe.metrics import GatewayMetrics
from pdgate.gateway.placement.admission import AdmissionOptions, QueueAdmission
from pdgate.gateway.placement.places import Places
from pdgate.gateway.placement.prefill_time import PrefillTimes
from pdgate.gateway.placement.queue import WaitQueue
from tests.gateway._fakes import info, tracker_for, waiter


def test_the_same_request_takes_its_place_once_within_its_time() -> None:
    places = Places(8)
    now = 100.0
    places.keep(info("a"), (5.0, 1), retry_after=2.0, now=now)
    assert places.take(info("b"), now + 1) is None  # another request
    other_tenant = replace(info("a"), tenant="t2")
    assert places.take(other_tenant, now + 1) is None
    assert places.take(info("a"), now + 2) == (5.0, 1)
    assert places.take(info("a"), now + 2) is None  # taken once
    # Kept for 1.5 times its Retry-After and a second: a retry far later has none.
    places.keep(info("a"), (5.0, 1), retry_after=2.0, now=now)
    assert places.take(info("a"), now + 4.1) is None
    assert not places


def test_places_are_bounded_and_count_by_the_share_that_comes_back() -> None:
    places = Places(4)
    for i in range(10):
        places.keep(info(f"p{i}"), (float(i), i), retry_after=60.0, now=0.0)
    assert len(places) == 4  # the oldest dropped
    assert places.take(info("p0"), 1.0) is None and places.take(info("p9"), 1.0) == (9.0, 9)
    # Six dropped unused and one taken back: fewer than half count as coming back.
    share = places.return_share
    assert 0.1 < share < 0.5
    # Three left (keys 6 to 8), all before key 100 of the same class and tenant, one before 7.
    assert places.ahead(1, "anonymous", (100.0, 0), 1.0) == pytest.approx(3 * share)
    assert places.ahead(1, "anonymous", (7.0, 0), 1.0) == pytest.approx(share)
    assert places.ahead(1, "other", (100.0, 0), 1.0) == 0  # another tenant: not counted
    assert places.ahead(2, "other", (0.0, 0), 1.0) == pytest.approx(3 * share)  # less urgent
    for i in range(100):  # a run of clients that come back for their places
        places.keep(info(f"q{i}"), (0.0, 0), retry_after=1.0, now=2.0)
        assert places.take(info(f"q{i}"), 2.5) is not None
    assert places.return_share > 0.8


def _admission(*, keep_places: bool = True) -> tuple[QueueAdmission, GatewayMetrics]:
    metrics = GatewayMetrics(tracker_for([1]).totals, lambda: 0)
    admission = QueueAdmission(
        WaitQueue(100, QueueOrder.FIFO),
        PrefillTimes(quantile=0.9),
        metrics,
        AdmissionOptions(drain_sweep=False, retry_keeps_place=keep_places),
        model="m",
        group=None,
    )
    now = time.monotonic()  # 20 grants a second over the last 2 s, the queue saturated
    admission.saturated(now - 2.0)
    for i in range(1, 41):
        admission.granted(now - 2.0 + i / 20)
    return admission, metrics


def _told_twice(*, keep_places: bool) -> tuple[float, float]:
    """40 queued at 20 a second; two requests due in half a second, both refused: what each
    is told."""
    admission, _ = _admission(keep_places=keep_places)
    for i in range(40):
        admission.admit(waiter(i, deadline_s=30))
    told = []
    for i in (100, 101):
        with pytest.raises(Overloaded) as refused:
            admission.admit(waiter(i, deadline_s=0.5))
        assert refused.value.retry_after is not None
        told.append(refused.value.retry_after)
    return told[0], told[1]


async def test_a_refusal_counts_the_places_kept_before_it() -> None:
    """The second refused request has the first one's place before it too, counted at the
    share of places that come back (a half, before any came back): 0.5 / 20 s more than
    without places (where it is told more only as the arrivals' rate raised the headroom)."""
    first, second = _told_twice(keep_places=True)
    plain_first, plain_second = _told_twice(keep_places=False)
    assert first == pytest.approx(plain_first, abs=0.002)
    assert (second - first) - (plain_second - plain_first) == pytest.approx(0.5 / 20, abs=0.002)


async def test_an_early_retry_is_refused_again_and_told_the_time_left() -> None:
    """Back at once, the same requests are ahead of it: refused, told about what it was told
    first, its place still kept; a request that came after it has that place before it."""
    admission, metrics = _admission()
    for i in range(40):
        admission.admit(waiter(i, deadline_s=30))
    with pytest.raises(Overloaded) as first:
        admission.admit(waiter(100, deadline_s=0.5))
    with pytest.raises(Overloaded) as again:
        admission.admit(waiter(100, deadline_s=0.5))
    assert first.value.retry_after is not None and again.value.retry_after is not None
    # The same 40 ahead of it (the headroom grew a little with the arrivals' rate).
    assert again.value.retry_after == pytest.approx(first.value.retry_after, abs=0.01)
    taken = metrics.registry.get_sample_value("pdgate_queue_places_total", {"outcome": "taken"})
    assert taken == 1  # taken by the early retry, and kept again when it was refused
    with pytest.raises(Overloaded) as later:
        admission.admit(waiter(101, deadline_s=0.5))
    assert later.value.retry_after is not None
    # Its place, taken back once of two, counts as two thirds of a request: 0.033 s.
    assert later.value.retry_after > again.value.retry_after + 0.02
