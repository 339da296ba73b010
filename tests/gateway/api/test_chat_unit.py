"""Chat requests take the same queue, forwarder and dispatcher as completions, against
`MockUpstream`: both legs go to the chat path, and a batch-forwarded run of mixed APIs becomes
one batch call per API (each API has its own batch endpoint on the shims)."""

from __future__ import annotations

import asyncio
import time

from pdgate.config.openai_api import Api
from pdgate.config.wire import CHAT_PATH, COMPLETIONS_PATH
from pdgate.gateway.upstream.mock import MockUpstream
from tests.gateway._fakes import (
    FakeCluster,
    batching_forwarder,
    dispatcher,
    eventually,
    info,
    tracker_for,
    waiter,
)
from tests.gateway._fakes import (
    place as both_legs,
)


async def test_a_mixed_run_is_one_batch_call_per_api() -> None:
    upstream = MockUpstream(FakeCluster(prefill_delay_s=0.01))
    tracker = tracker_for([8])
    fwd, _, background = batching_forwarder(upstream, tracker)
    waiters = [waiter(i) for i in range(6)]
    for w in waiters[::2]:
        w.path = CHAT_PATH
    grants = await asyncio.gather(*(fwd.acquire(w) for w in waiters))
    batches = sorted((b[0].path, len(b)) for b in upstream.batches)
    assert batches == [(CHAT_PATH, 3), (COMPLETIONS_PATH, 3)]
    paths = sorted(c.path for c in upstream.calls if c.leg == "prefill")
    assert paths == [CHAT_PATH] * 3 + [COMPLETIONS_PATH] * 3
    for g in grants:
        g.close()
    await eventually(lambda: tracker.totals() == (0, 0))
    await fwd.close()
    await background.aclose()


async def test_both_legs_of_a_chat_go_to_the_chat_path() -> None:
    upstream = MockUpstream(FakeCluster())
    tracker = tracker_for([2], [4])
    d, _ = dispatcher(upstream, tracker)
    for api in (Api.CHAT, Api.COMPLETIONS):
        placement = await both_legs(
            d,
            info(),
            {"model": "m", "messages": [], "max_tokens": 4, "stream": True},
            request_id=f"r-{api.value}",
            deadline=time.monotonic() + 2,
            api=api,
        )
        legs = {c.leg: c for c in upstream.calls if c.request_id == f"r-{api.value}"}
        assert legs["prefill"].path == legs["decode"].path == api.path
        assert legs["prefill"].body is not None and legs["prefill"].body["max_tokens"] == 1
        placement.close()
    await eventually(lambda: tracker.totals() == (0, 0))
    await d.close()
