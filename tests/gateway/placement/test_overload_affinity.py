"""Affinity that pays under overload: the forwarder holds a queued request for the busy
prefill that holds its prefix when that is expected to finish sooner than a free prefill
computing the whole prompt (policies/completion.py), lets the requests behind it use the free
prefill meanwhile, and never holds one longer than its cache hit would save."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import replace

import pytest

from pdgate.gateway.instances.affinity import PrefixIndex
from pdgate.gateway.instances.tracker import InstanceTracker, Lease
from pdgate.gateway.placement.queue import Waiter
from pdgate.gateway.upstream.mock import MockUpstream
from tests.gateway._fakes import FakeCluster, eventually, tracker_for, waiter
from tests.gateway.placement.test_token_work import build

PROMPT = "".join(random.Random(7).choice("abcdefgh ") for _ in range(1024))
OTHER = "".join(random.Random(8).choice("abcdefgh ") for _ in range(1024))


class Setup:
    """Two prefills: p0 (one slot) recently prefilled PROMPT and is busy with a call expected
    to end in `p0_busy_s`; p1 is free. Recent prefills computed 1 ms per character."""

    def __init__(
        self, policy: str, p0_busy_s: float, *, batch: bool = False, p1_slots: int = 1
    ) -> None:
        self.upstream = MockUpstream(FakeCluster())
        self.tracker: InstanceTracker = tracker_for([1, p1_slots])
        self.index = PrefixIndex(block_chars=64)
        self.index.record_hashes(self.index.hashes(PROMPT), "p0")
        self.fwd, self.background = build(
            self.tracker, self.upstream, policy, self.index, batch=batch
        )
        for _ in range(16):
            self.fwd.compute_times.record(1024, 1.024)
        # Another request occupies p0's slot and computes there.
        self.p0_slot: Lease = self.tracker.begin("p0")
        self.p0_work: Lease = self.tracker.work("p0", 256, expected_s=p0_busy_s)

    def free_p0(self) -> None:
        self.p0_work.release()
        self.p0_slot.release()

    def prefill_calls(self) -> list[str]:
        return [c.url for c in self.upstream.calls if c.leg == "prefill"]

    async def close(self) -> None:
        self.free_p0()
        await eventually(lambda: self.tracker.totals() == (0, 0))
        await self.fwd.close()
        await self.background.aclose()


def request(i: int, prompt: str, deadline_s: float = 5.0) -> Waiter:
    w = waiter(i, deadline_s=deadline_s)
    w.info = replace(w.info, prompt=prompt, prompt_chars=len(prompt))
    return w


async def test_a_request_waits_for_the_prefill_holding_its_prefix_when_that_is_sooner() -> None:
    # p0 frees in 0.3 s and then computes almost nothing; p1 would compute 1 s.
    s = Setup("affinity_hold", p0_busy_s=0.3)
    head = request(0, PROMPT)
    pending = asyncio.ensure_future(s.fwd.acquire(head))
    await asyncio.sleep(0.1)
    assert s.prefill_calls() == []  # held, although p1 is free
    assert head.held_since is not None
    s.free_p0()
    grant = await asyncio.wait_for(pending, 2)
    assert grant.instance.id == "p0"
    grant.close()
    await s.close()


@pytest.mark.parametrize(
    ("policy", "p0_busy_s", "deadline_s"),
    [
        # p0 busy for another 5 s: computing the whole prompt on p1 (1 s) is sooner.
        ("affinity_hold", 5.0, 5.0),
        # Holding for p0 would end after the request's deadline: the sure slot now.
        ("affinity_hold", 0.3, 0.2),
        # No holder: the old rule, whatever the estimates say (affinity loses its edge).
        ("affinity_sse", 0.3, 5.0),
    ],
    ids=["long-wait", "deadline", "no-holder"],
)
async def test_the_free_prefill_is_taken_at_once_when_holding_does_not_pay(
    policy: str, p0_busy_s: float, deadline_s: float
) -> None:
    s = Setup(policy, p0_busy_s=p0_busy_s)
    grant = await asyncio.wait_for(s.fwd.acquire(request(0, PROMPT, deadline_s)), 1)
    assert grant.instance.id == "p1"
    grant.close()
    await s.close()


async def test_requests_behind_a_held_head_use_the_free_prefill() -> None:
    s = Setup("affinity_hold", p0_busy_s=0.5)
    head = request(0, PROMPT)
    held = asyncio.ensure_future(s.fwd.acquire(head))
    await asyncio.sleep(0.05)
    # No prefix anywhere: nothing to wait for, it passes the held head.
    behind = await asyncio.wait_for(s.fwd.acquire(request(1, OTHER)), 1)
    assert behind.instance.id == "p1"
    assert not held.done()
    behind.close()
    s.free_p0()
    grant = await asyncio.wait_for(held, 2)
    assert grant.instance.id == "p0"
    grant.close()
    await s.close()


async def test_requests_held_for_the_same_prefill_count_each_others_work() -> None:
    # Three requests share p0's first 768 characters; each has 256 of its own to compute
    # there (0.256 s), against 1.024 s on p1. p0 frees in 0.3 s, then serves one at a time.
    s = Setup("affinity_hold", p0_busy_s=0.3)
    tails = ["".join(random.Random(i).choice("ijklmnop ") for _ in range(256)) for i in range(3)]
    first, second, third = (request(i, PROMPT[:768] + tail) for i, tail in enumerate(tails))
    held = [asyncio.ensure_future(s.fwd.acquire(w)) for w in (first, second)]
    await asyncio.sleep(0.05)
    assert s.prefill_calls() == []
    # 0.3 + 2 x 0.256 waiting, + 0.256: no sooner than 1.024 s on p1.
    grant = await asyncio.wait_for(s.fwd.acquire(third), 1)
    assert grant.instance.id == "p1"
    assert not any(t.done() for t in held)
    grant.close()
    s.free_p0()
    for task in held:
        (await asyncio.wait_for(task, 2)).close()
    await s.close()


async def test_a_prefill_that_does_not_free_holds_a_request_no_longer_than_the_saving() -> None:
    # Expected to free in 0.1 s, it frees only after 3 s: the request gives up waiting once
    # it has waited as long as the cache hit was to save (about 0.9 s of the 1 s prefill).
    s = Setup("affinity_hold", p0_busy_s=0.1)
    began = time.monotonic()
    frees = asyncio.get_running_loop().call_later(3.0, s.free_p0)
    grant = await s.fwd.acquire(request(0, PROMPT))
    waited = time.monotonic() - began
    assert grant.instance.id == "p1"  # before p0 freed
    assert waited > 0.7  # it held the request meanwhile
    frees.cancel()
    grant.close()
    await s.close()


@pytest.mark.parametrize("policy", ["affinity_hold", "affinity_sse"])
async def test_batch_forwarding_skips_requests_held_for_another_prefill(policy: str) -> None:
    s = Setup(policy, p0_busy_s=0.5, batch=True, p1_slots=2)
    # p1 has two free slots; the head has no prefix anywhere, the next one's is on p0.
    first = asyncio.ensure_future(s.fwd.acquire(request(0, OTHER)))
    second = asyncio.ensure_future(s.fwd.acquire(request(1, PROMPT)))
    done, _ = await asyncio.wait({first, second}, timeout=0.3)
    places = {t.result().instance.id for t in done}
    if policy == "affinity_hold":
        assert done == {first} and places == {"p1"}
    else:
        assert done == {first, second} and places == {"p1"}
    s.free_p0()
    for task in (first, second):
        (await asyncio.wait_for(task, 2)).close()
    await s.close()
