"""What a request holds once placed: its prefill's grant, then both legs (`Placement`).

Each leg sees the client's request as a `LegRequest` (its description, id, deadline and
trace span).

The forwarder hands its caller a `PrefillGrant` (the prefill computed the request and holds
its KV); the dispatcher turns it into a `Placement` when a decode took the request. Each
owns the counts it holds and releases them exactly once: a grant nobody takes is closed (its
KV released at the prefill, then its counts), and a placement's `close()` releases whatever
is still held.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pdgate.config.openai_api import Api
from pdgate.config.tracing import Span
from pdgate.gateway.instances.tracker import Lease
from pdgate.gateway.placement.handoff import StockLeg
from pdgate.gateway.upstream.base import DecodeStream
from pdgate.policies.base import InstanceLoad, RequestInfo

__all__ = [
    "DecodeLeg",
    "LegRequest",
    "Placement",
    "PrefillGrant",
    "as_stream",
    "release_counts",
    "whole",
]


@dataclass(frozen=True, slots=True)
class LegRequest:
    """One client request as each of its legs sees it."""

    info: RequestInfo
    request_id: str
    deadline: float  # time.monotonic() by which the first byte is due
    span: Span | None  # the request's trace span: the legs' spans are its children
    retry: bool = False  # a failover or a continuation: admitted before (`Waiter.admitted`)


class PrefillGrant:
    """A prefill accepted and computed the request. Its owner either hands the KV to a decode
    (`take`, then `Placement` owns the counts) or abandons it (`close`: the KV is released at
    the prefill, then the counts)."""

    __slots__ = (
        "_closed",
        "_release",
        "answered_at",
        "attempts",
        "inflight",
        "instance",
        "leg",
        "on_handover",
        "rejections",
        "reply",
        "stream",
    )

    def __init__(
        self,
        instance: InstanceLoad,
        reply: dict[str, Any],
        stream: Lease,
        inflight: Lease,
        release: Callable[[Sequence[Lease]], None],
        attempts: int,
        rejections: int,
        on_handover: Callable[[float], None] | None = None,
        leg: StockLeg | None = None,
    ) -> None:
        """`leg`: a stock server's legs (gateway/placement/handoff.py), None for a shim."""
        self.instance = instance
        self.leg = leg
        self.answered_at = time.monotonic()
        # Told how long the decode took from here to its first event (early drop learns it).
        self.on_handover = on_handover
        self.reply = reply
        self.stream = stream  # the request's open stream through this prefill, whole life
        self.inflight = inflight  # the prefill's slot, until the KV has left it
        self._release = release
        self.attempts = attempts
        self.rejections = rejections
        self._closed = False

    @property
    def kv_params(self) -> dict[str, Any]:
        params: dict[str, Any] = self.reply["kv_transfer_params"]
        return params

    def take(self) -> None:
        """A decode accepted: from now on the caller owns the counts (see `Placement`)."""
        self._closed = True

    def handed_over(self) -> None:
        """The decode sent its first event: report the time since the prefill answered."""
        if self.on_handover is not None:
            self.on_handover(time.monotonic() - self.answered_at)

    def release_kv_then(self, leases: Sequence[Lease]) -> None:
        """Release the KV at the prefill, then `leases` (for an owner that took the grant).
        A stock server's KV went with the decode leg: a decode that drops the request frees
        the prefill's blocks itself (its connector's ``request_finished``)."""
        if self.leg is not None:
            release_counts(leases)
            return
        self._release(leases)

    def close(self) -> None:
        """Nobody will use this KV: release it at the prefill, then the counts. Idempotent."""
        if not self._closed:
            self._closed = True
            self._release([self.stream, self.inflight])


def release_counts(leases: Sequence[Lease]) -> None:
    """The release of a grant with no KV at a prefill behind it (a local prefill, an
    aggregated instance's slot): its counts only."""
    for lease in leases:
        lease.release()


class Placement:
    """A request placed on a prefill and a decode; the decode's stream is open.

    Owns every count of the request: the open-stream leases of both instances (whole life),
    the decode's slot, and the prefill's slot until `first_byte` says the KV has left the
    prefill. `close()` releases whatever is still held, exactly once."""

    def __init__(
        self,
        stream: DecodeStream,
        grant: PrefillGrant,
        decode: InstanceLoad,
        decode_leases: list[Lease],
        on_first_byte: Callable[[], None] = lambda: None,
    ) -> None:
        grant.take()
        self._on_first_byte = on_first_byte
        self.stream = stream
        self.prefill_id = grant.instance.id
        self.decode_id = decode.id
        self.prefill_attempts = grant.attempts
        self.prefill_rejections = grant.rejections
        self.prefill_group = grant.instance.group
        self.decode_group = decode.group
        # What the relay saw, for the P/D ratio advice (gateway/observe/ratio.py).
        self.opened_at = time.monotonic()  # the decode accepted
        self.first_token_at: float | None = None
        self.tokens = 0  # events that carried output
        self.gaps_s = 0.0  # sum of the gaps between them
        self._grant = grant
        self._leases = [grant.stream, *decode_leases]
        self._kv_taken = False
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def first_byte(self) -> None:
        """The decode sent its first event: it holds the KV, the prefill's slot is free."""
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        if not self._kv_taken:
            self._kv_taken = True
            self._grant.inflight.release()
            self._on_first_byte()
            self._grant.handed_over()

    def close(self) -> None:
        """Release every count and the upstream connection; safe to call more than once.

        Closing (not releasing) the decode connection mid-stream is what tells the decode
        the client is gone, so it frees the slot at once. A decode that never sent a byte may
        not have pulled the KV: it is released at the prefill before that slot counts free."""
        if self._closed:
            return
        self._closed = True
        self.stream.close()
        for lease in self._leases:
            lease.release()
        if not self._kv_taken:
            self._kv_taken = True
            self._grant.release_kv_then([self._grant.inflight])


def whole(
    response: DecodeStream,
    instance: InstanceLoad,
    stream: Lease,
    inflight: Lease,
    work: Lease,
    *,
    on_first_byte: Callable[[], None],
    attempts: int = 0,
    rejections: int = 0,
) -> Placement:
    """A request one instance computes and streams (a decode's local prefill, an aggregated
    instance): no KV at a prefill behind it, the prompt's `work` counted until the first
    byte, the open `stream` and the slot (`inflight`) until the stream ends."""
    grant = PrefillGrant(instance, {}, stream, work, release_counts, attempts, rejections)
    return Placement(response, grant, instance, [inflight], on_first_byte=on_first_byte)


def as_stream(body: dict[str, Any]) -> dict[str, Any]:
    """`body` for a leg that always streams, whatever the client asked (its end is what
    frees the slot; a non-streaming answer is assembled from the stream, with its usage)."""
    out = {**body, "stream": True}
    if not body.get("stream"):
        out["stream_options"] = {"include_usage": True}
    return out


@dataclass(frozen=True, slots=True)
class DecodeLeg:
    """What the decode leg gets: its body (``kv_transfer_params`` are added), the API it
    goes to, and a pdgate extension every candidate decode must declare (None: any)."""

    body: dict[str, Any]
    api: Api
    extension: str | None = None
