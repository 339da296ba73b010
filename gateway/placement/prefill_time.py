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

Each queue keeps a second `PrefillTimes` keyed by the characters a prefill actually
computed (its answer says how many prompt tokens its cache held, `uncached_chars`); its
median (`estimate_s`) is the expected prefill time behind the hold-or-go choice
(policies/completion.py) and the expected end of each call (`InstanceTracker.work`).
`TokenRatio` learns tokens per character from the same answers, for the token-work load.
`QueueTimes` holds a queue's three, records each answer in them and exchanges their new
samples with the fleet's other gateways.

**Hardware.** Where prefills declare what they run on (the registry record's `hardware`), a
sample also goes into a window of its type, and an instance's estimates come from its own
type's window once that has enough samples: an L40S prefill is not estimated at an H100's
pace. `speeds()` turns the types' median rates into speeds relative to the fastest type's,
for the ranking (policies/scorers.py). A fleet of one type, or of undeclared ones, is
estimated exactly as before: every figure comes from the pooled windows and every speed is 1.
"""

from __future__ import annotations

import bisect
import contextlib
from collections import deque
from collections.abc import Mapping, Sequence

from pdgate.registry.base import hardware_name

__all__ = ["PrefillTimes", "QueueTimes", "TokenRatio", "cached_tokens", "uncached_chars"]

_MAX_CLASSES = 40  # 2**40 characters: far beyond any body limit
_MAX_TYPES = 16  # hardware types with windows of their own; more share the pooled ones
# The most grants one report of another gateway counts (a sync's worth is far fewer): a
# garbled report errs toward admitting, and no further.
_MAX_GRANTS_REPORTED = 100_000


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
        # Seconds from a prefill's answer to its decode's first event (KV transfer, the
        # decode's admission and first step): the rest of a request's time to first token.
        self._handover = _Window(class_window)
        # This gateway's own samples not yet shared with the fleet (`take_new`): (prompt
        # characters, seconds), a hand-over as 0 characters. Bounded: unshared samples are
        # only ever the newest.
        self._new: deque[tuple[int, float, str]] = deque(maxlen=window)
        # Per declared hardware type (bounded by _MAX_TYPES): the same windows, its own.
        self._typed: dict[str, PrefillTimes] = {}
        self._speeds: dict[str, float] | None = {}  # None: to recompute

    def __len__(self) -> int:
        return len(self._all)

    @staticmethod
    def _class(prompt_chars: int) -> int:
        return min(prompt_chars.bit_length(), _MAX_CLASSES)

    def take_new(self) -> list[tuple[int, float, str]]:
        """This gateway's samples since the last call, to share with the fleet: (prompt
        characters, seconds, hardware type or ""), a hand-over with 0 characters."""
        new = list(self._new)
        self._new.clear()
        return new

    def add_shared(self, prompt_chars: int, seconds: float, hardware: str = "") -> None:
        """Another gateway's sample, as `take_new` gave it there."""
        if prompt_chars == 0:
            self.record_handover(seconds, share=False)
        else:
            self.record(prompt_chars, seconds, hardware=hardware, share=False)

    def record(
        self, prompt_chars: int, seconds: float, *, hardware: str = "", share: bool = True
    ) -> None:
        """An accepted prefill call of a `prompt_chars` prompt took `seconds`, answer included,
        on a prefill of `hardware` ("": undeclared)."""
        if prompt_chars <= 0 or seconds < 0:
            return
        if share:
            self._new.append((prompt_chars, seconds, hardware))
        if hardware:
            typed = self._typed.get(hardware)
            if typed is None and len(self._typed) < _MAX_TYPES:
                typed = self._typed[hardware] = PrefillTimes(
                    window=self._class_window,
                    class_window=self._class_window,
                    quantile=self._quantile,
                    min_samples=self._min_samples,
                )
            if typed is not None:
                typed.record(prompt_chars, seconds, share=False)
                self._speeds = None
        rate = seconds / prompt_chars
        self._all.add(rate)
        cls = self._class(prompt_chars)
        window = self._by_class.get(cls)
        if window is None:
            window = self._by_class[cls] = _Window(self._class_window)
        window.add(rate)

    def lower_bound_s(self, prompt_chars: int) -> float | None:
        """The prefill time early drop uses (at this window's quantile) of a `prompt_chars`
        prompt, on the fastest hardware type that has enough samples of its own; None while
        too few samples."""
        pooled = self.estimate_s(prompt_chars, self._quantile)
        if pooled is None or len(self._typed) < 2:
            return pooled
        typed = [t.estimate_s(prompt_chars, self._quantile) for t in self._typed.values()]
        return min([pooled, *(t for t in typed if t is not None)])

    def upper_bound_s(
        self, prompt_chars: int, quantile: float = 0.99, hardware: str = ""
    ) -> float | None:
        """A pessimistic prefill time (a high quantile); None while too few samples."""
        return self.estimate_s(prompt_chars, quantile, hardware)

    def estimate_s(
        self, prompt_chars: int, quantile: float = 0.5, hardware: str = ""
    ) -> float | None:
        """The `quantile` of recent rates for this length times the length (the median by
        default: an expected time), on a prefill of `hardware` when its type has enough
        samples of its own (else the fleet's); None while too few samples."""
        typed = self._typed.get(hardware) if hardware else None
        if typed is not None:
            estimate = typed.estimate_s(prompt_chars, quantile)
            if estimate is not None:
                return estimate
        window = self._by_class.get(self._class(prompt_chars))
        if window is None or len(window) < self._min_samples:
            window = self._all
            if len(window) < self._min_samples:
                return None
        return window.quantile(quantile) * prompt_chars

    def hopeless(self, prompt_chars: int, remaining_s: float) -> bool:
        """The request's first token, at this window's quantile of prefill rates plus the
        median hand-over to its decode, would come after its deadline."""
        estimate = self.lower_bound_s(prompt_chars)
        return estimate is not None and remaining_s < estimate + self.handover_s()

    def record_handover(self, seconds: float, *, share: bool = True) -> None:
        """A decode's first event came `seconds` after its prefill answered."""
        if seconds >= 0:
            self._handover.add(seconds)
            if share:
                self._new.append((0, seconds, ""))

    def handover_s(self) -> float:
        """The median hand-over of recent requests; 0 while too few samples."""
        if len(self._handover) < self._min_samples:
            return 0.0
        return self._handover.quantile(0.5)

    def rate_s(self, quantile: float = 0.5, hardware: str = "") -> float | None:
        """The `quantile` of recent seconds per character, all lengths together (of `hardware`
        when its type has enough samples of its own)."""
        typed = self._typed.get(hardware) if hardware else None
        if typed is not None and (rate := typed.rate_s(quantile)) is not None:
            return rate
        if len(self._all) < self._min_samples:
            return None
        return self._all.quantile(quantile)

    def speeds(self) -> Mapping[str, float]:
        """Each hardware type's prefill speed relative to the fastest type's (its median
        seconds per character against theirs: 0.5 computes at half the pace), for the types
        with enough samples; empty while fewer than two types have them, so a one-type fleet
        ranks as if no speeds were known. Recomputed after new samples only."""
        if self._speeds is None:
            rates = {hw: t.rate_s() for hw, t in self._typed.items()}
            known = {hw: r for hw, r in rates.items() if r}
            fastest = min(known.values(), default=0.0)
            self._speeds = {hw: fastest / r for hw, r in known.items()} if len(known) >= 2 else {}
        return self._speeds


