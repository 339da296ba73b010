"""Temporal disaggregation at the shim: prompts enter in prefill phases, when the running
decodes' saved TPOT covers them, and never later than their TTFT allows."""

from __future__ import annotations

import asyncio

import pytest

from pdgate.engine_shim._phases import PhaseGate


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _gate(clock: Clock, *, tpot: float = 0.1, ttft: float = 2.0) -> PhaseGate:
    # 1 ms a prompt token, to start with.
    return PhaseGate(tpot_slo_s=tpot, ttft_slo_s=ttft, seconds_per_token=1e-3, clock=clock)


async def test_with_nothing_decoding_a_prompt_goes_in_at_once_and_its_token_ends_the_phase() -> (
    None
):
    clock = Clock()
    gate = _gate(clock)
    await gate.admit(1, 100)
    assert gate.phase == "prefill" and gate.switches == 1
    clock.now += 0.1
    gate.token(1)  # its first token: the prefill phase is over
    assert gate.phase == "decode"
    assert gate.load()["saved_tpot_s"] == pytest.approx(0.1)  # 1 token x 0.1 - 0 s


async def test_a_prompt_waits_while_the_decodes_cannot_afford_it() -> None:
    clock = Clock()
    gate = _gate(clock, tpot=0.05, ttft=10.0)
    await gate.admit(1, 10)
    gate.token(1)  # decoding now, saved TPOT 0.05 s
    waiting = asyncio.create_task(gate.admit(2, 200))  # needs about 0.2 s of prefill
    await asyncio.sleep(0)
    assert not waiting.done()
    assert gate.load()["pending_prefills"] == 1 and gate.phase == "decode"
    for _ in range(3):  # tokens faster than the SLO: 3 more, in no time, save 0.15 s more
        gate.token(1)
    await asyncio.sleep(0)
    assert waiting.done() and gate.phase == "prefill"  # 4 x 0.05 = 0.2 s covers it
    assert gate.load()["pending_prefills"] == 0


async def test_no_prompt_waits_past_what_its_ttft_allows() -> None:
    """Decodes that never save enough: the prompt goes in when it could still just make
    its TTFT (the SLO less its predicted prefill), not later."""
    clock = Clock()
    gate = _gate(clock, tpot=0.01, ttft=0.3)
    await gate.admit(1, 10)
    gate.token(1)
    clock.now += 5.0  # far behind its TPOT: nothing saved
    waiting = asyncio.create_task(gate.admit(2, 100))  # 0.1 s predicted
    await asyncio.sleep(0)  # it arrived and waits
    # What the gate holds when the prompt's TTFT (0.3 s) has passed, on the loop's clock
    # as the gate's timer: timers run in the order they are due, whatever the load.
    loop = asyncio.get_running_loop()
    at_ttft: asyncio.Future[int] = loop.create_future()
    loop.call_later(0.3, lambda: at_ttft.set_result(gate.load()["pending_prefills"]))
    await asyncio.sleep(0.1)
    assert not waiting.done()  # not let in at once
    clock.now += 0.3  # the gate's timer runs on the loop's clock; the gate reads this one
    await waiting
    assert gate.phase == "prefill"
    assert await at_ttft == 0  # let in by then: at ttft - predicted = 0.2 s


async def test_a_prompt_given_up_while_waiting_leaves_the_gate() -> None:
    clock = Clock()
    gate = _gate(clock, tpot=0.01, ttft=60.0)
    await gate.admit(1, 10)
    gate.token(1)
    clock.now += 5.0
    waiting = asyncio.create_task(gate.admit(2, 100))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert gate.load()["pending_prefills"] == 0
    gate.finished(1)
    gate.finished(1)  # idempotent
    assert gate.saved_tpot_s() is None


async def test_the_prefill_estimate_is_learned_from_the_prompts_let_in() -> None:
    clock = Clock()
    gate = _gate(clock)
    for seq in range(20):
        await gate.admit(seq, 1000)
        clock.now += 0.5  # 0.5 ms a token, half the initial guess
        gate.token(seq)
        gate.finished(seq)
    waiting = [asyncio.create_task(gate.admit(100, 1000))]
    await asyncio.sleep(0)
    assert waiting[0].done()  # nothing decodes: straight in
    clock.now += 0.5
    gate.token(100)
    slow = asyncio.create_task(gate.admit(101, 1000))
    await asyncio.sleep(0)
    assert gate.pending_prefill_s() == pytest.approx(0.5, rel=0.05)
    slow.cancel()
    await asyncio.gather(slow, return_exceptions=True)


async def test_a_prompt_with_less_time_left_goes_in_sooner() -> None:
    """The gateway's TTFT-left header shortens one prompt's bound below the gate's SLO."""
    clock = Clock()
    gate = _gate(clock, tpot=0.01, ttft=60.0)
    await gate.admit(1, 10)
    gate.token(1)
    clock.now += 5.0  # nothing saved
    waiting = asyncio.create_task(gate.admit(2, 100, ttft_left_s=0.3))  # ~0.08 s of prefill
    await asyncio.sleep(0.05)
    assert not waiting.done()
    clock.now += 0.3
    await asyncio.wait_for(waiting, 1.0)  # by its own bound, not the gate's 60 s
    assert gate.phase == "prefill"


async def test_a_sequence_with_a_tighter_tpot_slo_saves_less() -> None:
    """Its gateway's TPOT SLO counts for that sequence alone in the saved-TPOT mean."""
    clock = Clock()
    gate = _gate(clock, tpot=0.1)
    await gate.admit(1, 10)
    await gate.admit(2, 10, tpot_slo_s=0.02)
    gate.token(1)
    gate.token(2)
    clock.now += 0.01
    # (1 x 0.1 - 0.01 + 1 x 0.02 - 0.01) / 2
    assert gate.saved_tpot_s() == pytest.approx(0.05)
    gate.finished(2)
    assert gate.saved_tpot_s() == pytest.approx(0.09)
    gate.finished(1)
    assert gate.saved_tpot_s() is None
