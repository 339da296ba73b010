"""The policy seams: filters, then weighted scorers, then a picker (llm-d's scheduler shape).

Policies are pure: they see snapshots (`InstanceLoad`, `RequestInfo`) and return rankings;
no I/O, no clocks. One `Policy` ranks both legs (prefill and decode): the gateway asks it for
the candidates to try, in order.

* A **filter** drops candidates that must not be tried now (no free slot, just rejected,
  ejected). Filters are the same for both legs.
* A **scorer** rates every remaining candidate in [0, 1], higher is better. A policy adds
  its scorers' ratings with configured weights, so a new signal is a new scorer, not an
  edit of the old ones.
* A **picker** turns the weighted scores into the order of tries (best first, a rotation,
  two random choices, ...).
* An optional **holder** (prefill leg, queue dispatch) decides, when the prefill holding a
  request's prefix is busy, whether to send the request to the free prefill the picker chose
  or hold it for the busy one, from expected completion times the gateway estimates
  (policies/completion.py).

Each plugin is named in configuration (pdgate's built-ins by name, anything else as
``"package.module:factory"``): adding one never touches gateway code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, runtime_checkable

from pdgate.config.wire import Role

__all__ = [
    "NO_NEEDS",
    "Candidates",
    "Filter",
    "Holder",
    "InstanceLoad",
    "Option",
    "Picker",
    "Policy",
    "Ranker",
    "RequestInfo",
    "Scorer",
]


class InstanceLoad(NamedTuple):
    """What the gateway knows about one instance at the moment of a decision.

    A named tuple rather than a frozen dataclass: the gateway builds one per candidate
    instance on every ranking (two a request, each over the whole role's fleet), and a
    tuple is far cheaper to build (positionally most of all) and as immutable (``_replace``
    makes a changed copy, not `dataclasses.replace`)."""

    id: str
    url: str
    group: str
    capacity: int
    open_streams: int  # client requests open through the instance, for their whole life
    inflight: int  # requests at the instance now (prefill: until its KV was taken)
    busy: bool = False  # the instance rejected (429) recently and has not freed a slot since
    role: Role = Role.PREFILL
    inflight_tokens: int = 0  # prompt tokens of the requests in flight (token-work load)
    ejected: bool = False  # failing (outlier ejection): not tried until its cool-down ends
    # Of `inflight`, this gateway's own requests (the rest: other gateways', as of the last
    # fleet sync or freed-slot message).
    own_inflight: int = 0
    # Of `inflight`, the requests whose prompt the instance is computing now (prefill: from
    # the call to its answer; after it the slot only holds KV), this gateway's and, as the
    # fleet last said, the others'.
    computing: int = 0
    # How fast it computes prompts, relative to the fleet's fastest hardware type (0.5: at half
    # its pace), as the gateways measured per declared type; 1.0 where unknown or all alike.
    speed: float = 1.0


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What a policy may know about the request being placed."""

    model: str
    group: str | None  # None: any group serving the model
    prompt: str  # the prompt as text (token ids as a string) for hashing and lengths
    prompt_chars: int
    max_tokens: int
    # Instance id -> leading prompt characters whose KV that instance is believed to hold
    # (the gateway's prefix index); empty unless a scorer asked for it (`needs` "prefix" or
    # "kv_prefix").
    cached_chars: Mapping[str, int] = field(default_factory=dict)
    tenant: str = "anonymous"  # whose request: the API key's name (fairness, metrics)
    priority: int = 1  # priority class: 0 most urgent (high), 1 normal, 2 low
    weight: float = 1.0  # the tenant's share weight in the queue's fairness
    ttft_s: float | None = None  # its TTFT budget from arrival (group's, or shorter by header)
    tpot_s: float | None = None  # its TPOT SLO (the group's, or tighter by header)
    # The prompt's token ids where the client sent ids (`prompt` is then them, space-joined).
    prompt_ids: tuple[int, ...] | None = None


Candidates = Sequence[InstanceLoad]
NO_NEEDS: frozenset[str] = frozenset()  # a plugin that reads only the loads and the request


@runtime_checkable
class Filter(Protocol):
    name: str

    @property
    def needs(self) -> frozenset[str]:
        """Signals it reads (see `Ranker.needs`); most plugins: `NO_NEEDS`."""
        ...

    def filter(self, request: RequestInfo, candidates: Candidates) -> list[InstanceLoad]:
        """The candidates that may be tried now (a subset, order kept)."""
        ...


@runtime_checkable
class Scorer(Protocol):
    name: str

    @property
    def needs(self) -> frozenset[str]:
        """Signals it reads (see `Ranker.needs`); most plugins: `NO_NEEDS`."""
        ...

    def score(self, request: RequestInfo, candidates: Candidates) -> list[float]:
        """One rating per candidate, in [0, 1], higher is better."""
        ...


@runtime_checkable
class Picker(Protocol):
    name: str

    @property
    def needs(self) -> frozenset[str]:
        """Signals it reads (see `Ranker.needs`); most plugins: `NO_NEEDS`."""
        ...

    def order(
        self, request: RequestInfo, candidates: Candidates, scores: Sequence[float]
    ) -> list[InstanceLoad]:
        """The candidates in the order they should be tried. There are always two or more:
        a policy tries a lone candidate without scoring or picking."""
        ...


@dataclass(frozen=True, slots=True)
class Option:
    """One place a request could be prefilled, with the gateway's estimates for it."""

    instance: InstanceLoad
    wait_s: float  # until it can start the request: 0 when it has a free slot now
    prefill_s: float  # its prefill of this request (the part its cache does not hold)

    @property
    def finish_s(self) -> float:
        return self.wait_s + self.prefill_s


@runtime_checkable
class Holder(Protocol):
    name: str

    @property
    def needs(self) -> frozenset[str]:
        """Signals it reads (see `Ranker.needs`); most plugins: `NO_NEEDS`."""
        ...

    scan: int  # queued requests a free prefill may look through while the head is held

    def choose(
        self, now: Option, busy: Sequence[Option], *, remaining_s: float, held_s: float = 0.0
    ) -> Option:
        """`now` (send the request there at once) or the busy option to hold it for."""
        ...


@runtime_checkable
class Ranker(Protocol):
    """What the gateway calls: anything that ranks candidates (a `Policy`, or a whole policy
    written by hand and named as ``module:factory``)."""

    name: str

    @property
    def needs(self) -> frozenset[str]:
        """Signals the gateway computes only for a ranker that reads them: ``"prefix"``, the
        prefix-affinity index, or ``"kv_prefix"``, the index fed by the engines' KV events
        (`RequestInfo.cached_chars` is empty without either)."""
        ...

    @property
    def hold(self) -> Holder | None:
        """Prefill leg, queue dispatch: may hold a request for a busy prefill's cache (None:
        never)."""
        ...

    def describe(self) -> dict[str, object]:
        """What /health shows of it: its name and composition."""
        ...

    def rank(self, request: RequestInfo, candidates: Candidates) -> list[InstanceLoad]:
        """Candidates to try, best first (filtered: possibly fewer than given)."""
        ...


class Policy:
    """Filters, then weighted scorers, then a picker."""

    def __init__(
        self,
        name: str,
        filters: Sequence[Filter],
        scorers: Sequence[tuple[Scorer, float]],
        picker: Picker,
        hold: Holder | None = None,
    ) -> None:
        if any(weight < 0 for _, weight in scorers):
            raise ValueError("scorer weights must be >= 0")
        self.name = name
        self.filters = tuple(filters)
        self.scorers = tuple(scorers)
        self.picker = picker
        self.hold = hold
        # A weight of 0 turns a scorer off (configuration can say so); rank() skips it.
        self._weighted = tuple((s, w) for s, w in self.scorers if w != 0)

    @property
    def needs(self) -> frozenset[str]:
        """Signals the gateway must compute for this policy's plugins (e.g. ``"prefix"``: the
        prefix-affinity index, built only when some scorer reads it)."""
        out: set[str] = set()
        for plugin in (*self.filters, *(s for s, _ in self.scorers), self.picker, self.hold):
            if plugin is not None:
                out |= plugin.needs
        return frozenset(out)

    def rank(self, request: RequestInfo, candidates: Candidates) -> list[InstanceLoad]:
        kept: Sequence[InstanceLoad] = candidates
        for f in self.filters:
            if not kept:
                return []
            kept = f.filter(request, kept)
        if len(kept) <= 1:
            # Nothing to order: scorers and picker see two candidates or more. (This runs
            # once or twice a request; scoring a lone candidate cost a microsecond or two.)
            return list(kept)
        totals = [0.0] * len(kept)
        for scorer, weight in self._weighted:
            for i, s in enumerate(scorer.score(request, kept)):
                totals[i] += weight * s
        return self.picker.order(request, kept, totals)

    def describe(self) -> dict[str, object]:
        return {
            "name": self.name,
            "filters": [f.name for f in self.filters],
            "scorers": {s.name: w for s, w in self.scorers},
            "picker": self.picker.name,
            "hold": None if self.hold is None else self.hold.name,
        }
