"""Partial disaggregation (EcoServe section 4.2.3): rolling activation across a macro
instance, with the constraint check.

A group whose aggregated instances all declare ``EXT_PHASES`` alternates prefill and decode
phases at each instance (the shim's gate, engine_shim/_phases.py) and is one macro instance.
Its requests are ranked by `RollingActivation` instead of the group's prefill policy: the
instance that took the previous request first, as long as it passes the check, so prompts
arrive at an instance in bursts (one prefill phase) while the others decode; otherwise the
next instance in the macro instance's order (by id) that passes, then the rest in that
order. The check (EcoServe Algorithm 2), per instance:

* **TTFT**: the predicted prefill time of the prompts it has not answered yet, this one
  included, is within the request's TTFT budget (the group's, or shorter by header).
  Pending prompt tokens are the fleet's token work on the instance
  (`InstanceLoad.inflight_tokens`, held from the grant to the first byte); seconds per token
  are learned from this gateway's requests there (grant to first byte over the prompt's
  tokens, the wait for a prefill phase included: it errs long).
* **TPOT**: the mean saved TPOT of its decoding streams (L x tpot_slo_s - time since the
  stream's first token, L its tokens so far) covers that prefill time. The streams are this
  gateway's own (it relays them; with several gateways each judges by its share).
* **Memory**: a free slot (the candidates' filter): the instance's declared capacity stands
  for the KV it can hold.
"""

from __future__ import annotations

import time
import weakref

from pdgate.gateway.placement.placed import Placement
from pdgate.policies.base import NO_NEEDS, Candidates, Holder, InstanceLoad, RequestInfo

__all__ = ["PhaseView", "RollingActivation"]

_CHARS_PER_TOKEN = 4  # the gateway's prompt-size estimate before the engine's count


class PhaseView:
    """A partial group's instances as this gateway sees them through its own streams."""

    def __init__(self, *, tpot_slo_s: float, seconds_per_token: float = 1e-4) -> None:
        if tpot_slo_s <= 0 or seconds_per_token <= 0:
            raise ValueError("tpot_slo_s and seconds_per_token must be positive")
        self.tpot_slo_s = tpot_slo_s
        self.seconds_per_token = seconds_per_token
        self.last: str | None = None  # the instance that took the previous request
        # Instance -> its streams through this gateway; bounded by the open streams (a
        # placement leaves when it is collected, closed ones are skipped, and an instance
        # with none left is dropped at the next routing).
        self._streams: dict[str, weakref.WeakSet[Placement]] = {}

    def routed(self, instance_id: str, placement: Placement) -> None:
        self.last = instance_id
        for gone in [i for i, streams in self._streams.items() if not streams]:
            del self._streams[gone]
        self._streams.setdefault(instance_id, weakref.WeakSet()).add(placement)

    def prefilled(self, seconds: float, tokens: int) -> None:
        """A prompt of `tokens` tokens had its first byte `seconds` after its grant."""
        if tokens > 0 and seconds >= 0:
            self.seconds_per_token += 0.2 * (seconds / tokens - self.seconds_per_token)

    def saved_tpot_s(self, instance_id: str, now: float | None = None) -> float | None:
        """The mean saved TPOT of the instance's decoding streams (None: none decodes)."""
        streams = self._streams.get(instance_id)
        if not streams:
            return None
        now = time.monotonic() if now is None else now
        saved = [
            p.tokens * self.tpot_slo_s - (now - p.first_token_at)
            for p in streams
            if p.first_token_at is not None and not p.closed
        ]
        return sum(saved) / len(saved) if saved else None

    def prefill_s(self, inst: InstanceLoad, tokens: int) -> float:
        """Predicted prefill time of the prompts pending at `inst` plus one of `tokens`."""
        return (inst.inflight_tokens + tokens) * self.seconds_per_token


class RollingActivation:
    """The ranker of a partial group (module docstring)."""

    name = "rolling_activation"
    needs = NO_NEEDS
    hold: Holder | None = None

    def __init__(self, view: PhaseView, *, ttft_slo_s: float) -> None:
        self._view = view
        self._ttft = ttft_slo_s

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "ttft_slo_s": self._ttft, "tpot_slo_s": self._view.tpot_slo_s}

    def rank(self, request: RequestInfo, candidates: Candidates) -> list[InstanceLoad]:
        order = sorted(candidates, key=lambda c: c.id)
        last = self._view.last
        # From the previous request's instance (or the first after it, if it is gone).
        start = next((i for i, c in enumerate(order) if last is None or c.id >= last), 0)
        cycle = order[start:] + order[:start]
        usable = [c for c in cycle if not (c.busy or c.ejected) and c.inflight < c.capacity]
        tokens = request.prompt_chars // _CHARS_PER_TOKEN + 1
        ttft = request.ttft_s or self._ttft
        fits = [c for c in usable if self.fits(c, tokens, ttft)]
        return fits + [c for c in usable if c not in fits]

    def fits(self, inst: InstanceLoad, tokens: int, ttft_s: float) -> bool:
        """EcoServe's check: TTFT, then TPOT (memory: the slot filter in `rank`)."""
        needed = self._view.prefill_s(inst, tokens)
        if needed > ttft_s:
            return False
        saved = self._view.saved_tpot_s(inst.id)
        return saved is None or saved >= needed
