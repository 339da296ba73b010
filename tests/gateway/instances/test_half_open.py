"""Half-open ejection: after its cool-down an ejected instance takes exactly one request (the
probe) until that request's outcome; then it is trusted again (success), ejected for longer
(failure), or probed by the next request (no outcome: a 429, a cancel)."""

from __future__ import annotations

import asyncio

from pdgate.config import Role
from pdgate.gateway.instances.health import Ejection, Ejector
from pdgate.gateway.instances.tracker import InstanceTracker
from pdgate.gateway.observe.metrics import GatewayMetrics
from pdgate.gateway.upstream.mock import Call, MockUpstream, Reply
from tests.gateway._fakes import FakeCluster, forwarder, tracker_for, waiter

COOL_S = 0.05


def _p0(tracker: InstanceTracker) -> tuple[bool, int]:
    """p0 as the policies see it: (ejected, capacity)."""
    row = next(c for c in tracker.loads(Role.PREFILL, "m") if c.id == "p0")
    return row.ejected, row.capacity


_EJECTION = Ejection(consecutive=1, base_s=COOL_S, max_s=10 * COOL_S)


def _ejector(tracker: InstanceTracker) -> Ejector:
    metrics = GatewayMetrics(tracker.totals, lambda: 0)
    return Ejector(tracker, metrics, _EJECTION)


async def test_one_probe_after_the_cool_down_and_its_outcome_decides() -> None:
    tracker = tracker_for([4, 4])
    ejector = _ejector(tracker)
    ejector.failure("p0", "prefill")
    assert _p0(tracker)[0] is True
    await asyncio.sleep(COOL_S * 1.5)
    assert _p0(tracker) == (False, 1)  # half-open: room for one request only
    probe = tracker.begin("p0")
    assert _p0(tracker)[0] is True  # nobody else while the probe runs
    # A probe that ends without an outcome (a 429, a cancel) lets the next request probe.
    probe.release(slot_freed=False)
    assert _p0(tracker) == (False, 1)
    probe = tracker.begin("p0")
    assert _p0(tracker)[0] is True
    ejector.success("p0")
    probe.release()
    assert _p0(tracker) == (False, 4)  # trusted again, whole capacity
    tracker.begin("p0")
    assert _p0(tracker) == (False, 4)  # no probe any more: plain requests


async def test_a_failed_probe_ejects_again_for_longer() -> None:
    tracker = tracker_for([4, 4])
    ejector = _ejector(tracker)
    ejector.failure("p0", "prefill")
    await asyncio.sleep(COOL_S * 1.5)
    probe = tracker.begin("p0")
    probe.release(slot_freed=False)
    ejector.failure("p0", "prefill")
    assert _p0(tracker)[0] is True
    await asyncio.sleep(COOL_S * 1.5)
    assert _p0(tracker)[0] is True  # the second cool-down is twice as long
    await asyncio.sleep(COOL_S)
    assert _p0(tracker) == (False, 1)


async def test_a_late_success_from_before_the_ejection_does_not_end_it() -> None:
    tracker = tracker_for([4, 4])
    ejector = _ejector(tracker)
    ejector.failure("p0", "prefill")
    ejector.success("p0")  # a request sent before the ejection answers during the cool-down
    assert _p0(tracker)[0] is True
    await asyncio.sleep(COOL_S * 1.5)
    assert _p0(tracker) == (False, 1)  # still only a probe


async def test_late_failures_from_before_the_ejection_do_not_lengthen_it() -> None:
    """The requests in flight when an instance dies fail within a millisecond of each other:
    each doubled the cool-down (5 s to 300 s at once in a chaos run)."""
    tracker = tracker_for([4, 4])
    ejector = _ejector(tracker)
    ejector.failure("p0", "prefill")
    for _ in range(5):
        ejector.failure("p0", "prefill")  # sent before the ejection, failing during it
    await asyncio.sleep(COOL_S * 1.5)
    assert _p0(tracker) == (False, 1)  # the first cool-down, not 2**5 of it: a probe now


async def test_batch_forwarding_sends_a_half_open_prefill_one_request() -> None:
    """Through the forwarder: p0 (4 slots, ranked first) failed and was ejected. After the
    cool-down a burst of requests arrives while p0's probe hangs: p0 gets that one request
    only, the others go to p1. When the probe answers, p0 is trusted again."""
    gate = asyncio.Event()
    failing = True
    ok = FakeCluster()

    async def handler(call: Call) -> Reply:
        if call.url.endswith("p0"):
            if failing:
                return Reply(unreachable=True)
            await gate.wait()
        return await ok(call)

    upstream = MockUpstream(handler)
    tracker = tracker_for([4, 8], stock=True)
    fwd, _, _ = forwarder(upstream, tracker, ejection=_EJECTION)

    def at_p0() -> int:
        return sum(1 for c in upstream.calls if c.leg == "prefill" and c.url == "http://p0")

    (await fwd.acquire(waiter(0))).close()  # p0 fails once and is ejected; p1 serves it
    assert at_p0() == 1 and _p0(tracker)[0] is True
    failing = False
    await asyncio.sleep(COOL_S * 1.5)
    burst = [asyncio.create_task(fwd.acquire(waiter(i))) for i in range(1, 7)]
    done, _ = await asyncio.wait(burst, timeout=2)
    assert len(done) == 5  # all but the probe, which waits at p0
    assert at_p0() == 2  # the probe alone
    for task in done:
        task.result().close()
    gate.set()
    (probe,) = [t for t in burst if t not in done]
    (await asyncio.wait_for(probe, 2)).close()
    assert _p0(tracker) == (False, 4)
    await asyncio.sleep(0.02)  # the closed grants' releases run in the background
    (await fwd.acquire(waiter(10))).close()
    assert at_p0() == 3  # trusted again: it ranks first as before the failure
