"""Counts and sums of samples over a sliding time window, in fixed memory."""

from __future__ import annotations

import time
from collections import deque

__all__ = ["TimeWindow"]

# Time buckets per window: its resolution is window_s / _BUCKETS (1 s at the default 120 s).
_BUCKETS = 120


class TimeWindow:
    """Counts and sums of samples over the last `window_s` seconds, in `_BUCKETS` time buckets:
    the same memory and the same work per sample at any request rate. (A window of samples
    capped in number would hold only the last few seconds at a high rate, and count demand
    short by as much.)"""

    __slots__ = ("_bucket_s", "_ring", "_width")

    def __init__(self, window_s: float, width: int) -> None:
        self._bucket_s = window_s / _BUCKETS
        self._width = width  # values per sample
        # Each bucket: [index, count, sum of value 0, sum of value 1, ...].
        self._ring: deque[list[float]] = deque(maxlen=_BUCKETS)

    def __len__(self) -> int:
        return len(self._ring)

    def add(self, *values: float) -> None:
        index = time.monotonic() // self._bucket_s
        ring = self._ring
        if ring and ring[-1][0] == index:
            bucket = ring[-1]
        else:
            bucket = [index, 0.0, *([0.0] * self._width)]
            ring.append(bucket)
        bucket[1] += 1
        for i, value in enumerate(values, 2):
            bucket[i] += value

    def totals(self) -> tuple[int, list[float]]:
        """Samples in the window (the current bucket and the `_BUCKETS - 1` before it) and the
        sums of their values."""
        first = time.monotonic() // self._bucket_s - (_BUCKETS - 1)
        count, sums = 0, [0.0] * self._width
        for bucket in self._ring:
            if bucket[0] >= first:
                count += int(bucket[1])
                for i in range(self._width):
                    sums[i] += bucket[2 + i]
        return count, sums
