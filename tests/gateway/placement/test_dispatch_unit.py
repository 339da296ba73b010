"""The dispatcher and the relay against `MockUpstream`: who holds which count when."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import orjson
import pytest

from pdgate.config import DispatchMode, Role
from pdgate.config.wire import EXT_QUEUELESS, KvConnector
from pdgate.gateway.errors import BadGateway, DeadlineExceeded
from pdgate.gateway.instances.tracker import InstanceTracker
from pdgate.gateway.placement.placed import Placement
from pdgate.gateway.upstream.mock import MockUpstream, Reply
from pdgate.registry import InstanceRecord
from tests.gateway._fakes import (
    FakeCluster,
    Sink,
    completion_chunks,
    dispatcher,
    eventually,
    info,
    records,
    relay,
    tracker_for,
)
from tests.gateway._fakes import (
    place as both_legs,
)


def counts(tracker: Any, instance_id: str) -> tuple[int, int]:
    row = next(r for r in tracker.describe() if r["id"] == instance_id)
    return row["open_streams"], row["inflight"]


async def place(d: Any, *, stream: bool = True, deadline_s: float = 2.0) -> Placement:
    forward = {"model": "m", "prompt": "p", "max_tokens": 4, "stream": stream}
    placement: Placement = await both_legs(
        d, info(), forward, request_id="req-1", deadline=time.monotonic() + deadline_s
    )
    return placement


async def test_the_prefill_slot_is_held_until_the_decode_sends_its_first_event() -> None:
    """Issue 9: the prefill's count was given back when the decode accepted, ~1 ms before the
    prefill really freed the slot (when the decode had pulled the KV): the next request got a
    429 and the prefill then sat idle for the whole busy hold."""
    upstream = MockUpstream(FakeCluster(text="abc", decode_chunk_delay_s=0.3))
    tracker = tracker_for([1], [4])
    d, metrics = dispatcher(upstream, tracker)
    sink = Sink()
    task = asyncio.ensure_future(relay(d, metrics, sink=sink))
    await eventually(lambda: any(c.leg == "decode" for c in upstream.calls))
    assert counts(tracker, "p0") == (1, 1)  # the decode may not have pulled the KV yet
    await eventually(lambda: b"data:" in sink.body)
    assert counts(tracker, "p0") == (1, 0)  # KV gone from the prefill: slot free
    outcome, _, _ = await task
    assert outcome == "ok"
    assert tracker.totals() == (0, 0)
    assert upstream.released() == []  # the decode took the KV: nothing to release
    await d.close()


async def test_the_decode_leg_always_streams_and_a_whole_answer_is_assembled() -> None:
    upstream = MockUpstream(FakeCluster(text="hello"))
    tracker = tracker_for([1], [4])
    d, metrics = dispatcher(upstream, tracker)
    body = {"model": "m", "prompt": "p", "max_tokens": 5}
    # Events split across chunks.
    outcome, _, sink = await relay(d, metrics, body, chunk_bytes=7)
    decode_call = next(c for c in upstream.calls if c.leg == "decode")
    assert decode_call.body is not None
    assert decode_call.body["stream"] is True
    assert decode_call.body["stream_options"] == {"include_usage": True}
    assert outcome == "ok" and sink.status == 200
    answer = orjson.loads(sink.body)
    assert answer["object"] == "text_completion"
    assert answer["id"] == "req-1"
    assert answer["choices"][0]["text"] == "hello"
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 5
    assert tracker.totals() == (0, 0)
    await d.close()


async def test_a_decode_that_breaks_before_its_first_event_releases_the_kv_before_the_slot() -> (
    None
):
    upstream = MockUpstream(FakeCluster(decode_script=[Reply(chunks=[], fail_after=0)]))
    tracker = tracker_for([1], [4])
    d, metrics = dispatcher(upstream, tracker)
    outcome, _, sink = await relay(d, metrics)
    # Placed again, prefill included (gateway/stream/relay.py): the client never saw the failure.
    assert outcome == "ok" and sink.status == 200 and b'"error"' not in sink.body
    assert [c.leg for c in upstream.calls if c.leg != "release"] == ["prefill", "decode"] * 2
    await eventually(lambda: tracker.totals() == (0, 0))
    assert len(upstream.released()) == 1  # the broken decode may never have pulled it
    await d.close()


async def test_a_whole_answer_cut_short_is_a_real_502() -> None:
    chunks = completion_chunks("hello")
    upstream = MockUpstream(FakeCluster(decode_script=[Reply(chunks=chunks, fail_after=2)]))
    tracker = tracker_for([1], [4])
    d, metrics = dispatcher(upstream, tracker)
    body = {"model": "m", "prompt": "p", "max_tokens": 5}
    with pytest.raises(BadGateway):  # the endpoint answers it with its status
        await relay(d, metrics, body, chunk_bytes=64, max_migrations=0)
    await eventually(lambda: tracker.totals() == (0, 0))
    await d.close()


async def test_a_rejecting_decode_is_skipped_and_an_unreachable_one_keeps_the_kv() -> None:
    cluster = FakeCluster(decode_script=[Reply(status=429, json={}), Reply(unreachable=True)])
    upstream = MockUpstream(cluster)
    tracker = tracker_for([1], [4, 4, 4])
    d, _ = dispatcher(upstream, tracker)
    placement = await place(d)
    decodes = [c.url for c in upstream.calls if c.leg == "decode"]
    assert len(decodes) == 3 and len(set(decodes)) == 3
    assert upstream.released() == []  # the KV waited at the prefill for the third decode
    placement.close()
    await eventually(lambda: tracker.totals() == (0, 0))
    await d.close()


async def test_a_decode_error_status_fails_the_request_and_releases_the_kv() -> None:
    upstream = MockUpstream(FakeCluster(decode_script=[Reply(status=500, json={})]))
    tracker = tracker_for([1], [4, 4])
    d, _ = dispatcher(upstream, tracker)
    with pytest.raises(BadGateway):
        await place(d)
    await eventually(lambda: tracker.totals() == (0, 0))
    assert len(upstream.released()) == 1
    await d.close()


async def test_cancelled_while_the_decode_is_chosen_releases_everything() -> None:
    gate = asyncio.Event()

    async def handler(call: Any) -> Reply:
        if call.leg == "decode":
            await gate.wait()
        return await FakeCluster()(call)

    upstream = MockUpstream(handler)
    tracker = tracker_for([1], [4])
    d, _ = dispatcher(upstream, tracker)
    task = asyncio.ensure_future(place(d))
    await eventually(lambda: any(c.leg == "decode" for c in upstream.calls))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await eventually(lambda: tracker.totals() == (0, 0))
    assert len(upstream.released()) == 1
    await d.close()


async def test_direct_dispatch_tries_the_top_prefill_once() -> None:
    cluster = FakeCluster(prefill_script=[Reply(status=429, json={})])
    upstream = MockUpstream(cluster)
    tracker = tracker_for([1, 1], [4])
    d, _ = dispatcher(upstream, tracker, dispatch=DispatchMode.DIRECT)
    with pytest.raises(DeadlineExceeded, match="busy"):
        await place(d)
    assert [c.leg for c in upstream.calls] == ["prefill"]
    assert tracker.totals() == (0, 0)
    placement = await place(d)
    placement.close()
    await eventually(lambda: tracker.totals() == (0, 0))
    await d.close()


async def test_direct_dispatch_tells_a_refused_request_when_a_prefill_call_next_ends() -> None:
    """Without a gateway queue a busy prefill's next free slot comes as calls end: with none
    answered yet, the floor (0.01 s here); after five answered some 0.1 s apart, about the
    gap between them (more on a loaded machine). No prefill at all: the wait for the
    fleet's next read (1 s)."""
    busy = False

    async def handler(call: Any) -> Reply:
        if busy and call.leg == "prefill":
            return Reply(status=429, json={})
        return await FakeCluster()(call)

    tracker = tracker_for([1, 1], [4])
    d, _ = dispatcher(
        MockUpstream(handler), tracker, dispatch=DispatchMode.DIRECT, retry_after_s=0.01
    )
    busy = True
    with pytest.raises(DeadlineExceeded, match="busy") as first:
        await place(d)
    assert first.value.retry_after == 0.01
    busy = False
    for _ in range(5):
        (await place(d)).close()
        await asyncio.sleep(0.1)
    busy = True
    with pytest.raises(DeadlineExceeded, match="busy") as later:
        await place(d)
    assert later.value.retry_after is not None and 0.08 <= later.value.retry_after <= 0.5
    await eventually(lambda: tracker.totals() == (0, 0))
    await d.close()
    none, _ = dispatcher(
        MockUpstream(FakeCluster()),
        tracker_for([], [4]),
        dispatch=DispatchMode.DIRECT,
        retry_after_s=0.01,
    )
    with pytest.raises(DeadlineExceeded, match="no prefill instance") as absent:
        await place(none)
    assert absent.value.retry_after == 1.0
    await none.close()


