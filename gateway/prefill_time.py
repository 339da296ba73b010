"""How long prefills take here, from the gateway's own calls: to spot a hopeless request.

Past capacity, the request at the head of the queue is often one that can no longer make
its TTFT deadline: sent anyway, it occupies a prefill for its whole computation (a prefill
drops an abandoned prompt only at its next step) and then fails, while a request that could
still have made it waits. Under earliest-deadline-first that is the classic overload
collapse: the most urgent request is the likeliest to be hopeless.

`PrefillTimes` keeps the durations of recent accepted prefill calls as seconds per
character of prompt (a tokenizer-free proxy for tokens, as in the affinity index), in
windows per prompt-length class (powers of two of characters), because the rate depends on
length: long prompts are mostly uncached, short ones often hit the prefix cache. Its
estimate for a new prompt is a low quantile of its class's rates (the whole window's while
the class has too few samples) times its length: *optimistic* on purpose, since dropping a
request that could have made it is worse than trying one that cannot.
"""

from __future__ import annotations

import bisect
from collections import deque

__all__ = ["PrefillTimes"]

_MAX_CLASSES = 40  # 2**40 characters: far beyond any body limit


class _Window:
    """The last `size` values, also kept sorted for quantiles."""

    __slots__ = ("_sorted", "_values")

    def __init__(self, size: int) -> None:
        self._values: deque[float] = deque(maxlen=size)
        self._sorted: list[float] = []

    def __len__(self) -> int:
        return len(self._values)

    def add(self, value: float) -> None:
        if len(self._values) == self._values.maxlen:
            del self._sorted[bisect.bisect_left(self._sorted, self._values[0])]
        self._values.append(value)
        bisect.insort(self._sorted, value)

    def quantile(self, q: float) -> float:
        return self._sorted[min(len(self._sorted) - 1, int(q * len(self._sorted)))]


class PrefillTimes:
    """Recent seconds-per-character rates of accepted prefill calls, by prompt-length class."""

    def __init__(
        self,
        *,
        window: int = 256,
        class_window: int = 64,
        quantile: float = 0.1,
        min_samples: int = 16,
    ) -> None:
        if min(window, class_window, min_samples) <= 0 or not 0.0 <= quantile <= 1.0:
            raise ValueError("window sizes and min_samples must be positive, quantile in [0, 1]")
        self._all = _Window(window)
        self._class_window = class_window
        self._by_class: dict[int, _Window] = {}  # at most _MAX_CLASSES entries
        self._quantile = quantile
        self._min_samples = min_samples

    def __len__(self) -> int:
        return len(self._all)

    @staticmethod
    def _class(prompt_chars: int) -> int:
        return min(prompt_chars.bit_length(), _MAX_CLASSES)

    def record(self, prompt_chars: int, seconds: float) -> None:
        """An accepted prefill call of a `prompt_chars` prompt took `seconds`, answer included."""
        if prompt_chars <= 0 or seconds < 0:
            return
        rate = seconds / prompt_chars
        self._all.add(rate)
        cls = self._class(prompt_chars)
        window = self._by_class.get(cls)
        if window is None:
            window = self._by_class[cls] = _Window(self._class_window)
        window.add(rate)

    def lower_bound_s(self, prompt_chars: int) -> float | None:
        """Optimistic prefill time of a `prompt_chars` prompt; None while too few samples."""
        window = self._by_class.get(self._class(prompt_chars))
        if window is None or len(window) < self._min_samples:
            window = self._all
            if len(window) < self._min_samples:
                return None
        return window.quantile(self._quantile) * prompt_chars

    def upper_bound_s(self, prompt_chars: int, quantile: float = 0.99) -> float | None:
        """A pessimistic prefill time (a high quantile); None while too few samples."""
        window = self._by_class.get(self._class(prompt_chars))
        if window is None or len(window) < self._min_samples:
            window = self._all
            if len(window) < self._min_samples:
                return None
        return window.quantile(quantile) * prompt_chars

    def hopeless(self, prompt_chars: int, remaining_s: float) -> bool:
        """Even an optimistic prefill would end after the request's deadline."""
        estimate = self.lower_bound_s(prompt_chars)
        return estimate is not None and remaining_s < estimate
