"""Token-work load: prompt work credited per prefill at dispatch (estimated tokens of the part
the prefill does not hold in cache), corrected by what the prefills' answers report, and the
prefill shim's own count on /load."""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import time
from dataclasses import replace

import httpx
import pytest

from pdgate.config import QueueOrder, Role
from pdgate.config.aio import Background, ConstantBackoff
from pdgate.gateway.instances.affinity import PrefixIndex
from pdgate.gateway.instances.health import Ejector, RetryBudget
from pdgate.gateway.instances.tracker import InstanceTracker
from pdgate.gateway.observe.metrics import GatewayMetrics
from pdgate.gateway.placement.decode_attempt import client_error
from pdgate.gateway.placement.drain import DecodeWaits
from pdgate.gateway.placement.forwarder import PrefillForwarder
from pdgate.gateway.placement.leases import Fleet
from pdgate.gateway.placement.prefill_time import TokenRatio, uncached_chars
from pdgate.gateway.placement.queue import Waiter, WaitQueue
from pdgate.gateway.placement.shared import ForwardingOptions, Shared
from pdgate.gateway.upstream.mock import Call, MockUpstream, Reply
from pdgate.policies import load_policy
from pdgate.registry.fleet import LocalFleet
from tests._cluster import ThreadedCluster, shim_load
from tests.gateway._fakes import eventually, tracker_for, waiter


def build(
    tracker: InstanceTracker,
    upstream: MockUpstream,
    policy: str,
    index: PrefixIndex | None,
    *,
    batch: bool = False,
) -> tuple[PrefillForwarder, Background]:
    """A forwarder of model "m" with `policy` (and the affinity `index` it may need)."""
    metrics = GatewayMetrics(tracker.totals, lambda: 0)
    background = Background("test")
    fwd = PrefillForwarder(
        "m",
        None,
        WaitQueue(100, QueueOrder.FIFO),
        load_policy(policy),
        Shared(
            tracker,
            upstream,
            ConstantBackoff(0.01),
            metrics,
            index,
            ForwardingOptions(batch_forwarding=batch, client_error=client_error),
            background,
            Fleet(LocalFleet("test"), tracker),
            Ejector(tracker, metrics),
            RetryBudget(),
            DecodeWaits(tracker),
        ),
    )
    return fwd, background


class TwoCharsATokenPrefill:
    """Prefills that report 1 token per 2 characters; each call waits for `gate`."""

    def __init__(self, cached_share: float = 0.0) -> None:
        self.gate = asyncio.Event()
        self.cached_share = cached_share

    async def __call__(self, call: Call) -> Reply:
        await self.gate.wait()
        assert call.body is not None
        tokens = len(call.body["prompt"]) // 2
        usage = {
            "prompt_tokens": tokens,
            "completion_tokens": 1,
            "total_tokens": tokens + 1,
            "prompt_tokens_details": {"cached_tokens": int(tokens * self.cached_share)},
        }
        params = {"remote_host": "p", "remote_port": 80, "remote_request_id": call.kv_id}
        return Reply(
            json={"choices": [{"text": "x"}], "usage": usage, "kv_transfer_params": params}
        )


def credited(tracker: InstanceTracker, instance_id: str = "p0") -> int:
    return next(c.inflight_tokens for c in tracker.loads(Role.PREFILL, "m") if c.id == instance_id)


def prompt_waiter(i: int, prompt: str) -> Waiter:
    w = waiter(i)
    w.body = {"prompt": prompt}
    w.info = replace(w.info, prompt=prompt, prompt_chars=len(prompt))
    return w


async def test_work_is_credited_at_dispatch_and_learns_tokens_from_the_answers() -> None:
    prefill = TwoCharsATokenPrefill()
    tracker = tracker_for([4])
    fwd, background = build(tracker, MockUpstream(prefill), "least_tokens", None)
    prompt = "ab" * 200  # 400 characters, 200 tokens as the prefill counts them
    pending = asyncio.ensure_future(fwd.acquire(prompt_waiter(0, prompt)))
    await eventually(lambda: credited(tracker) > 0)
    # Before any answer: the usual four characters a token.
    assert credited(tracker) == 100
    prefill.gate.set()
    (await pending).close()
    assert credited(tracker) == 0  # the answer ends the work
    for i in range(60):
        (await fwd.acquire(prompt_waiter(i + 1, prompt))).close()
    # The answers said two characters a token: the estimate has moved there.
    assert 0.45 < fwd.token_ratio.ratio <= 0.5
    prefill.gate.clear()
    pending = asyncio.ensure_future(fwd.acquire(prompt_waiter(99, prompt)))
    await eventually(lambda: credited(tracker) > 0)
    assert 180 <= credited(tracker) <= 200
    prefill.gate.set()
    (await pending).close()
    await eventually(lambda: tracker.totals() == (0, 0) and credited(tracker) == 0)
    await fwd.close()
    await background.aclose()