async def test_no_decode_before_the_deadline_is_a_503_and_the_kv_is_released() -> None:
    cluster = FakeCluster(decode_script=[Reply(status=429, json={})] * 100)
    upstream = MockUpstream(cluster)
    tracker = tracker_for([1], [1])
    d, _ = dispatcher(upstream, tracker)
    with pytest.raises(DeadlineExceeded, match="decode"):
        await place(d, deadline_s=0.2)
    await eventually(lambda: tracker.totals() == (0, 0))
    assert len(upstream.released()) == 1
    await d.close()


@pytest.mark.parametrize(("admit", "calls_while_computing"), [("idle", 1), ("room", 2)])
async def test_a_computing_prefill_gets_no_second_request_unless_admit_is_room(
    admit: str, calls_while_computing: int
) -> None:
    """``prefill_admit = idle`` (the default): a prefill with free slots that is computing one
    of our requests is not sent another, which waits in the gateway's queue; ``room`` sends
    it into the prefill's next batch at once."""
    gate = asyncio.Event()
    upstream = MockUpstream(FakeCluster(gate=gate))
    tracker = tracker_for([4], [8])
    d, _ = dispatcher(upstream, tracker, prefill_admit=admit)
    first = asyncio.ensure_future(place(d))
    await eventually(lambda: any(c.leg == "prefill" for c in upstream.calls))
    second = asyncio.ensure_future(place(d))  # arrives while the prefill computes the first
    await asyncio.sleep(0.2)
    assert [c.leg for c in upstream.calls].count("prefill") == calls_while_computing
    gate.set()
    for task in (first, second):
        (await task).close()
    await eventually(lambda: tracker.totals() == (0, 0))
    await d.close()


