"""The policy seams. Policies are pure: they see snapshots and return rankings; no I/O.

A policy is chosen by name from configuration (see `policies.load_*`), so adding one never
touches gateway code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    """What one gateway knows about one instance at the moment of a decision."""

    id: str
    url: str
    group: str
    capacity: int
    open_streams: int  # client requests this gateway has open through the instance, whole lifetime
    inflight: int  # requests this gateway has at the instance now (prefill: until KV handed off)
    busy: bool = False  # the instance rejected (429) recently and has not been seen to free a slot


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What a policy may know about the request being placed."""

    model: str
    group: str | None  # None: any group serving the model
    prompt: str
    prompt_chars: int
    max_tokens: int
    # Instance id -> leading prompt blocks that instance recently prefilled (the gateway's
    # prefix-affinity index); empty when affinity is not tracked.
    prefix_blocks: Mapping[str, int] = field(default_factory=dict)


class PrefillPolicy(Protocol):
    name: str

    def rank(self, request: RequestInfo, candidates: Sequence[InstanceLoad]) -> list[InstanceLoad]:
        """Candidates in the order they should be tried (a subset is allowed)."""
        ...


class DecodePolicy(Protocol):
    name: str

    def rank(self, request: RequestInfo, candidates: Sequence[InstanceLoad]) -> list[InstanceLoad]:
        """Decode workers in the order they should be tried."""
        ...


class Backoff(Protocol):
    def delay(self, attempt: int) -> float:
        """Seconds to wait after round `attempt` (0-based) in which every candidate rejected."""
        ...
