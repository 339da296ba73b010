"""Temporal disaggregation at one instance (EcoServe section 4.2.1): prefill and decode
phases in turn, gated at the shim, so prompts do not slow every running decode step.

An instance in a **prefill phase** lets the prompts it is sent into the engine at once; the
phase ends when every prompt it let in has its first token. In a **decode phase** only the
running sequences step: a prompt that arrives waits here, and the waiting prompts go into
the engine together when the next prefill phase starts. The switch comes when the running
decodes can afford it: their mean *saved TPOT*

    L x tpot_slo_s - (now - first token time)      (L: tokens generated so far)

covers the predicted prefill time of the waiting prompts (EcoServe's TPOT constraint), or
when nothing decodes, or at the latest when a waiting prompt could still make its TTFT
(`ttft_slo_s`, or less when its gateway says how long it has left, less the predicted
prefill time): no prompt waits longer than one decode phase. A sequence whose gateway sent
a tighter TPOT SLO is held to it in the saved-TPOT mean. The gate only decides *when*
a prompt enters the engine, so it works in front of any engine that takes plain requests,
a stock vLLM's included.

Predicted prefill time: seconds per prompt token, learned from the prompts let in (from
their release to their first token, a running mean), times the waiting prompts' tokens.
`load()` is what the shim's ``/load`` and registry record report (the gateway's rolling
activation reads the same state from its own streams).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PhaseGate"]

PREFILL = "prefill"
DECODE = "decode"


@dataclass(slots=True)
class _Waiting:
    tokens: int
    arrived: float
    ttft_s: float  # its TTFT budget: the gate's SLO, or less if its gateway said so
    released: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class PhaseGate:
    def __init__(
        self,
        *,
        tpot_slo_s: float,
        ttft_slo_s: float,
        seconds_per_token: float = 1e-4,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if tpot_slo_s <= 0 or ttft_slo_s <= 0 or seconds_per_token <= 0:
            raise ValueError("the SLOs and the prefill estimate must be positive")
        self._tpot = tpot_slo_s
        self._ttft = ttft_slo_s
        self._per_token = seconds_per_token
        self._clock = clock
        self.phase = DECODE
        self.since = clock()
        self.switches = 0  # prefill phases started
        self._waiting: deque[_Waiting] = deque()
        # Let in during the current prefill phase, no first token yet: id -> (tokens, released)
        self._prefilling: dict[int, tuple[int, float]] = {}
        # Decoding: id -> first token time; with the sums the mean saved TPOT needs in O(1)
        # (`_sum_budget`: L x its TPOT SLO, summed over the decoding sequences).
        self._first: dict[int, float] = {}
        self._tokens: dict[int, int] = {}
        self._slo: dict[int, float] = {}  # a sequence's own TPOT SLO, where tighter
        self._sum_first = 0.0
        self._sum_budget = 0.0
        self._timer: asyncio.TimerHandle | None = None

    # -- a sequence's life -----------------------------------------------------------------

    async def admit(
        self,
        seq: int,
        tokens: int,
        ttft_left_s: float | None = None,
        tpot_slo_s: float | None = None,
    ) -> None:
        """Wait until `seq` (a prompt of `tokens` tokens, `ttft_left_s` left of its TTFT
        and its own TPOT SLO where its gateway said) may enter the engine."""
        if tpot_slo_s is not None:
            self._slo[seq] = min(tpot_slo_s, self._tpot)
        if self.phase == PREFILL or not self._first:
            self._let_in(seq, tokens, self._clock())
            return
        budget = self._ttft if ttft_left_s is None else min(self._ttft, ttft_left_s)
        waiting = _Waiting(tokens, self._clock(), budget)
        self._waiting.append(waiting)
        try:
            self._consider()
            await waiting.released
        except BaseException:
            if waiting in self._waiting:
                self._waiting.remove(waiting)
            self._slo.pop(seq, None)
            raise
        self._let_in(seq, tokens, self._clock())

    def token(self, seq: int) -> None:
        """`seq` generated a token (its first ends its prefill)."""
        now = self._clock()
        started = self._prefilling.pop(seq, None)
        if started is not None:
            tokens, released = started
            if tokens > 0:  # learn the engine's prefill speed, slowly
                self._per_token += 0.2 * ((now - released) / tokens - self._per_token)
            self._first[seq] = now
            self._tokens[seq] = 1
            self._sum_first += now
            self._sum_budget += self._slo.get(seq, self._tpot)
            if not self._prefilling:
                self._start(DECODE, now)
        elif seq in self._tokens:
            self._tokens[seq] += 1
            self._sum_budget += self._slo.get(seq, self._tpot)
        if self._waiting:
            self._consider()

    def finished(self, seq: int) -> None:
        """`seq` left the engine (done, failed or abandoned); idempotent."""
        if self._prefilling.pop(seq, None) is not None and not self._prefilling:
            self._start(DECODE, self._clock())
        first = self._first.pop(seq, None)
        slo = self._slo.pop(seq, self._tpot)
        if first is not None:
            self._sum_first -= first
            self._sum_budget -= self._tokens.pop(seq) * slo
            if not self._first:  # no rounding left over from the sums
                self._sum_first = self._sum_budget = 0.0
        if self._waiting:
            self._consider()

    # -- the decision ----------------------------------------------------------------------

    def saved_tpot_s(self, now: float | None = None) -> float | None:
        """The decoding sequences' mean saved TPOT (None: none decodes)."""
        n = len(self._first)
        if not n:
            return None
        now = self._clock() if now is None else now
        return (self._sum_budget - n * now + self._sum_first) / n

    def pending_prefill_s(self) -> float:
        """Predicted prefill time of the prompts waiting here."""
        return self._per_token * sum(w.tokens for w in self._waiting)

    def _consider(self) -> None:
        if not self._waiting or self.phase == PREFILL:
            return
        now = self._clock()
        needed = self.pending_prefill_s()
        saved = self.saved_tpot_s(now)
        # The first to run out of time: its wait plus the whole pending prefill fits its TTFT.
        latest = min(w.arrived + max(0.0, w.ttft_s - needed) for w in self._waiting)
        if saved is None or saved >= needed or now >= latest:
            self._release(now)
            return
        if self._timer is None:  # the oldest prompt's last moment, unless a token comes first
            loop = asyncio.get_running_loop()
            self._timer = loop.call_at(loop.time() + (latest - now), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._consider()

    def _release(self, now: float) -> None:
        self._start(PREFILL, now)
        while self._waiting:
            waiting = self._waiting.popleft()
            if not waiting.released.done():
                waiting.released.set_result(None)

    def _let_in(self, seq: int, tokens: int, now: float) -> None:
        if self.phase != PREFILL:
            self._start(PREFILL, now)
        self._prefilling[seq] = (tokens, now)

    def _start(self, phase: str, now: float) -> None:
        if phase == self.phase:
            return
        if phase == PREFILL:
            self.switches += 1
        self.phase = phase
        self.since = now
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def load(self) -> dict[str, Any]:
        now = self._clock()
        saved = self.saved_tpot_s(now)
        return {
            "phase": self.phase,
            "phase_s": round(now - self.since, 6),
            "phase_switches": self.switches,
            "pending_prefills": len(self._waiting),
            "pending_prefill_s": round(self.pending_prefill_s(), 6),
            "prefilling": len(self._prefilling),
            "saved_tpot_s": None if saved is None else round(saved, 6),
        }