async def test_the_decode_s_first_event_reports_the_hand_over_time() -> None:
    """Early drop learns how long a decode takes from the prefill's answer to its first
    event (the part of a first token's time after the prefill): the first event reports it."""
    upstream = MockUpstream(FakeCluster(text="abc"))
    tracker = tracker_for([1], [4])
    d, _ = dispatcher(upstream, tracker)
    handed: list[float] = []
    placement = await place(d)
    assert placement._grant.on_handover is not None  # the forwarder listens
    placement._grant.on_handover = handed.append
    await asyncio.sleep(0.05)
    placement.first_byte()
    placement.first_byte()  # once only
    assert len(handed) == 1 and handed[0] >= 0.05
    placement.close()
    await d.close()


async def test_a_decode_too_busy_to_answer_by_the_deadline_sheds_the_request_not_the_decode() -> (
    None
):
    """Past capacity, a request can reach its decode leg with little time left, and a busy
    decode answers later than that. The attempt's timeout is then the request's deadline:
    it was answered 502 "every decode instance failed" (no Retry-After) and the decode was
    marked failed. It is the request that ran out of time: 503 with Retry-After, and the
    decode keeps its standing."""

    async def slow_decode(call: Any) -> Reply:
        if call.leg == "decode":
            await asyncio.sleep(1.0)
        return await FakeCluster(text="abc")(call)

    upstream = MockUpstream(slow_decode)
    tracker = tracker_for([1], [4])
    d, metrics = dispatcher(upstream, tracker)
    with pytest.raises(DeadlineExceeded) as raised:
        await place(d, deadline_s=0.3)
    assert raised.value.retry_after is not None
    decode = next(r for r in tracker.describe() if r["id"] == "d0")
    assert not decode["ejected"], decode
    assert metrics.decode_attempts.labels("deadline")._value.get() == 1
    assert metrics.decode_attempts.labels("failed")._value.get() == 0
    await eventually(lambda: tracker.totals() == (0, 0))
    assert len(upstream.released()) == 1  # nobody took the KV: released at the prefill
    await d.close()


async def test_a_decode_that_does_not_know_the_prefill_yet_is_tried_again() -> None:
    """A decode whose view of the registry lags the gateway's (across a Redis failover)
    refuses KV from a prefill it does not know yet with 400 ``unknown_kv_source``. That is
    about the decode's view, not the request: it was passed to the client as its own 400.
    The decode pulled nothing, so the gateway tries again until its deadline."""
    cluster = FakeCluster(text="abc")
    refusals = 0

    async def lagging(call: Any) -> Reply:
        nonlocal refusals
        if call.leg == "decode" and refusals < 2:
            refusals += 1
            error = {"message": "kv_transfer_params name no prefill", "code": "unknown_kv_source"}
            return Reply(status=400, json={"error": error})
        return await cluster(call)

    upstream = MockUpstream(lagging)
    tracker = tracker_for([1], [4])
    d, _ = dispatcher(upstream, tracker)
    placement = await place(d)
    assert refusals == 2 and placement.decode_id == "d0"
    placement.close()
    await eventually(lambda: tracker.totals() == (0, 0))
    await d.close()


