"""The forwarder against `MockUpstream`: batch fallback, early drop, and the hand-off rules
(every abandoned prefill call releases its KV, a grant nobody takes is closed)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import orjson
import pytest

from pdgate.config.wire import DECODE_MAX_TOKENS_HEADER
from pdgate.gateway.errors import DeadlineExceeded, GatewayError
from pdgate.gateway.instances.tracker import InstanceTracker
from pdgate.gateway.observe.metrics import GatewayMetrics
from pdgate.gateway.placement.admission import AdmissionOptions
from pdgate.gateway.placement.decode_attempt import client_error
from pdgate.gateway.placement.forwarder import PrefillForwarder
from pdgate.gateway.placement.leases import Fleet
from pdgate.gateway.placement.queue import Waiter
from pdgate.gateway.placement.shared import ForwardingOptions
from pdgate.gateway.upstream.base import batch_body
from pdgate.gateway.upstream.mock import Call, MockUpstream, Reply
from pdgate.policies import load_policy
from pdgate.registry.fleet import RedisFleet
from tests.gateway._fakes import (
    FakeCluster,
    batching_forwarder,
    eventually,
    forwarder,
    tracker_for,
    waiter,
)


async def test_prefill_without_batch_endpoint_falls_back_to_single_calls() -> None:
    upstream = MockUpstream(FakeCluster(prefill_delay_s=0.01), batch_endpoint=False)
    tracker = tracker_for([8])
    fwd, _, background = batching_forwarder(upstream, tracker)
    for round_no in range(2):
        grants = await asyncio.gather(*(fwd.acquire(waiter(i)) for i in range(4)))
        assert [g.instance.id for g in grants] == ["p0"] * 4
        for g in grants:
            g.close()
        # Tried once, then remembered: the second run goes straight to single calls.
        assert len(upstream.batches) == 1
        prefills = [c for c in upstream.calls if c.leg == "prefill"]
        assert len(prefills) == 4 * (round_no + 1)
    await eventually(lambda: tracker.totals() == (0, 0))
    await fwd.close()
    await background.aclose()


async def test_a_prefill_that_declares_no_batch_endpoint_never_gets_a_batch_call() -> None:
    """A stock server (static, announced) gets exactly vLLM's handshake: one call per request,
    batch forwarding still filling its slots."""
    upstream = MockUpstream(FakeCluster(prefill_delay_s=0.01))
    tracker = tracker_for([8], stock=True)
    fwd, _, background = batching_forwarder(upstream, tracker)
    grants = await asyncio.gather(*(fwd.acquire(waiter(i)) for i in range(4)))
    assert [g.instance.id for g in grants] == ["p0"] * 4
    for g in grants:
        g.close()
    assert upstream.batches == []
    assert [c.leg for c in upstream.calls] == ["prefill"] * 4
    await eventually(lambda: tracker.totals() == (0, 0))
    await fwd.close()
    await background.aclose()


@pytest.mark.parametrize(
    "failure",
    [
        Reply(unreachable=True),
        Reply(status=500, json={"error": {"message": "boom"}}),
        # The gateway's credentials, not the client's request: another prefill, not a 400.
        Reply(status=401, json={"error": {"message": "invalid api key"}}),
        Reply(status=404, json={"error": {"message": "no such model"}}),
    ],
    ids=["unreachable-or-timeout", "5xx", "401", "404"],
)
async def test_a_failed_prefill_call_releases_its_kv_and_the_request_moves_on(
    failure: Reply,
) -> None:
    """Issue 9: the 502 branch released the counts but never the KV id, so a prefill that had
    stored the KV kept the slot for its whole hold timeout."""
    cluster = FakeCluster(prefill_script=[failure])
    upstream = MockUpstream(cluster)
    tracker = tracker_for([1, 1])
    fwd, _, background = forwarder(upstream, tracker)
    grant = await fwd.acquire(waiter(0))
    first = next(c for c in upstream.calls if c.leg == "prefill")
    assert first.kv_id is not None
    await eventually(lambda: any(url.endswith("/" + first.kv_id) for url in upstream.released()))
    assert grant.instance.id != first.url.rsplit("/", 1)[-1]  # tried the other prefill
    grant.close()
    await eventually(lambda: tracker.totals() == (0, 0))
    await fwd.close()
    await background.aclose()


async def test_a_call_abandoned_at_the_deadline_releases_its_kv_then_its_count() -> None:
    release_gate = asyncio.Event()

    class SlowRelease(MockUpstream):
        async def release_kv_id(self, base_url: str, kv_id: str, *, request_id: str) -> str | None:
            await release_gate.wait()
            return await super().release_kv_id(base_url, kv_id, request_id=request_id)

    upstream = SlowRelease(FakeCluster(prefill_delay_s=1.0))
    tracker = tracker_for([1])
    fwd, _, background = forwarder(upstream, tracker, admission=AdmissionOptions(early_drop=False))
    with pytest.raises(DeadlineExceeded):
        await fwd.acquire(waiter(0, deadline_s=0.05))
    await asyncio.sleep(0.05)
    # The prefill frees its slot when the release arrives, so the gateway's count waits too.
    assert tracker.totals() == (1, 1)
    release_gate.set()
    await eventually(lambda: tracker.totals() == (0, 0))
    assert len(upstream.released()) == 1
    await fwd.close()
    await background.aclose()


async def test_a_call_whose_waiter_gave_up_before_it_started_gives_its_counts_back() -> None:
    """The deadline fails the waiter just before the forwarder's turn, which still reserves
    it and starts its call's task; the waiter's clean-up then cancels that task before its
    first step, when no line of the call has run. Its counts stayed taken for good: with
    `prefill_admit = idle` the prefill looked busy to every later request."""
    upstream = MockUpstream(FakeCluster())
    tracker = tracker_for([1])
    fwd, _, background = forwarder(upstream, tracker)
    w = waiter(0)
    acquiring = asyncio.ensure_future(fwd.acquire(w))
    await asyncio.sleep(0)  # queued, and the forwarder woken (its turn comes next)
    w.future.set_exception(DeadlineExceeded("expired"))  # as the deadline's timer does
    with pytest.raises(DeadlineExceeded):
        await acquiring
    await eventually(lambda: tracker.totals() == (0, 0))
    assert [c for c in upstream.calls if c.leg == "prefill"] == []  # no call was made
    grant = await fwd.acquire(waiter(1))  # the slot serves the next request
    grant.close()
    await eventually(lambda: tracker.totals() == (0, 0))
    await fwd.close()
    await background.aclose()


@pytest.mark.parametrize("said", ["admitted", "rejected", "unseen", None])
async def test_a_call_cut_off_is_counted_by_what_its_prefill_said_of_it(said: str | None) -> None:
    """A call released unanswered is counted by what the prefill answered to the release
    (unknown: it did not say), before its counts are given back: once they are, the
    gateway's and the prefills' counts can be compared."""
    failure = Reply(status=500, json={"error": {"message": "boom"}})
    cluster = FakeCluster(prefill_delay_s=0.2, prefill_script=[failure])
    upstream = MockUpstream(cluster, admission=said)
    tracker = tracker_for([1, 1])
    fwd, metrics, background = forwarder(upstream, tracker)
    leaving = asyncio.create_task(fwd.acquire(waiter(0)))
    # The first call fails; its client leaves while the second computes.
    await eventually(lambda: len([c for c in upstream.calls if c.leg == "prefill"]) == 2)
    leaving.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await leaving
    await eventually(lambda: tracker.totals() == (0, 0))
    sample = metrics.registry.get_sample_value
    for result in ("failed", "abandoned"):
        labels = {"result": result, "outcome": said or "unknown"}
        assert sample("pdgate_prefill_abandoned_outcomes_total", labels) == 1
    await fwd.close()
    await background.aclose()


async def test_a_call_that_runs_out_with_its_requests_deadline_is_no_prefill_failure() -> None:
    """A call's time is its request's when that is the shorter: a prefill that does not
    answer before a short deadline was counted as failed, and five such requests ejected a
    healthy prefill. The request is shed (503); the prefill keeps its standing."""
    calls = 0

    async def slow_past_the_deadline(call: Call) -> Reply:
        nonlocal calls
        if call.leg == "prefill":
            calls += 1
            if calls <= 6:
                # The loop held past the deadline, then the call's own timeout: whichever of
                # the two timers fires first, deterministically this one.
                time.sleep(0.03)  # noqa: ASYNC251 - holding the loop is the point
                return Reply(unreachable=True)
        return await FakeCluster()(call)

    upstream = MockUpstream(slow_past_the_deadline)
    tracker = tracker_for([1])
    options = AdmissionOptions(early_drop=False)
    fwd, metrics, background = forwarder(upstream, tracker, admission=options)
    for i in range(6):
        with pytest.raises(DeadlineExceeded):
            await fwd.acquire(waiter(i, deadline_s=0.02))
    sample = metrics.registry.get_sample_value
    assert sample("pdgate_prefill_attempts_total", {"result": "deadline"}) == 6
    assert sample("pdgate_prefill_attempts_total", {"result": "failed"}) is None
    assert not tracker.cooling_down("p0")
    grant = await fwd.acquire(waiter(9))
    assert grant.instance.id == "p0"
    grant.close()
    await eventually(lambda: tracker.totals() == (0, 0))
    await fwd.close()
    await background.aclose()


async def test_a_grant_landing_as_the_caller_is_cancelled_is_closed() -> None:
    """Issue 9: when the cancel and the grant land in the same loop iteration, the grant was
    neither returned nor released: its leases, in-flight count and KV leaked."""
    cluster = FakeCluster()
    upstream = MockUpstream(cluster)
    tracker = tracker_for([1])
    fwd, _, background = forwarder(upstream, tracker)
    acquiring: asyncio.Task[object] | None = None

    async def answer_and_cancel(call: object) -> Reply:
        reply = await FakeCluster()(call)  # type: ignore[arg-type]
        # Queued before the grant's own callbacks: the caller is cancelled in the very
        # iteration in which its grant becomes ready.
        assert acquiring is not None
        asyncio.get_running_loop().call_soon(acquiring.cancel)
        return reply

    upstream.handler = answer_and_cancel
    acquiring = asyncio.ensure_future(fwd.acquire(waiter(0)))
    with pytest.raises(asyncio.CancelledError):
        await acquiring
    await eventually(lambda: tracker.totals() == (0, 0))
    assert len(upstream.released()) == 1  # the KV computed for it was released
    await fwd.close()
    await background.aclose()


async def test_a_rejection_requeues_at_the_old_place_and_marks_the_prefill_busy() -> None:
    cluster = FakeCluster(prefill_script=[Reply(status=429, json={"error": {}})])
    upstream = MockUpstream(cluster)
    tracker = tracker_for([1])
    fwd, metrics, background = forwarder(upstream, tracker)
    grant = await fwd.acquire(waiter(0))
    assert grant.rejections == 1 and grant.attempts == 2
    assert (
        metrics.registry.get_sample_value("pdgate_prefill_attempts_total", {"result": "rejected"})
        == 1
    )
    assert upstream.released() == []  # a 429 holds nothing at the prefill
    grant.close()
    await eventually(lambda: tracker.totals() == (0, 0))
    await fwd.close()
    await background.aclose()


async def test_batch_forwarding_spreads_a_backlog_over_the_prefills_with_room() -> None:
    """A prefill computes a batch in about the time of its prompts one after another, so
    four queued requests and two idle prefills make two batches of two, not one of four
    while the other prefill idles."""
    upstream = MockUpstream(FakeCluster(prefill_delay_s=0.01))
    tracker = tracker_for([4, 4])
    fwd, _, background = batching_forwarder(upstream, tracker)
    grants = await asyncio.gather(*(fwd.acquire(waiter(i)) for i in range(4)))
    assert sorted(g.instance.id for g in grants) == ["p0", "p0", "p1", "p1"]
    assert [len(b) for b in upstream.batches] == [2]  # the first run; p1's came one by one
    for g in grants:
        g.close()
    await eventually(lambda: tracker.totals() == (0, 0))
    await fwd.close()
    await background.aclose()


async def test_the_idle_filter_keeps_requests_queued_until_a_prefill_is_idle() -> None:
    upstream = MockUpstream(FakeCluster(prefill_delay_s=0.3))
    tracker = tracker_for([4])
    idle = load_policy("least_sse", {"filters": ["not_ejected", "not_busy", "has_room", "idle"]})
    fwd, _, background = forwarder(upstream, tracker, policy=idle)
    first_task = asyncio.ensure_future(fwd.acquire(waiter(0)))
    await asyncio.sleep(0.05)
    second = asyncio.ensure_future(fwd.acquire(waiter(1)))
    await asyncio.sleep(0.1)
    # The prefill has three free slots but is computing the first prompt: the second request
    # waits in the gateway's queue, not in the prefill's next batch.
    assert not second.done()
    assert [c.leg for c in upstream.calls] == ["prefill"]
    first = await asyncio.wait_for(first_task, 5)
    # Answered, the first request's slot still holds its KV (no decode took it), but the
    # prefill computes nothing: the second goes into a free slot at once.
    (await asyncio.wait_for(second, 5)).close()
    assert [c.leg for c in upstream.calls].count("prefill") == 2
    first.close()
    await eventually(lambda: tracker.totals() == (0, 0))
    await fwd.close()
    await background.aclose()


async def test_a_batch_ends_where_it_would_make_a_member_late() -> None:
    """Each member of a batch waits for the others' prompts: a batch is only as long as its
    expected end (the sum of its members' expected prefill times) meets every deadline."""
    upstream = MockUpstream(FakeCluster(prefill_delay_s=0.01))
    tracker = tracker_for([4])
    fwd, _, background = batching_forwarder(upstream, tracker)
    for _ in range(16):  # enough samples for an estimate
        fwd.compute_times.record(1000, 1.0)  # 1 ms per character: 0.1 s per request below
    prompt = "x" * 100
    waiters = [waiter(0, deadline_s=0.25, prompt=prompt)]
    waiters += [waiter(i, deadline_s=5.0, prompt=prompt) for i in (1, 2, 3)]
    grants = await asyncio.gather(*(fwd.acquire(w) for w in waiters))
    # Two fit before the first request's deadline (0.2 s <= 0.25 s); the other two follow
    # in a batch of their own, not in one batch of four that ends at 0.4 s.
    assert [len(b) for b in upstream.batches] == [2, 2]
    for g in grants:
        g.close()
    await eventually(lambda: tracker.totals() == (0, 0))
    await fwd.close()
    await background.aclose()


async def test_a_batch_counts_the_hand_over_after_its_end() -> None:
    """A member's first token comes a hand-over after the batch ends: with 0.1 s of it
    known, two prompts of 0.1 s no longer meet the first request's 0.25 s (0.3 s), so it
    goes alone and the other three go together."""
    upstream = MockUpstream(FakeCluster(prefill_delay_s=0.01))
    tracker = tracker_for([4])
    fwd, _, background = batching_forwarder(upstream, tracker)
    for _ in range(16):
        fwd.compute_times.record(1000, 1.0)
        fwd.prefill_times.record_handover(0.1)
    prompt = "x" * 100
    waiters = [waiter(0, deadline_s=0.25, prompt=prompt)]
    waiters += [waiter(i, deadline_s=5.0, prompt=prompt) for i in (1, 2, 3)]
    grants = await asyncio.gather(*(fwd.acquire(w) for w in waiters))
    assert [len(b) for b in upstream.batches] == [3]  # the first request's call was single
    assert [g.instance.id for g in grants] == ["p0"] * 4
    for g in grants:
        g.close()
    await eventually(lambda: tracker.totals() == (0, 0))
    await fwd.close()
    await background.aclose()


async def test_a_prompt_in_a_batch_is_timed_at_its_share_of_the_batch() -> None:
    """Every answer of a batch comes when the prefill has computed all of it: timed whole,
    four short prompts batched together each looked four times as slow as it is, and early
    drop refused the next ones as hopeless."""
    upstream = MockUpstream(FakeCluster(prefill_delay_s=0.4))
    tracker = tracker_for([4])
    fwd, _, background = batching_forwarder(upstream, tracker)
    began = time.monotonic()
    grants = await asyncio.gather(*(fwd.acquire(waiter(i, prompt=f"prompt {i}")) for i in range(4)))
    took = time.monotonic() - began  # the batch call and more
    assert [len(b) for b in upstream.batches] == [4]
    recorded = fwd.prefill_times.take_new()
    assert [chars for chars, _, _ in recorded] == [len("prompt 0")] * 4
    # A quarter of the batch call (0.4 s or more) each; timed whole, each would be all of it.
    assert all(0.09 < seconds <= took / 4 for _, seconds, _ in recorded), (recorded, took)
    for g in grants:
        g.close()
    await eventually(lambda: tracker.totals() == (0, 0))
    await fwd.close()
    await background.aclose()


async def test_what_one_gateway_measured_another_estimates_with() -> None:
    upstream = MockUpstream(FakeCluster())
    here, _, bg1 = forwarder(upstream, tracker_for([1]))
    there, _, bg2 = forwarder(upstream, tracker_for([1]))
    for i in range(20):
        here.prefill_times.record(1000 + i, 0.5)
        here.compute_times.record(800, 0.4)
        here.prefill_times.record_handover(0.05)
    packed = here.samples_out()
    assert here.samples_out() == ""  # each sample is shared once
    there.samples_in([packed, "x 1 2;p nonsense;p 5"])  # another version's extras skipped
    for times in ("prefill_times", "compute_times"):
        mine, theirs = getattr(here, times), getattr(there, times)
        assert theirs.estimate_s(1000) == mine.estimate_s(1000) is not None
    assert there.prefill_times.handover_s() == here.prefill_times.handover_s() == 0.05
    assert there.prefill_times.hopeless(1000, 0.4) and not there.prefill_times.hopeless(1000, 1)
    assert there.samples_out() == ""  # what came from the fleet is not sent back to it
    for fwd, bg in ((here, bg1), (there, bg2)):
        await fwd.close()
        await bg.aclose()


async def test_every_prefill_call_says_what_its_decode_leg_will_ask_for() -> None:
    """So a pdgate prefill checks the context length with the client's max_tokens, not the
    prefill leg's 1 (config/wire.py, DECODE_MAX_TOKENS_HEADER)."""
    upstream = MockUpstream(FakeCluster())
    tracker = tracker_for([4])
    fwd, _, background = batching_forwarder(upstream, tracker)
    grants = await asyncio.gather(*(fwd.acquire(waiter(i)) for i in range(2)))  # one batch
    alone = await fwd.acquire(waiter(2))  # one call
    (batch,) = upstream.batches
    single = [c for c in upstream.calls if c.leg == "prefill" and c not in batch]
    for call in [*batch, *single]:
        assert call.headers[DECODE_MAX_TOKENS_HEADER] == "4"  # waiter()'s max_tokens
    for g in [*grants, alone]:
        g.close()
    await eventually(lambda: tracker.totals() == (0, 0))
    await fwd.close()
    await background.aclose()


@dataclass
class _TwoGateways:
    """Gateway a's forwarder on a fleet in Redis shared with gateway b (b: its store only)."""

    tracker: InstanceTracker
    upstream: MockUpstream
    fwd: PrefillForwarder
    metrics: GatewayMetrics
    there: RedisFleet


@contextlib.asynccontextmanager
async def _two_gateways(
    redis_url: str,
    prefix: str,
    slots: int,
    upstream: MockUpstream,
    options: ForwardingOptions | None = None,
    window_s: float = 0.02,
) -> AsyncIterator[_TwoGateways]:
    tracker = tracker_for([slots])
    here = Fleet(
        RedisFleet(redis_url, key_prefix=prefix, gateway_id="a", window_s=window_s), tracker
    )
    here.gateways = 2  # b shares the fleet: every slot through Redis
    there = RedisFleet(redis_url, key_prefix=prefix, gateway_id="b", window_s=window_s)
    fwd, metrics, background = forwarder(upstream, tracker, options, fleet=here)
    try:
        yield _TwoGateways(tracker, upstream, fwd, metrics, there)
    finally:
        await fwd.close()
        await background.aclose()
        await here.aclose()
        await there.aclose()


async def test_a_batch_takes_no_request_due_after_one_waiting_at_another_gateway(
    redis_url: str, registry_prefix: str
) -> None:
    """Batches in the fleet's deadline order: gateway b waits with a request due in a
    second, so gateway a's run stops before its own request due in five; that one goes in
    a run of its own (to the next idle prefill, here the same one once it answered)."""
    upstream = MockUpstream(FakeCluster(prefill_delay_s=0.05))
    options = ForwardingOptions(batch_forwarding=True, batch_endpoint=True, admit_idle=True,
                                client_error=client_error)  # fmt: skip
    async with _two_gateways(redis_url, registry_prefix, 4, upstream, options) as g:
        await g.there.sync({}, {}, {"m|": 1000.0}, [])  # b's queue head: due in 1 s
        grants = await asyncio.gather(
            g.fwd.acquire(waiter(0, deadline_s=0.5)), g.fwd.acquire(waiter(1, deadline_s=5.0))
        )
        assert upstream.batches == []  # never the two in one batch call
        assert [c.request_id for c in upstream.calls if c.leg == "prefill"] == ["r0", "r1"]
        for grant in grants:
            grant.close()
        await eventually(lambda: g.tracker.totals() == (0, 0))


async def test_a_freed_slot_is_left_to_a_more_urgent_gateway_and_counted(
    redis_url: str, registry_prefix: str
) -> None:
    """Gateway b waits with a request due in 2 s; a frees its prefill's one slot and has a
    request due in 5 s: a leaves the slot to b for the fleet's window (counted in
    pdgate_fleet_yields_total), then takes it when b does not come."""
    upstream = MockUpstream(FakeCluster())
    async with _two_gateways(redis_url, registry_prefix, 1, upstream, window_s=0.3) as g:
        first = await g.fwd.acquire(waiter(0, deadline_s=5.0))
        await g.there.sync({}, {}, {"m|": 2000.0}, [])  # b's queue head: due in 2 s
        began = time.monotonic()
        second = asyncio.create_task(g.fwd.acquire(waiter(1, deadline_s=5.0)))
        await asyncio.sleep(0.05)
        first.close()  # the slot frees: b's request is more urgent
        (await second).close()
        assert time.monotonic() - began >= 0.3  # it waited out the window
        yields = g.metrics.registry.get_sample_value("pdgate_fleet_yields_total")
        assert yields is not None and yields >= 1
        await eventually(lambda: g.tracker.totals() == (0, 0))


class WritesBodies(MockUpstream):
    """Writes each body before the call as the h1 client does, so that a body orjson cannot
    write fails where it would in a deployed gateway."""

    async def _post(self, call: Call, timeout_s: float) -> tuple[int, bytes]:
        orjson.dumps(call.body)
        return await super()._post(call, timeout_s)

    async def _post_batch(
        self, url: str, calls: list[Call], timeout_s: float
    ) -> AsyncIterator[bytes]:
        batch_body(calls)
        async for line in super()._post_batch(url, calls, timeout_s):
            yield line


def unwritable_waiter(i: int) -> Waiter:
    """A waiter whose body is nested past what orjson writes (it reads four times deeper)."""
    w = waiter(i)
    nested: list[object] = []
    for _ in range(300):
        nested = [nested]
    w.body = {"prompt": "x", "x": nested}
    return w


@pytest.mark.parametrize("batched", [False, True], ids=["one-call", "batch-call"])
async def test_a_call_that_breaks_in_the_gateway_fails_its_request_and_frees_everything(
    batched: bool,
) -> None:
    """A failure of the gateway's own (here, a body its JSON library cannot write) is not the
    prefill's: the request fails with a 500 instead of waiting out its deadline, it is not
    tried elsewhere, and its counts and KV id are released; the slots serve the next ones."""
    upstream = WritesBodies(FakeCluster())
    tracker = tracker_for([2, 2])
    if batched:
        fwd, _, background = batching_forwarder(upstream, tracker)
    else:
        fwd, _, background = forwarder(upstream, tracker)
    outcomes = await asyncio.gather(
        *(fwd.acquire(unwritable_waiter(i)) for i in range(4)), return_exceptions=True
    )
    # At once, not at the 5 s deadline (that would be a 503).
    for outcome in outcomes:
        assert isinstance(outcome, GatewayError) and outcome.status == 500, outcome
    assert len(upstream.released()) == 4  # each KV id, in case the prefill stored any
    await eventually(lambda: tracker.totals() == (0, 0))
    assert [c for c in upstream.calls if c.leg == "prefill"] == []  # none tried elsewhere
    grants = await asyncio.gather(*(fwd.acquire(waiter(i)) for i in range(4)))
    for grant in grants:
        grant.close()
    await eventually(lambda: tracker.totals() == (0, 0))
    await fwd.close()
    await background.aclose()