async def test_the_part_the_prefill_holds_in_cache_is_not_credited() -> None:
    prefill = TwoCharsATokenPrefill()
    tracker = tracker_for([4])
    index = PrefixIndex(block_chars=64)
    fwd, background = build(tracker, MockUpstream(prefill), "affinity_sse", index)
    prompt = "".join(random.Random(1).choice("abcdefgh ") for _ in range(1024))
    index.record_hashes(index.hashes(prompt[:512]), "p0")  # p0 computed the first half recently
    pending = asyncio.ensure_future(fwd.acquire(prompt_waiter(0, prompt)))
    await eventually(lambda: credited(tracker) > 0)
    assert credited(tracker) == 512 // 4  # only the uncached half, at 4 characters a token
    prefill.gate.set()
    (await pending).close()
    await eventually(lambda: tracker.totals() == (0, 0))
    await fwd.close()
    await background.aclose()


async def test_expected_ends_of_calls_are_tracked_and_forgotten(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1000.0]  # the tracker's clock, held still so that each figure is exact
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    tracker = tracker_for([2])
    assert tracker.soonest_end_s("p0") is None
    slow = tracker.work("p0", 10, expected_s=5.0)
    fast = tracker.work("p0", 10, expected_s=0.5)
    untimed = tracker.work("p0", 10)
    assert tracker.soonest_end_s("p0") == 0.5
    now[0] += 0.2
    assert tracker.soonest_end_s("p0") == pytest.approx(0.3)
    fast.release()
    assert tracker.soonest_end_s("p0") == pytest.approx(4.8)
    now[0] += 10  # past its expected end: due now, not negative
    assert tracker.soonest_end_s("p0") == 0.0
    slow.release()
    untimed.release()
    assert tracker.soonest_end_s("p0") is None
    assert credited(tracker) == 0
    tracker.rejected("p0")
    assert tracker.busy_for_s("p0") == pytest.approx(tracker.reject_hold_s)
    now[0] += tracker.reject_hold_s
    assert tracker.busy_for_s("p0") == 0.0


def test_token_ratio_and_uncached_characters_from_usage() -> None:
    ratio = TokenRatio(initial=0.25, alpha=0.5)
    ratio.observe(100, {"prompt_tokens": 50})
    assert ratio.ratio == pytest.approx(0.375)
    for bad in (None, {}, {"prompt_tokens": "many"}, {"prompt_tokens": 0}, [1]):
        ratio.observe(100, bad)
    assert ratio.ratio == pytest.approx(0.375)
    assert ratio.tokens(0) == 0 and ratio.tokens(1) == 1 and ratio.tokens(800) == 300
    with pytest.raises(ValueError, match="alpha"):
        TokenRatio(alpha=0)
    usage = {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 75}}
    assert uncached_chars(400, usage) == 100
    assert uncached_chars(400, {"prompt_tokens": 100}) == 400
    assert uncached_chars(400, None) == 400
    assert uncached_chars(400, {"prompt_tokens": 10, "prompt_tokens_details": {}}) == 400


def test_the_prefill_shim_reports_the_prompt_tokens_it_is_computing() -> None:
    shim = {"capacity": 2, "sim_prefix_cache_blocks": 0}
    with ThreadedCluster(prefills=1, decodes=1, shim=shim) as c:
        assert c.info is not None
        prefill = c.info.prefill_urls[0]
        assert shim_load(prefill)["prompt_tokens_inflight"] == 0
        # About 20k tokens: the sim's prefill of it takes over a second.
        prompt = " ab" * 20_000
        body = {"model": "sim-llama-3.1-8b", "prompt": prompt, "max_tokens": 1}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(httpx.post, c.url + "/v1/completions", json=body, timeout=30)
            seen: list[int] = []

            def computing() -> bool:
                seen.append(shim_load(prefill)["prompt_tokens_inflight"])
                return seen[-1] > 0

            c.wait_for(computing, what="the prefill to report its prompt tokens")
            assert 19_000 <= seen[-1] <= 21_000
            resp = answer.result()
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["prompt_tokens"] == seen[-1]
        c.wait_for(lambda: shim_load(prefill)["prompt_tokens_inflight"] == 0)
