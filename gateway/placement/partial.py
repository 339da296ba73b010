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

**Mitosis** (EcoServe section 4.2.4, `Mitosis`): a group larger than ``upper`` instances is
several macro instances, each with its own rolling activation. The split is a function of
the group's ready instances in the order they started (the registry's ``started_at``), so
every gateway reading the same registry agrees without talking: growing past ``upper``
splits the newest ``lower`` instances off into a new macro instance; further instances
fill the first one up to ``upper``, then the new one; shrinking takes from the full one
while the smallest stays at ``lower``, and two that fit in ``upper`` merge. Macro
instances only steer where new requests go: an instance that moves between them keeps its
running streams. A request tries the macro instance with the most free slots first, the
others after it.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence

from pdgate.gateway.placement.placed import Placement
from pdgate.policies.base import NO_NEEDS, Candidates, Holder, InstanceLoad, RequestInfo

__all__ = ["Mitosis", "PhaseView", "RollingActivation", "macro_sizes"]

_CHARS_PER_TOKEN = 4  # the gateway's prompt-size estimate before the engine's count


def macro_sizes(n: int, lower: int, upper: int) -> list[int]:
    """Sizes of the macro instances of `n` instances, oldest first: as many full (`upper`)
    as fit, the rest in one more if it has `lower`, else the last full one lends it some."""
    if n <= upper:
        return [n] if n else []
    full, rest = divmod(n, upper)
    if rest == 0:
        return [upper] * full
    if rest >= lower:
        return [upper] * full + [rest]
    return [upper] * (full - 1) + [upper + rest - lower, lower]


class Mitosis:
    """Splits a partial group's instances into macro instances (module docstring)."""

    def __init__(self, lower: int, upper: int) -> None:
        if lower < 1 or upper < 2 * lower - 1:
            raise ValueError("macro instance bounds: lower >= 1 and upper >= 2 x lower - 1")
        self.lower = lower
        self.upper = upper

    def split(self, members: Sequence[str]) -> list[tuple[str, ...]]:
        """`members` (instance ids, oldest first) as macro instances."""
        out: list[tuple[str, ...]] = []
        start = 0
        for size in macro_sizes(len(members), self.lower, self.upper):
            out.append(tuple(members[start : start + size]))
            start += size
        return out


class PhaseView:
    """A partial group's instances as this gateway sees them through its own streams, and
    its macro instances."""

    def __init__(
        self,
        *,
        tpot_slo_s: float,
        seconds_per_token: float = 1e-4,
        mitosis: Mitosis | None = None,
    ) -> None:
        if tpot_slo_s <= 0 or seconds_per_token <= 0:
            raise ValueError("tpot_slo_s and seconds_per_token must be positive")
        self.tpot_slo_s = tpot_slo_s
        self.seconds_per_token = seconds_per_token
        self.mitosis = mitosis or Mitosis(1, 1 << 30)  # one macro instance
        # Per macro instance (by its oldest member): the instance that took its previous
        # request. Bounded by the macro instances of the last split.
        self.last: dict[str, str] = {}
        self.macros: list[tuple[str, ...]] = []
        self._members: tuple[str, ...] = ()
        self._macro_of: dict[str, str] = {}
        # Instance -> its streams through this gateway; bounded by the open streams (a
        # placement leaves when it is collected, closed ones are skipped, and an instance
        # with none left is dropped at the next routing).
        self._streams: dict[str, weakref.WeakSet[Placement]] = {}
        # A stream's own TPOT SLO where its request tightened the group's.
        self._slo: weakref.WeakKeyDictionary[Placement, float] = weakref.WeakKeyDictionary()

    def arrange(self, members: Sequence[str]) -> list[tuple[str, ...]]:
        """The macro instances of `members` (ids, oldest first), split again only when the
        membership changed."""
        if tuple(members) != self._members:
            self._members = tuple(members)
            self.macros = self.mitosis.split(self._members)
            self._macro_of = {i: m[0] for m in self.macros for i in m}
            keys = {m[0] for m in self.macros}
            self.last = {k: v for k, v in self.last.items() if k in keys}
        return self.macros

    def macro_of(self, instance_id: str) -> str:
        """The key (oldest member) of the instance's macro instance; "" for none."""
        return self._macro_of.get(instance_id, "")

    def routed(
        self, instance_id: str, placement: Placement, tpot_slo_s: float | None = None
    ) -> None:
        self.last[self.macro_of(instance_id)] = instance_id
        if tpot_slo_s is not None and tpot_slo_s != self.tpot_slo_s:
            self._slo[placement] = tpot_slo_s
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
            p.tokens * self._slo.get(p, self.tpot_slo_s) - (now - p.first_token_at)
            for p in streams
            if p.first_token_at is not None and not p.closed
        ]
        return sum(saved) / len(saved) if saved else None

    def prefill_s(self, inst: InstanceLoad, tokens: int) -> float:
        """Predicted prefill time of the prompts pending at `inst` plus one of `tokens`."""
        return (inst.inflight_tokens + tokens) * self.seconds_per_token


def _by_id(c: InstanceLoad) -> str:
    return c.id


class RollingActivation:
    """The ranker of a partial group (module docstring). `members`: the group's ready
    instances, oldest first (the macro instances are split from them)."""

    name = "rolling_activation"
    needs = NO_NEEDS
    hold: Holder | None = None

    def __init__(
        self,
        view: PhaseView,
        *,
        ttft_slo_s: float,
        members: Callable[[], Sequence[str]] | None = None,
    ) -> None:
        self._view = view
        self._ttft = ttft_slo_s
        self._members = members

    def describe(self) -> dict[str, object]:
        return {
            "name": self.name,
            "ttft_slo_s": self._ttft,
            "tpot_slo_s": self._view.tpot_slo_s,
            "macro_instances": [list(m) for m in self._view.macros],
        }

    def rank(self, request: RequestInfo, candidates: Candidates) -> list[InstanceLoad]:
        view = self._view
        members = list(self._members()) if self._members is not None else []
        by_id = {c.id: c for c in candidates}
        known = set(members)
        # An instance the registry view does not list yet joins after the others.
        members += sorted(i for i in by_id if i not in known)
        macros = view.arrange(members)

        def room(macro: tuple[str, ...]) -> int:
            return sum(c.capacity - c.inflight for i in macro if (c := by_id.get(i)) is not None)

        tokens = request.prompt_chars // _CHARS_PER_TOKEN + 1
        ttft = request.ttft_s or self._ttft
        fits: list[InstanceLoad] = []
        rest: list[InstanceLoad] = []
        for macro in sorted(macros, key=room, reverse=True):  # stable: oldest first on ties
            order = sorted((c for i in macro if (c := by_id.get(i)) is not None), key=_by_id)
            last = view.last.get(macro[0])
            # From the previous request's instance (or the first after it, if it is gone).
            start = next((n for n, c in enumerate(order) if last is None or c.id >= last), 0)
            for c in order[start:] + order[:start]:
                if c.busy or c.ejected or c.inflight >= c.capacity:
                    continue
                (fits if self.fits(c, tokens, ttft) else rest).append(c)
        return fits + rest

    def fits(self, inst: InstanceLoad, tokens: int, ttft_s: float) -> bool:
        """EcoServe's check: TTFT, then TPOT (memory: the slot filter in `rank`)."""
        needed = self._view.prefill_s(inst, tokens)
        if needed > ttft_s:
            return False
        saved = self._view.saved_tpot_s(inst.id)
        return saved is None or saved >= needed