class TokenRatio:
    """Prompt tokens per prompt character, learned from the prefills' own answers.

    The gateway counts prompt work in tokens without the model's tokenizer: it starts from
    `initial` (about four characters a token for the usual tokenizers) and moves towards what
    the prefills report (``usage.prompt_tokens`` of each answer; stock vLLM reports it too),
    by an exponentially weighted average over characters, so long prompts weigh more. The
    same answers say how much of a prompt the prefill's cache held
    (``usage.prompt_tokens_details.cached_tokens``): `uncached_chars` turns that into the
    characters it computed, what its prefill time depends on."""

    __slots__ = ("_alpha", "_ratio")

    def __init__(self, initial: float = 0.25, alpha: float = 0.05) -> None:
        if initial <= 0 or not 0 < alpha <= 1:
            raise ValueError("initial > 0 and 0 < alpha <= 1 required")
        self._ratio = initial
        self._alpha = alpha

    @property
    def ratio(self) -> float:
        return self._ratio

    def observe(self, prompt_chars: int, usage: object) -> None:
        """A prefill answered a `prompt_chars` prompt with this ``usage`` object."""
        tokens = _prompt_tokens(usage)
        if tokens is None or prompt_chars <= 0:
            return
        # A single odd answer (a chat template's tokens on a tiny prompt) moves it little.
        seen = min(tokens / prompt_chars, 4.0)
        self._ratio += self._alpha * (seen - self._ratio)

    def tokens(self, chars: int) -> int:
        """Estimated tokens of `chars` characters of prompt (at least 1 for a prompt)."""
        return max(1, round(chars * self._ratio)) if chars > 0 else 0


