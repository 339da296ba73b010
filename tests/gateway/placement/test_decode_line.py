"""Waiting for a decode slot: one line per model and group, resumed streams first, then by
deadline; one waiter woken per freed slot; every place given back on every path.

The decode legs are the gateway's own (`DecodeLegs`, `DecodeAttempts`), over the in-process
upstream fake; a decode of one slot is held by a placed stream, and freeing that stream's
slot is what wakes the line. The waiters' back-off is 30 s, so only a freed slot wakes one
within the test. Each wake is one ranking of the decodes: the ranker counts them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import pytest

from pdgate.config import GatewaySettings
from pdgate.config.aio import ConstantBackoff
from pdgate.config.tracing import Tracing
from pdgate.gateway.admission.retry_after import RetryAfter
from pdgate.gateway.errors import DeadlineExceeded
from pdgate.gateway.instances.health import Ejector, RetryBudget
from pdgate.gateway.instances.tracker import InstanceTracker, Lease
from pdgate.gateway.observe.metrics import GatewayMetrics
from pdgate.gateway.placement.decode_attempt import DecodeAttempts
from pdgate.gateway.placement.decode_leg import DecodeLegs
from pdgate.gateway.placement.drain import DecodeWaits
from pdgate.gateway.placement.placed import LegRequest
from pdgate.gateway.upstream.mock import MockUpstream
from pdgate.policies import load_policy
from pdgate.policies.base import Candidates, InstanceLoad, RequestInfo
from tests.gateway._fakes import FakeCluster, decode_fleet, info


class _Counting:
    """The decode policy, counting its rankings (one per waiter's try)."""

    def __init__(self) -> None:
        self._policy = load_policy("least_loaded")
        self.name = self._policy.name
        self.needs = self._policy.needs
        self.hold = self._policy.hold
        self.ranked: list[str] = []  # the request id of each ranking, in order

    def describe(self) -> dict[str, object]:
        return self._policy.describe()

    def rank(self, request: RequestInfo, candidates: Candidates) -> list[InstanceLoad]:
        self.ranked.append(request.prompt)
        return self._policy.rank(request, candidates)


class _Line:
    def __init__(self) -> None:
        self.tracker: InstanceTracker = decode_fleet(decodes=(1,))
        self.waits = DecodeWaits(self.tracker)
        self.policy = _Counting()
        metrics = GatewayMetrics(self.tracker.totals, lambda: 0)
        self.upstream = MockUpstream(FakeCluster(text="x"))
        attempts = DecodeAttempts(
            self.tracker,
            self.upstream,
            metrics.decode_attempts,
            Ejector(self.tracker, metrics),
            Tracing.off(),
        )
        self.legs = DecodeLegs(
            GatewaySettings(),
            self.tracker,
            attempts,
            self.policy,  # type: ignore[arg-type]
            waits=self.waits,
            backoff=ConstantBackoff(30.0),
            budget=RetryBudget(),
            metrics=metrics,
            retry_after=RetryAfter(),
        )

    async def place(
        self, name: str, deadline_s: float, *, resumed: bool = False
    ) -> Sequence[Lease]:
        req = LegRequest(info(name), name, time.monotonic() + deadline_s, None, resumed)
        body: dict[str, Any] = {"model": "m", "prompt": name, "kv_transfer_params": {}}
        _, stream, leases = await self.legs.place(req, body, "/v1/completions")
        stream.close()
        return leases

    def start(self, name: str, deadline_s: float) -> asyncio.Task[Sequence[Lease]]:
        return asyncio.create_task(self.place(name, deadline_s))

    def released(self) -> bool:
        """Nobody in the line, no count left on the decode."""
        return self.waits.total() == 0 and self.tracker.totals() == (0, 0)

    async def settle(self) -> None:
        for _ in range(20):
            await asyncio.sleep(0)


async def _held_line() -> tuple[_Line, Sequence[Lease]]:
    """A line whose one decode slot a placed stream holds: whoever comes next waits."""
    line = _Line()
    return line, await line.place("holder", 30)


def _free(leases: Sequence[Lease]) -> None:
    for lease in leases:
        lease.release()


async def test_each_freed_slot_wakes_one_waiter_resumed_first_then_by_deadline() -> None:
    line, held = await _held_line()
    later = line.start("later", 20)
    sooner = line.start("sooner", 10)
    resumed = asyncio.create_task(line.place("resumed", 25, resumed=True))
    await line.settle()
    assert line.waits.waiting("m", None) == 3
    assert sorted(line.policy.ranked) == ["holder", "later", "resumed", "sooner"]
    order = []
    for _ in range(3):
        line.policy.ranked.clear()
        _free(held)
        done, _ = await asyncio.wait(
            [t for t in (later, sooner, resumed) if not t.done()],
            return_when=asyncio.FIRST_COMPLETED,
        )
        await line.settle()
        # One freed slot, one waiter woken: the decodes were ranked once, for it.
        assert len(done) == 1 and len(line.policy.ranked) == 1
        task = done.pop()
        held = task.result()
        order.append(line.policy.ranked[0])
    assert order == ["resumed", "sooner", "later"]
    _free(held)
    assert line.released()


async def test_a_newcomer_waits_behind_the_line_instead_of_taking_the_freed_slot() -> None:
    line, held = await _held_line()
    first = line.start("first", 10)
    await line.settle()
    _free(held)  # wakes `first`; a request arriving now must not take its slot
    newcomer = line.start("newcomer", 20)
    held = await first
    await line.settle()
    assert not newcomer.done() and line.waits.waiting("m", None) == 1
    _free(held)
    _free(await newcomer)
    assert line.released()


async def test_a_woken_waiter_that_is_cancelled_passes_its_slot_on() -> None:
    line, held = await _held_line()
    first = line.start("first", 10)
    second = line.start("second", 20)
    await line.settle()
    _free(held)  # wakes `first` ...
    first.cancel()  # ... which leaves before its try: `second` gets the slot
    with pytest.raises(asyncio.CancelledError):
        await first
    _free(await asyncio.wait_for(second, 5))
    assert line.released()


async def test_a_waiter_leaves_the_line_once_at_its_deadline_or_cancelled() -> None:
    line, held = await _held_line()
    short = line.start("short", 0.2)
    cancelled = line.start("cancelled", 20)
    stays = line.start("stays", 20)
    await line.settle()
    assert line.waits.waiting("m", None) == 3
    with pytest.raises(DeadlineExceeded):
        await short
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert line.waits.waiting("m", None) == 1  # each left once; the last still waits
    _free(held)
    _free(await asyncio.wait_for(stays, 5))
    assert line.released()


async def test_a_decode_that_joins_wakes_as_many_waiters_as_it_has_slots() -> None:
    line, held = await _held_line()
    waiting = [line.start(f"w{i}", 10 + i) for i in range(3)]
    await line.settle()
    assert line.waits.waiting("m", None) == 3
    records = dict(line.tracker.records())
    joined = dataclasses.replace(records["d0"], id="d1", url="http://d1", capacity=2)
    line.tracker.update_membership({**records, "d1": joined})
    # Its two slots go to the first two in the line; the third still waits.
    placed = await asyncio.wait_for(asyncio.gather(waiting[0], waiting[1]), 5)
    await line.settle()
    assert not waiting[2].done() and line.waits.waiting("m", None) == 1
    for leases in placed:
        _free(leases)
    _free(held)
    _free(await asyncio.wait_for(waiting[2], 5))
    assert line.released()
