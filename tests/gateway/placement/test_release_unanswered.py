"""`release_unanswered`: the one release of a prefill call that ended unanswered, which the
forwarder's calls and the direct dispatch share. A stock server's call has nothing to
release and is counted unknown at once; a pdgate prefill's is released by its id, counted
by what the prefill answered (tests/engine_shim/test_kv_admission.py, on real sockets),
and its leases go back once, whatever happens to the release, never as a freed slot."""

from __future__ import annotations

import asyncio
import contextlib

from pdgate.config.wire import kv_release_url
from pdgate.gateway.instances.tracker import InstanceTracker, Lease
from pdgate.gateway.observe.metrics import GatewayMetrics
from pdgate.gateway.placement.prefill_call import release_unanswered
from pdgate.gateway.upstream.mock import MockUpstream
from tests.gateway._fakes import FakeCluster, tracker_for


def _call_leases(tracker: InstanceTracker, freed: list[str]) -> tuple[Lease, Lease]:
    """A call's open stream and slot at p0; `freed` hears of every slot given back freed."""
    tracker.slot_freed = freed.append
    return tracker.open_stream("p0"), tracker.begin("p0")


def _outcomes(metrics: GatewayMetrics, result: str) -> dict[str, float]:
    sample = metrics.registry.get_sample_value
    name = "pdgate_prefill_abandoned_outcomes_total"
    outcomes = ("admitted", "rejected", "unseen", "unknown")
    values = {o: sample(name, {"result": result, "outcome": o}) for o in outcomes}
    return {o: v for o, v in values.items() if v}


def test_a_stock_call_is_counted_unknown_and_its_leases_go_back_at_once() -> None:
    upstream = MockUpstream(FakeCluster())
    tracker, freed = tracker_for([1]), []
    metrics = GatewayMetrics(tracker.totals, lambda: 0)
    leases = _call_leases(tracker, freed)
    pending = release_unanswered(
        upstream, metrics, "failed", leases, url="http://p0", kv_id=None, request_id="r0"
    )
    assert pending is None  # nothing left to run
    assert upstream.calls == []  # vLLM aborted it when the call closed: nothing to release
    assert _outcomes(metrics, "failed") == {"unknown": 1}
    assert tracker.totals() == (0, 0)
    assert freed == []


async def test_a_pdgate_call_is_released_by_its_id_then_counted_then_given_back() -> None:
    upstream = MockUpstream(FakeCluster(), admission="rejected")
    tracker, freed = tracker_for([1]), []
    metrics = GatewayMetrics(tracker.totals, lambda: 0)
    leases = _call_leases(tracker, freed)
    pending = release_unanswered(
        upstream, metrics, "deadline", leases, url="http://p0", kv_id="k" * 16, request_id="r1"
    )
    assert pending is not None
    assert tracker.totals() == (1, 1)  # held until the release has been answered
    await pending
    assert upstream.released() == [kv_release_url("http://p0", "k" * 16)]
    assert _outcomes(metrics, "deadline") == {"rejected": 1}
    assert tracker.totals() == (0, 0)
    assert freed == []  # the prefill drops an abandoned prompt only at its next step


async def test_a_release_cut_short_still_gives_the_leases_back_and_counts_nothing() -> None:
    """The release runs in the background or shielded; at the gateway's shutdown it is
    cancelled: the counts go back all the same, and nothing the prefill did not say is
    counted."""

    class Hanging(MockUpstream):
        async def release_kv_id(self, base_url: str, kv_id: str, *, request_id: str) -> str | None:
            await asyncio.Event().wait()
            return None

    tracker, freed = tracker_for([1]), []
    metrics = GatewayMetrics(tracker.totals, lambda: 0)
    leases = _call_leases(tracker, freed)
    pending = release_unanswered(
        Hanging(FakeCluster()),
        metrics,
        "abandoned",
        leases,
        url="http://p0",
        kv_id="k" * 16,
        request_id="r2",
    )
    assert pending is not None
    task = asyncio.create_task(pending)
    await asyncio.sleep(0.01)
    assert tracker.totals() == (1, 1)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert tracker.totals() == (0, 0)
    assert freed == []
    assert _outcomes(metrics, "abandoned") == {}
