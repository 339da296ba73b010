"""The gateway's subscriptions to the prefills' KV events, feeding the KV-block index.

For every registered prefill whose record names a KV-event endpoint (a pdgate shim with
``kv_events_port``, or a stock vLLM server announced with ``--kv-events`` / given as
``--prefill "URL kv_events=tcp://HOST:PORT"``), the feed keeps one ZeroMQ SUB socket and
applies each batch to the index (gateway/instances/kv_index.py) as it arrives. A prefill
that leaves, or stops naming an endpoint, is unsubscribed and forgotten.

ZeroMQ reconnects by itself; what an engine published while this gateway was not connected
is lost, so a gap in its sequence numbers (or a restart, which starts them again) clears
what the index held for it, rather than trusting a view with holes. A prefill's blocks
stored before this gateway subscribed are not known until the engine stores them again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdgate.config import Role
from pdgate.config.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    decode_batch,
    parse_frames,
)
from pdgate.config.wire import EXT_SIM_TOKENIZER
from pdgate.gateway.instances.kv_index import KvBlockIndex
from pdgate.gateway.instances.prompt_tokens import PromptTokenizers
from pdgate.registry import InstanceRecord

log = logging.getLogger("pdgate.gateway.kv_events")

__all__ = ["KvEventFeed"]

# Messages a subscriber may hold before ZeroMQ drops (a burst of a busy engine's steps).
_RCVHWM = 100_000


@dataclass(slots=True)
class _Subscription:
    endpoint: str
    task: asyncio.Task[None]


class KvEventFeed:
    """One subscription per publishing prefill; see the module docstring."""

    def __init__(
        self,
        index: KvBlockIndex,
        tokenizers: PromptTokenizers,
        registry: CollectorRegistry,
    ) -> None:
        self._index = index
        self._tokenizers = tokenizers
        self._ctx: zmq.asyncio.Context | None = None
        self._subs: dict[str, _Subscription] = {}
        # Every subscription task until it has ended, those stopped included: each closes
        # its socket on the way out, which the context's `term` waits for.
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self._events = Counter(
            "pdgate_kv_events",
            "KV events applied to the KV-block index, by kind (stored and removed count "
            "blocks; cleared counts whole caches, a gap in an engine's sequence included)",
            ["kind"],
            registry=registry,
        )
        self._gaps = Counter(
            "pdgate_kv_event_gaps",
            "Gaps in a prefill's KV-event sequence (events lost, or the engine restarted): "
            "what the index held for it is cleared",
            registry=registry,
        )
        self._bad = Counter(
            "pdgate_kv_event_errors",
            "KV-event messages that could not be read (skipped)",
            registry=registry,
        )
        self._lag = Histogram(
            "pdgate_kv_event_lag_seconds",
            "From an engine publishing a batch of KV events to this gateway applying it "
            "(wall clocks of two hosts: includes their offset)",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0),
            registry=registry,
        )
        Gauge(
            "pdgate_kv_index_blocks",
            "Distinct KV blocks in the KV-block index (bounded by kv_index_max_blocks)",
            registry=registry,
        ).set_function(lambda: index.stats()["entries"])
        Gauge(
            "pdgate_kv_event_subscriptions",
            "Prefills whose KV events this gateway follows",
            registry=registry,
        ).set_function(lambda: len(self._subs))

    # -- membership ---------------------------------------------------------------------------

    def on_change(self, view: Mapping[str, InstanceRecord], departed: set[str]) -> None:
        """The membership listener: follow every publishing prefill in `view`."""
        if self._closed:
            return
        for instance_id in departed:
            self._stop(instance_id)
        for rec in view.values():
            sub = self._subs.get(rec.id)
            if rec.role is not Role.PREFILL or not rec.kv_events:
                if sub is not None:
                    self._stop(rec.id)
                continue
            if sub is not None and sub.endpoint == rec.kv_events:
                continue
            if sub is not None:
                self._stop(rec.id)
            if EXT_SIM_TOKENIZER in rec.extensions:
                self._tokenizers.use_sim(rec.model)
            self._index.publishing(rec.id, rec.model)
            task = asyncio.get_running_loop().create_task(
                self._follow(rec.id, rec.kv_events), name=f"kv-events-{rec.id}"
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            self._subs[rec.id] = _Subscription(rec.kv_events, task)
        for instance_id in [i for i in self._subs if i not in view]:
            self._stop(instance_id)

    def _stop(self, instance_id: str) -> None:
        sub = self._subs.pop(instance_id, None)
        if sub is not None:
            sub.task.cancel()
        self._index.forget(instance_id)

    async def aclose(self) -> None:
        self._closed = True
        self._subs.clear()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # -- one engine -----------------------------------------------------------------------

    async def _follow(self, instance_id: str, endpoint: str) -> None:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        while True:
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, _RCVHWM)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            try:
                sock.connect(endpoint)
                log.info("following the KV events of %s at %s", instance_id, endpoint)
                await self._read(instance_id, sock)
            except asyncio.CancelledError:
                raise
            except Exception:
                # A broken socket or a bug: start over with nothing trusted.
                log.exception("KV events of %s at %s broke; resubscribing", instance_id, endpoint)
                self._index.cleared(instance_id)
                await asyncio.sleep(1.0)
            finally:
                sock.close(linger=0)

    async def _read(self, instance_id: str, sock: zmq.asyncio.Socket) -> None:
        expected: int | None = None
        while True:
            frames = await sock.recv_multipart()
            try:
                _, seq, payload = parse_frames(frames)
                batch = decode_batch(payload)
            except ValueError as exc:
                self._bad.inc()
                log.debug("unreadable KV event message from %s: %s", instance_id, exc)
                continue
            if expected is not None and seq != expected:
                self._gaps.inc()
                self._index.cleared(instance_id)
            expected = seq + 1
            self._apply(instance_id, batch.events)
            self._lag.observe(max(0.0, time.time() - batch.ts))

    def _apply(self, instance_id: str, events: Sequence[KvEvent]) -> None:
        index = self._index
        before = index.counts.stored, index.counts.removed, index.counts.cleared
        for event in events:
            if isinstance(event, BlockStored):
                index.stored(instance_id, event)
            elif isinstance(event, BlockRemoved):
                index.removed(instance_id, event)
            elif isinstance(event, AllBlocksCleared):
                index.cleared(instance_id)
        counts = index.counts
        for kind, was, now in zip(
            ("stored", "removed", "cleared"),
            before,
            (counts.stored, counts.removed, counts.cleared),
            strict=True,
        ):
            if now > was:
                self._events.labels(kind).inc(now - was)