def uncached_chars(prompt_chars: int, usage: object) -> int:
    """The characters of a prompt the prefill computed, by the share of its tokens the answer
    says were cached (all of them when it does not say)."""
    tokens = _prompt_tokens(usage)
    cached = cached_tokens(usage)
    if not tokens or not cached:
        return prompt_chars
    return round(prompt_chars * max(0.0, 1.0 - cached / tokens))


def cached_tokens(usage: object) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of an answer (None: not reported)."""
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if not isinstance(cached, int) or isinstance(cached, bool) or cached < 0:
        return None
    return cached


def _prompt_tokens(usage: object) -> int | None:
    tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens <= 0:
        return None
    return tokens


class QueueTimes:
    """One queue's measurements from its prefill calls, and their exchange with the fleet.

    `prefill_times` by prompt characters (early drop, the start guard, try timeouts),
    `compute_times` by the characters the prefill computed (batch forming, the hold-or-go
    choice, the hardware speeds), `token_ratio` tokens per character. Each gateway sends the
    fleet its own new samples (`samples_out`) and estimates with everyone's (`samples_in`);
    the queue's grants for the drain pace ride along (drain.py)."""

    __slots__ = ("compute_times", "prefill_times", "token_ratio")

    def __init__(self, quantile: float = 0.9) -> None:
        """`quantile`: of recent prefill rates, behind the early-drop estimate."""
        self.prefill_times = PrefillTimes(quantile=quantile)
        self.compute_times = PrefillTimes()
        self.token_ratio = TokenRatio()

    def record(self, prompt_chars: int, seconds: float, usage: object, hardware: str) -> None:
        """An accepted prefill call's share of its run took `seconds` on a prefill of
        `hardware` ("": undeclared), and it answered with this ``usage``."""
        self.prefill_times.record(prompt_chars, seconds, hardware=hardware)
        self.token_ratio.observe(prompt_chars, usage)
        computed = max(1, uncached_chars(prompt_chars, usage))
        self.compute_times.record(computed, seconds, hardware=hardware)

    def samples_out(self, grants: int) -> str:
        """This gateway's new samples and its `grants` since the last sync, packed ("":
        none)."""
        parts = [_sample("p", *x) for x in self.prefill_times.take_new()]
        parts += [_sample("c", *x) for x in self.compute_times.take_new()]
        if grants:
            parts.append(f"g {grants}")
        return ";".join(parts)

    def samples_in(self, packed: Sequence[str]) -> int:
        """The other gateways' samples (`samples_out` there); returns the grants they report.
        Malformed entries are skipped: another gateway's version may pack more, and an older
        one reads "g" as a malformed sample."""
        targets = {"p": self.prefill_times, "c": self.compute_times}
        granted = 0
        for entry in packed:
            for item in entry.split(";"):
                # "KIND CHARS SECONDS[ HARDWARE]"; an older gateway sends no hardware.
                # "g N": N grants since that gateway's last sync.
                kind, _, rest = item.partition(" ")
                if kind == "g":
                    with contextlib.suppress(ValueError):
                        granted += min(max(0, int(rest)), _MAX_GRANTS_REPORTED)
                    continue
                chars, _, rest = rest.partition(" ")
                secs, _, hardware = rest.partition(" ")
                target = targets.get(kind)
                try:
                    n, t, hw = int(chars), float(secs), hardware_name(hardware)
                except ValueError:
                    continue
                if target is not None and n >= 0 and t >= 0:
                    target.add_shared(n, t, hw)
        return granted


def _sample(kind: str, chars: int, seconds: float, hardware: str) -> str:
    """One measured sample as the fleet shares it (`QueueTimes.samples_in` reads it)."""
    sample = f"{kind} {chars} {seconds:.6g}"
    return f"{sample} {hardware}" if hardware else sample
