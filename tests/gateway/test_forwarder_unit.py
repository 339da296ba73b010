"""The forwarder against a test double of its upstream seam (gateway/upstream.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from config import QueueOrder, Role
from gateway.dispatch import client_error
from gateway.errors import UpstreamStatus
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


async def test_prefill_without_batch_endpoint_falls_back_to_single_calls() -> None:
    tracker = InstanceTracker()
    tracker.update_membership(
        {"p": InstanceRecord(id="p", role=Role.PREFILL, url="http://p", model="m", capacity=8)}
    )
    upstream = PlainVllmPrefill()
    fwd = PrefillForwarder(
        "m",
        None,
        WaitQueue(100, QueueOrder.FIFO),
        tracker,
        upstream,
        LeastSSE(),
        ConstantBackoff(0.01),
        GatewayMetrics(tracker.totals, lambda: 0),
        None,
        ForwardingOptions(batch_forwarding=True, batch_endpoint=True, client_error=client_error),
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
