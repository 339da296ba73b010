"""The sim engine's KV-event publisher: vLLM's ZeroMQ PUB, the same frames and payload
(config/kv_events.py), so a gateway reads a sim prefill and a vLLM one by one code path.

PUB never blocks the engine: a subscriber that falls behind by `hwm` messages loses the
newest, and the sequence number (which counts every batch, sent or dropped) tells it so.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import zmq

from pdgate.config.kv_events import EventBatch, KvEvent, encode_batch

__all__ = ["KvEventPublisher"]


class KvEventPublisher:
    def __init__(self, bind: str, *, topic: bytes = b"", hwm: int = 100_000) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.set_hwm(hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(bind)
        except zmq.ZMQError:
            self.close()
            raise
        self._topic = topic
        self._seq = 0

    def publish(self, events: Sequence[KvEvent]) -> None:
        """One engine step's events, as one batch (nothing when there are none)."""
        if not events:
            return
        payload = encode_batch(EventBatch(time.time(), list(events)))
        seq = self._seq.to_bytes(8, "big", signed=True)
        self._seq += 1
        # PUB drops for a slow subscriber; the sequence number tells it.
        with contextlib.suppress(zmq.Again):
            self._sock.send_multipart((self._topic, seq, payload), flags=zmq.NOBLOCK)

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()
