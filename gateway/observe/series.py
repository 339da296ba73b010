"""A short in-memory history for the operator's page: per time bucket, requests by outcome,
TTFT percentiles and 429s, over the last minutes. Bounded: a fixed ring of buckets, a
fixed-size TTFT sample per bucket."""

from __future__ import annotations

import random
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Series"]

_SAMPLE = 256


@dataclass
class _Bucket:
    start: float  # wall clock, seconds
    outcomes: Counter[str] = field(default_factory=Counter)
    ttft: list[float] = field(default_factory=list)
    seen: int = 0  # TTFTs offered (reservoir sampling keeps _SAMPLE of them)
    rejections: int = 0


class Series:
    def __init__(self, bucket_s: float = 5.0, buckets: int = 180) -> None:
        if bucket_s <= 0 or buckets < 1:
            raise ValueError("bucket_s > 0 and buckets >= 1 required")
        self._bucket_s = bucket_s
        self._ring: deque[_Bucket] = deque(maxlen=buckets)
        self._rng = random.Random(0)

    def _current(self) -> _Bucket:
        now = time.time()
        start = now - now % self._bucket_s
        if not self._ring or self._ring[-1].start != start:
            self._ring.append(_Bucket(start))
        return self._ring[-1]

    def record(self, outcome: str, ttft_s: float | None, rejections: int = 0) -> None:
        b = self._current()
        b.outcomes[outcome] += 1
        b.rejections += rejections
        if ttft_s is not None:
            b.seen += 1
            if len(b.ttft) < _SAMPLE:
                b.ttft.append(ttft_s)
            else:
                j = self._rng.randrange(b.seen)
                if j < _SAMPLE:
                    b.ttft[j] = ttft_s

    def snapshot(self) -> dict[str, Any]:
        rows = []
        for b in self._ring:
            total = sum(b.outcomes.values())
            ttft = sorted(b.ttft)
            rows.append(
                {
                    "t": b.start,
                    "requests": total,
                    "ok": b.outcomes.get("ok", 0),
                    "success": b.outcomes.get("ok", 0) / total if total else None,
                    "outcomes": dict(b.outcomes),
                    "ttft_p50": _pct(ttft, 0.5),
                    "ttft_p95": _pct(ttft, 0.95),
                    "rejections": b.rejections,
                }
            )
        return {"bucket_s": self._bucket_s, "buckets": rows}


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, int(q * len(values)))]
