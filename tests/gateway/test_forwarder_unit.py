"""The forwarder against a test double of its upstream seam (gateway/upstream.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from config import QueueOrder, Role
from gateway.dispatch import client_error
from gateway.errors import DeadlineExceeded, UpstreamStatus
from gateway.forwarder import ForwardingOptions, PrefillForwarder
from gateway.instances import InstanceTracker
from gateway.metrics import GatewayMetrics
from gateway.queue import Waiter, WaitQueue
from gateway.upstream import Upstream
from policies import ConstantBackoff, RequestInfo
from policies.least_sse import LeastSSE
from registry.base import InstanceRecord


class PlainVllmPrefill(Upstream):
    """A prefill without pdgate's batch endpoint: 404 there, normal answers otherwise."""

    def __init__(self) -> None:
        self.batch_calls = 0
        self.single_calls = 0

    async def prefill(self, base_url: str, body: dict[str, Any], **kw: Any) -> dict[str, Any]:
        self.single_calls += 1
        await asyncio.sleep(0.01)
        return {"choices": [{"text": "x"}], "kv_transfer_params": {"remote_request_id": "r"}}

    async def prefill_batch(
        self, base_url: str, bodies: list[dict[str, Any]], **kw: Any
    ) -> AsyncIterator[tuple[int, int, dict[str, Any]]]:
        self.batch_calls += 1
        raise UpstreamStatus(base_url + "/v1/completions/batch", 404, b"{}")
        yield  # pragma: no cover - makes this an async generator


def waiter(i: int) -> Waiter:
    info = RequestInfo(model="m", group=None, prompt=f"p{i}", prompt_chars=2, max_tokens=1)
    return Waiter(
        info=info,
        body={},
        request_id=str(i),
        deadline=time.monotonic() + 5,
        future=asyncio.get_running_loop().create_future(),
    )


def forwarder(
    upstream: Upstream,
    options: ForwardingOptions,
    *,
    capacity: int = 1,
    order: QueueOrder = QueueOrder.EDF,
) -> tuple[PrefillForwarder, InstanceTracker, GatewayMetrics]:
    """A forwarder for one prefill ``p`` of `capacity` slots behind `upstream`."""
    tracker = InstanceTracker()
    tracker.update_membership(
        {
            "p": InstanceRecord(
                id="p", role=Role.PREFILL, url="http://p", model="m", capacity=capacity
            )
        }
    )
    metrics = GatewayMetrics(tracker.totals, lambda: 0)
    fwd = PrefillForwarder(
        "m",
        None,
        WaitQueue(100, order),
        tracker,
        upstream,
        LeastSSE(),
        ConstantBackoff(0.01),
        metrics,
        None,
        options,
    )
    return fwd, tracker, metrics


async def test_prefill_without_batch_endpoint_falls_back_to_single_calls() -> None:
    upstream = PlainVllmPrefill()
    fwd, tracker, _ = forwarder(
        upstream,
        ForwardingOptions(batch_forwarding=True, batch_endpoint=True, client_error=client_error),
        capacity=8,
        order=QueueOrder.FIFO,
    )
    for round_no in range(2):
        waiters = [waiter(i) for i in range(4)]
        grants = await asyncio.gather(*(fwd.acquire(w) for w in waiters))
        assert [g.instance.id for g in grants] == ["p"] * 4
        for g in grants:
            g.stream.release()
            g.inflight.release()
        # Tried once, then remembered: the second run goes straight to single calls.
        assert upstream.batch_calls == 1
        assert upstream.single_calls == 4 * (round_no + 1)
    assert tracker.totals() == (0, 0)
    await fwd.close()


class SlowPrefill(PlainVllmPrefill):
    """Every prefill takes `seconds`."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    async def prefill(self, base_url: str, body: dict[str, Any], **kw: Any) -> dict[str, Any]:
        self.single_calls += 1
        await asyncio.sleep(self.seconds)
        return {"choices": [{"text": "x"}], "kv_transfer_params": {"remote_request_id": "r"}}


def short_waiter(chars: int, deadline_s: float) -> Waiter:
    w = waiter(0)
    w.info = RequestInfo(
        model="m", group=None, prompt="x" * chars, prompt_chars=chars, max_tokens=1
    )
    w.deadline = time.monotonic() + deadline_s
    return w


async def test_hopeless_request_is_dropped_without_a_prefill_call() -> None:
    upstream = SlowPrefill(0.05)
    fwd, _, metrics = forwarder(upstream, ForwardingOptions(early_drop=True))
    for _ in range(32):  # recent history: 100 chars took 0.2 s
        fwd.prefill_times.record(100, 0.2)
    began = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="cannot be prefilled"):
        await fwd.acquire(short_waiter(100, 0.1))
    assert time.monotonic() - began < 0.05  # at once, not at its deadline
    assert upstream.single_calls == 0
    assert fwd.queue.peek() is None and fwd.waiting == 0
    assert metrics.registry.get_sample_value("pdgate_early_drops_total") == 1
    # A request with time enough is sent as usual (and its call time recorded).
    grant = await fwd.acquire(short_waiter(100, 1.0))
    grant.stream.release()
    grant.inflight.release()
    assert upstream.single_calls == 1 and len(fwd.prefill_times) == 33
    await fwd.close()


async def test_without_early_drop_the_same_request_is_sent_and_expires() -> None:
    upstream = SlowPrefill(0.5)
    fwd, _, metrics = forwarder(upstream, ForwardingOptions(early_drop=False))
    for _ in range(32):  # the same history: it would be dropped with early drop on
        fwd.prefill_times.record(100, 0.2)
    with pytest.raises(DeadlineExceeded, match="before its TTFT deadline"):
        await fwd.acquire(short_waiter(100, 0.1))
    assert upstream.single_calls == 1
    assert metrics.registry.get_sample_value("pdgate_early_drops_total") == 0
    await fwd.close()
