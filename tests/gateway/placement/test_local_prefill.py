"""Conditional disaggregation: the decision and its counts, against `MockUpstream`.

A request with at most ``local_prefill_max_uncached_chars`` uncached prompt characters on a
decode that declares ``local_prefill`` goes to that decode alone (no prefill leg, no
``kv_transfer_params``); anything else, and any 429 or failure there, takes the usual
prefill + decode path. Real processes: tests/gateway/placement/test_local_prefill_cluster.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry

from pdgate.config import Role
from pdgate.config.wire import EXT_BATCH_PREFILL, EXT_LOCAL_PREFILL
from pdgate.gateway.instances.tracker import InstanceTracker
from pdgate.gateway.placement.dispatch import Dispatcher
from pdgate.gateway.placement.placed import Placement
from pdgate.gateway.upstream.mock import Call, MockUpstream, Reply
from pdgate.registry.base import InstanceRecord
from tests.gateway._fakes import FakeCluster, dispatcher, eventually, info
from tests.gateway._fakes import place as both_legs

SHORT = "x" * 50
LONG = "y" * 300
THRESHOLD = 100


def cluster(
    declaring: Sequence[str], plain: Sequence[str] = (), capacity: int = 4
) -> InstanceTracker:
    """One prefill p0, decodes that declare local prefill and decodes that do not."""
    records = {
        "p0": InstanceRecord(
            id="p0", role=Role.PREFILL, url="http://p0", model="m", capacity=4,
            extensions=(EXT_BATCH_PREFILL,),
        )
    }  # fmt: skip
    for ids, ext in ((declaring, (EXT_LOCAL_PREFILL,)), (plain, ())):
        for i in ids:
            records[i] = InstanceRecord(
                id=i, role=Role.DECODE, url=f"http://{i}", model="m", capacity=capacity,
                extensions=ext,
            )  # fmt: skip
    tracker = InstanceTracker(reject_hold_s=0.05)
    tracker.update_membership(records)
    return tracker


async def place(d: Dispatcher, prompt: str, *, stream: bool = True) -> Placement:
    forward = {"model": "m", "prompt": prompt, "max_tokens": 4, "stream": stream}
    placement: Placement = await both_legs(
        d, info(prompt), forward, request_id="r", deadline=time.monotonic() + 2
    )
    return placement


def decode_calls(upstream: MockUpstream) -> list[Call]:
    return [c for c in upstream.calls if c.leg == "decode"]


def legs(upstream: MockUpstream) -> list[tuple[str, str, bool]]:
    """(leg, instance, carries kv_transfer_params) per prefill or decode call."""
    return [
        (c.leg, c.url.removeprefix("http://"), "kv_transfer_params" in (c.body or {}))
        for c in upstream.calls
        if c.leg != "release"
    ]


def sample(registry: CollectorRegistry, outcome: str) -> float:
    value = registry.get_sample_value("pdgate_local_prefill_total", {"outcome": outcome})
    return 0.0 if value is None else value


async def test_a_short_prompt_goes_straight_to_a_declaring_decode() -> None:
    upstream = MockUpstream(FakeCluster())
    # d0 does not declare it and is tried first by the decode policy (fewer in flight).
    tracker = cluster(declaring=["d1"], plain=["d0"])
    busier = tracker.begin("d1")  # d1 is busier, still it is the only one that may prefill
    d, metrics = dispatcher(upstream, tracker, local_prefill_max_uncached_chars=THRESHOLD)
    placement = await place(d, SHORT, stream=False)
    assert legs(upstream) == [("decode", "d1", False)]
    (call,) = decode_calls(upstream)
    assert call.body is not None
    assert call.body["prompt"] == SHORT
    assert call.body["stream"] is True  # the decode leg always streams
    assert call.body["stream_options"] == {"include_usage": True}
    assert (placement.prefill_id, placement.decode_id) == ("d1", "d1")
    assert placement.prefill_attempts == 0
    assert sample(metrics.registry, "local") == 1
    row = next(r for r in tracker.describe() if r["id"] == "d1")
    # The decode leg's counts (open stream, slot) plus the local prompt's token work.
    assert (row["open_streams"], row["inflight"]) == (1, 2)
    assert row["inflight_tokens"] > 0
    placement.first_byte()  # the prompt is computed: its token work is done
    assert next(r for r in tracker.describe() if r["id"] == "d1")["inflight_tokens"] == 0
    placement.close()
    busier.release()
    assert tracker.totals() == (0, 0)
    assert upstream.released() == []  # no KV anywhere
    await d.close()


async def test_a_long_prompt_and_a_decode_without_the_extension_go_through_a_prefill() -> None:
    upstream = MockUpstream(FakeCluster())
    d, metrics = dispatcher(
        upstream, cluster(declaring=["d1"]), local_prefill_max_uncached_chars=THRESHOLD
    )
    placement = await place(d, LONG)
    assert legs(upstream) == [("prefill", "p0", True), ("decode", "d1", True)]
    assert placement.prefill_id == "p0"
    assert sample(metrics.registry, "skipped") == 1
    placement.close()
    await d.close()

    # Decodes that do not declare it never get a plain request, however short the prompt.
    upstream = MockUpstream(FakeCluster())
    d, metrics = dispatcher(
        upstream, cluster(declaring=[], plain=["d0"]), local_prefill_max_uncached_chars=THRESHOLD
    )
    placement = await place(d, SHORT)
    assert legs(upstream) == [("prefill", "p0", True), ("decode", "d0", True)]
    assert sample(metrics.registry, "skipped") == 1
    placement.close()
    await d.close()


async def test_threshold_zero_keeps_the_prefill_leg() -> None:
    upstream = MockUpstream(FakeCluster())
    d, metrics = dispatcher(upstream, cluster(declaring=["d1"]))  # the default: off
    placement = await place(d, SHORT)
    assert legs(upstream) == [("prefill", "p0", True), ("decode", "d1", True)]
    assert sample(metrics.registry, "skipped") == sample(metrics.registry, "local") == 0
    placement.close()
    await d.close()


async def test_a_prefix_the_decode_served_counts_as_cached() -> None:
    for aware in (True, False):
        upstream = MockUpstream(FakeCluster())
        d, metrics = dispatcher(
            upstream,
            cluster(declaring=["d1"]),
            local_prefill_max_uncached_chars=THRESHOLD,
            local_prefill_prefix_aware=aware,
        )
        (await place(d, LONG)).close()  # through the prefill: d1 now holds LONG's blocks
        upstream.calls.clear()
        # 300 + 40 characters, 4 blocks of 64 held by d1: 84 uncached, within 100.
        placement = await place(d, LONG + "z" * 40)
        if aware:
            assert legs(upstream) == [("decode", "d1", False)]
            assert sample(metrics.registry, "local") == 1
        else:
            assert legs(upstream) == [("prefill", "p0", True), ("decode", "d1", True)]
            assert sample(metrics.registry, "skipped") == 2
        placement.close()
        await d.close()


async def test_the_decode_holding_the_prefix_is_the_one_asked() -> None:
    upstream = MockUpstream(FakeCluster())
    tracker = cluster(declaring=["d0", "d1"])
    d, _ = dispatcher(upstream, tracker, local_prefill_max_uncached_chars=THRESHOLD)
    held = tracker.open_stream("d0")  # the first long request's decode leg goes to d1
    (await place(d, LONG)).close()
    held.release()
    assert legs(upstream)[-1] == ("decode", "d1", True)
    upstream.calls.clear()
    # d0 is now the less loaded, but only d1 has 84 uncached characters, not 340.
    placement = await place(d, LONG + "z" * 40)
    assert legs(upstream) == [("decode", "d1", False)]
    placement.close()
    await d.close()


async def test_a_429_or_a_failure_at_the_decode_falls_back_to_prefill_and_decode() -> None:
    for reply, outcome in (
        (Reply(status=429), "rejected"),
        (Reply(unreachable=True), "failed"),
        (Reply(status=503), "failed"),
        (Reply(status=400), "client_error"),
    ):
        fake = FakeCluster(decode_script=[reply])
        upstream = MockUpstream(fake)
        tracker = cluster(declaring=["d1"], plain=["d0"])
        d, metrics = dispatcher(upstream, tracker, local_prefill_max_uncached_chars=THRESHOLD)
        placement = await place(d, SHORT)
        (local, prefill, decode) = legs(upstream)
        assert local == ("decode", "d1", False)
        assert (prefill, decode[0], decode[2]) == (("prefill", "p0", True), "decode", True)
        if outcome != "client_error":
            assert decode[1] == "d0"  # d1 is skipped for a while after it
        assert placement.prefill_id == "p0"
        assert sample(metrics.registry, "fallback") == 1
        attempts = metrics.registry.get_sample_value(
            "pdgate_decode_attempts_total", {"result": outcome}
        )
        assert attempts == 1
        placement.close()
        await eventually(lambda t=tracker: t.totals() == (0, 0))  # after the KV release
        await d.close()


async def test_a_full_or_busy_decode_is_not_asked() -> None:
    upstream = MockUpstream(FakeCluster())
    tracker = cluster(declaring=["d1"], plain=["d0"], capacity=1)
    d, metrics = dispatcher(upstream, tracker, local_prefill_max_uncached_chars=THRESHOLD)
    lease = tracker.begin("d1")  # its one slot is taken (as this gateway knows it)
    placement = await place(d, SHORT)
    assert legs(upstream) == [("prefill", "p0", True), ("decode", "d0", True)]
    assert sample(metrics.registry, "skipped") == 1
    placement.close()
    lease.release()
    tracker.rejected("d1")  # a recent 429: skipped until it frees a slot or the hold ends
    upstream.calls.clear()
    placement = await place(d, SHORT)
    assert legs(upstream)[0][0] == "prefill"
    placement.close()
    await d.close()


async def test_every_count_is_released_when_the_caller_leaves_mid_attempt() -> None:
    gate, called = asyncio.Event(), asyncio.Event()

    async def slow_decode(call: Call) -> Reply:
        called.set()
        await gate.wait()
        return Reply(chunks=[b"data: [DONE]\n\n"])

    upstream = MockUpstream(slow_decode)
    tracker = cluster(declaring=["d1"])
    d, _ = dispatcher(upstream, tracker, local_prefill_max_uncached_chars=THRESHOLD)
    task = asyncio.ensure_future(place(d, SHORT))
    await called.wait()
    assert tracker.totals() == (1, 1)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert tracker.totals() == (0, 0)
    await d.close()