async def test_the_fleet_s_samples_heard_before_a_queue_s_first_request_all_count() -> None:
    """Another gateway's sync may carry a single sample, a hand-over time say, so a queue not
    served here yet keeps samples, not syncs: counted by syncs, the bound dropped most of a
    hardware type's samples, and the first requests here went to the slower prefill."""
    tracker = InstanceTracker(reject_hold_s=0.05)
    recs = records([1, 1], [4])
    recs["p0"] = dataclasses.replace(recs["p0"], hardware="l20")
    recs["p1"] = dataclasses.replace(recs["p1"], hardware="h100")
    tracker.update_membership(recs)
    d, _ = dispatcher(MockUpstream(FakeCluster(text="abc")), tracker)
    for _ in range(20):  # per request, its prefill, compute and hand-over times, a sync each
        for hw, seconds in (("l20", 0.9), ("h100", 0.1)):
            for entry in (f"p 4800 {seconds} {hw}", f"c 4800 {seconds} {hw}", "p 0 0.01"):
                d.incoming("m|", [entry])
    assert speeds(tracker) == {"p0": 1.0, "p1": 1.0}  # no queue yet: kept, not applied

    placement = await place(d)  # the queue's first request finds the fleet's samples
    placement.close()
    assert speeds(tracker) == {"p0": pytest.approx(1 / 9), "p1": 1.0}
    await eventually(lambda: tracker.totals() == (0, 0))
    await d.close()


def speeds(tracker: InstanceTracker) -> dict[str, float]:
    return {r["id"]: r["speed"] for r in tracker.describe() if r["role"] == "prefill"}


async def test_a_request_no_decode_took_is_told_when_the_decodes_would_have_room() -> None:
    """Every decode answers 429 until the request's deadline. The decodes (one of 2 slots,
    each held 1 s a request: 2 a second) have 9 other prefilled requests waiting beside this
    one, and 2 slots free as this gateway counts them: the 8 beyond those go at 2 a second,
    4 s, where a fixed second would send it back to the same wait."""
    recs = records([1], [2])
    recs["d0"] = dataclasses.replace(recs["d0"], extensions=(EXT_QUEUELESS,))  # 429 when full
    tracker = InstanceTracker(reject_hold_s=0.05)
    tracker.update_membership(recs)
    upstream = MockUpstream(FakeCluster(decode_script=[Reply(status=429, json={})] * 1000))
    d, _ = dispatcher(upstream, tracker, decode_backpressure=False)
    assert d.decode_capacity is not None
    for _ in range(20):
        d.decode_capacity.held("d0", 1.0)
    waits = d._shared.decode_waits
    later = time.monotonic() + 60
    turns = [waits.join("m", None, later, resumed=False) for _ in range(9)]
    try:
        with pytest.raises(DeadlineExceeded, match="no decode instance") as raised:
            await place(d, deadline_s=0.3)
        assert raised.value.retry_after == 4.0
    finally:
        for turn in turns:
            waits.leave(turn, placed=False)
        await d.close()


def _push_fleet(decode_connector: str = KvConnector.NIXL_PUSH) -> InstanceTracker:
    """A push prefill and a decode of 2 slots that enforces them (429 when full)."""
    recs = records([1], [2])
    recs["p0"] = dataclasses.replace(recs["p0"], connector=KvConnector.NIXL_PUSH)
    recs["d0"] = dataclasses.replace(
        recs["d0"], connector=decode_connector, extensions=(EXT_QUEUELESS,)
    )
    tracker = InstanceTracker(reject_hold_s=0.05)
    tracker.update_membership(recs)
    return tracker


async def test_a_push_request_no_decode_had_room_for_is_told_when_one_would() -> None:
    """The push decode's 2 slots are both held, each 1 s a request (2 a second); 5 other push
    requests wait for room beside this one and 3 prefilled requests wait for a decode of
    the group: the 9 go at 2 a second, 4.5 s, not the floor (0.01 s here)."""
    tracker = _push_fleet()
    d, _ = dispatcher(MockUpstream(FakeCluster()), tracker, retry_after_s=0.01)
    assert d.decode_capacity is not None and d._push is not None
    for _ in range(20):
        d.decode_capacity.held("d0", 1.0)
    held = [tracker.begin("d0") for _ in range(2)]
    waits = d._shared.decode_waits
    later = time.monotonic() + 60
    turns = [waits.join("m", None, later, resumed=False) for _ in range(3)]

    def reserve(name: str, deadline_s: float) -> Any:
        assert d._push is not None
        return d._push.reserve(
            info(name), body={}, path="/v1/completions", deadline=time.monotonic() + deadline_s,
            span=None,
        )  # fmt: skip

    others = [asyncio.ensure_future(reserve(f"o{i}", 60)) for i in range(5)]
    try:
        await asyncio.sleep(0.01)  # each has found no room and waits
        with pytest.raises(DeadlineExceeded, match="no decode instance had room") as raised:
            await reserve("late", 0.3)
        assert raised.value.retry_after == 4.5
    finally:
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        for turn in turns:
            waits.leave(turn, placed=False)
        for lease in held:
            lease.release()
        await d.close()


async def test_a_push_request_with_no_push_decode_is_told_the_next_read_of_the_fleet() -> None:
    """No decode takes a push prefill's KV (the one there pulls): a new one shows at the
    gateway's next read of the membership (1 s), not after the floor (0.01 s here)."""
    tracker = _push_fleet(decode_connector=KvConnector.NIXL)
    d, _ = dispatcher(MockUpstream(FakeCluster()), tracker, retry_after_s=0.01)
    assert d._push is not None
    with pytest.raises(DeadlineExceeded, match="no decode instance for a push") as raised:
        await d._push.reserve(
            info(), body={}, path="/v1/completions", deadline=time.monotonic() + 0.1, span=None
        )
    assert raised.value.retry_after == 1.0
    await d.close()


def _aggregated(capacity: int = 1) -> InstanceTracker:
    tracker = InstanceTracker(reject_hold_s=0.05)
    record = InstanceRecord(
        id="a0", role=Role.AGGREGATED, url="http://a0", model="m", capacity=capacity
    )
    tracker.update_membership({"a0": record})
    return tracker


async def test_an_aggregated_instance_that_did_not_answer_in_time_tells_the_queues_wait() -> None:
    """The one-slot aggregated instance takes a request (its TTFT budget 1 s) and does not
    answer by its deadline, while 30 of a more urgent class queue, the queue served at
    some 13 a second while saturated (40 grants the fleet reported over some 3 s): its
    retry, at its kept place, still goes after those 30, less the 13 the pace reaches in
    its budget, some 1.25 s, as the queue tells a request that expired in it; not the floor
    (0.01 s here)."""

    async def handler(call: Any) -> Reply:
        if call.request_id == "probe":
            await asyncio.sleep(30)  # busy: no answer before the deadline
        return await FakeCluster()(call)

    upstream = MockUpstream(handler)
    tracker = _aggregated()
    d, _ = dispatcher(upstream, tracker, retry_after_s=0.01)
    probe = dataclasses.replace(info("probe"), ttft_s=1.0)
    fwd = d._queues.get(probe, Role.AGGREGATED)
    now = time.monotonic()
    fwd.admission.saturated(now - 2.0)
    fwd.admission.reported(now - 1.0, 40)
    forward = {"model": "m", "prompt": "p", "max_tokens": 4}

    async def backlog() -> list[Any]:
        await eventually(lambda: any(c.request_id == "probe" for c in upstream.calls))
        return [
            asyncio.ensure_future(
                d.prefill(
                    dataclasses.replace(info(f"b{i}"), priority=0),
                    forward,
                    request_id=f"b{i}",
                    deadline=now + 60,
                )
            )
            for i in range(30)
        ]

    queued = asyncio.ensure_future(backlog())
    try:
        with pytest.raises(DeadlineExceeded, match="no instance answered") as raised:
            await d.prefill(probe, forward, request_id="probe", deadline=now + 1.0)
        per_s, _, headroom = fwd.admission.drain_view()  # as it was judged: nothing ran since
        assert len(fwd.queue) == 30 and headroom == 0.0
        assert per_s == pytest.approx(40 / 3, rel=0.2)
        assert raised.value.retry_after == pytest.approx((30 - per_s * 1.0) / per_s, abs=0.002)
    finally:
        tasks = await queued
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await d.close()


async def test_an_aggregated_request_whose_instance_was_ejected_is_told_the_next_read() -> None:
    """The only aggregated instance took the request and was ejected (failing) before its
    deadline: none is left to serve it until a new one shows at the gateway's next read of
    the membership (1 s), not after the floor (0.01 s here)."""
    tracker = _aggregated()

    async def handler(call: Any) -> Reply:
        tracker.eject("a0", time.monotonic() + 30)
        await asyncio.sleep(30)
        return Reply()

    d, _ = dispatcher(MockUpstream(handler), tracker, retry_after_s=0.01)
    with pytest.raises(DeadlineExceeded, match="no instance answered") as raised:
        await place(d, deadline_s=0.3)
    assert raised.value.retry_after == 1.0
    await d.close()
