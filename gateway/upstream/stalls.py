"""When a decode stream has stalled, judged from its decode's own pace.

A running decode sends a token every few milliseconds to a few tens; a fixed bound of
seconds lets a stopped one hold its streams for all of them. So each decode's waits for data
(the time a relay's read of one of its started streams waited before data came) are kept,
the last `_GAPS` of them, and a started stream is stalled once its read has waited `factor`
times their `quantile`, within [`floor_s`, `ceiling_s`]. Until `min_samples` of its waits
are known (a decode new to this gateway) the waits of all decodes judge it, and until there
are that many of those, `ceiling_s`. The quantile is of the decode's reads, whatever the
stream: one decode's batch sets every stream's pace.

A decode none of whose streams has had data within its bound has stopped answering as a
whole (stopped, hung, cut off): every stream on it is given up at once, the ones still
waiting for their first data included, and the error says so (`DecodeSilent`) so that the
relay ejects the decode, instead of each stream finding out at its own pace.

One timer for all streams (each transport's `Watchdog` calls `stalled`): a timer per read would
cost every token of every stream. What a read costs here is one append to its decode's
window (`DecodePace.heard`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from pdgate.config.aio import cancel_and_wait
from pdgate.gateway.errors import DecodeSilent, UpstreamUnreachable

__all__ = [
    "DecodePace",
    "StallBound",
    "StallWatch",
    "Watched",
    "stall_error",
]

log = logging.getLogger("pdgate.upstream")

# Waits kept per decode: enough for a 0.99 quantile to mean something, few enough to follow
# a decode whose batch grows.
_GAPS = 512
# Decodes with a pace kept: they come from the registry, this is a backstop.
_MAX_DECODES = 4096


@dataclass(frozen=True, slots=True)
class StallBound:
    """A started stream is stalled after waiting `factor` x the `quantile` of its decode's
    recent waits for data, at least `floor_s`, at most `ceiling_s` (and `ceiling_s` until
    `min_samples` waits are known)."""

    floor_s: float = 1.0
    ceiling_s: float = 5.0
    factor: float = 8.0
    quantile: float = 0.99
    min_samples: int = 20

    def __post_init__(self) -> None:
        if not 0 < self.floor_s <= self.ceiling_s:
            raise ValueError("need 0 < floor_s <= ceiling_s")
        if self.factor < 1 or not 0 < self.quantile <= 1 or self.min_samples < 1:
            raise ValueError("need factor >= 1, 0 < quantile <= 1 and min_samples >= 1")


class DecodePace:
    """One decode's recent waits for data, as its streams' reads saw them; with `every`, the
    pace of all decodes, which each one's waits also go to (a decode that has not streamed
    enough yet is judged by it)."""

    __slots__ = ("_every", "_waits", "heard_at")

    def __init__(self, every: DecodePace | None = None) -> None:
        self._waits: deque[float] = deque(maxlen=_GAPS)
        self._every = every
        self.heard_at = 0.0  # monotonic: the last data from any of its streams

    def heard(self, waited_s: float | None, now: float) -> None:
        """A read of one of its streams got data after waiting `waited_s` (None: a stream's
        first data, whose wait was the KV's pull, not the decode's pace)."""
        if waited_s is not None:
            self._waits.append(waited_s)
            if self._every is not None:
                self._every._waits.append(waited_s)
        self.heard_at = now

    def limit_s(self, bound: StallBound) -> float:
        """The bound of its streams: from its own waits, else all decodes', else the
        ceiling."""
        waits = self._waits
        if len(waits) < bound.min_samples and self._every is not None:
            waits = self._every._waits
        n = len(waits)
        if n < bound.min_samples:
            return bound.ceiling_s
        q = sorted(waits)[min(n - 1, int(bound.quantile * n))]
        return min(bound.ceiling_s, max(bound.floor_s, bound.factor * q))


def stall_error(url: str, silent_s: float, *, whole: bool) -> UpstreamUnreachable:
    """What the read of a stream given up raises."""
    if whole:
        return DecodeSilent(url, f"decode silent on every stream: no data for {silent_s:.1f} s")
    return UpstreamUnreachable(url, f"decode stalled: no data for {silent_s:.1f} s")


class Watched(Protocol):
    """A decode stream as the watchdog sees it (each transport's stream)."""

    @property
    def url(self) -> str: ...

    @property
    def closed(self) -> bool: ...

    def silent_s(self, now: float, *, started_only: bool) -> float: ...

    def stall(self, silent_s: float, *, whole: bool = False) -> None: ...


class PacedStream:
    """What each transport's decode stream keeps for the watchdog: when the read in progress
    began, whether data came yet, its decode's pace, and whether (and how) it was given up.
    A transport's stream times each read (`_waiting_since`, then `_heard` when data came)
    and says whether it is `closed` and how to `close`."""

    __slots__ = ("__weakref__", "_started", "_waiting_since", "pace", "stalled", "url", "whole")

    def __init__(self, url: str, pace: DecodePace) -> None:
        self.url = url
        self._started = False  # data came: the decode holds the KV and is generating
        self._waiting_since = 0.0  # monotonic start of the read in progress (0: none)
        self.pace = pace  # its decode's, shared by that decode's streams
        self.stalled = 0.0  # > 0: given up after this many seconds of silence
        self.whole = False  # given up with every stream of its decode

    @property
    def closed(self) -> bool:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def _heard(self, since: float) -> None:
        """The read begun at `since` got data."""
        now = time.monotonic()
        self.pace.heard(now - since if self._started else None, now)
        self._started = True

    def _stalled(self) -> UpstreamUnreachable:
        return stall_error(self.url, self.stalled, whole=self.whole)

    def silent_s(self, now: float, *, started_only: bool = True) -> float:
        """How long the reader has been kept waiting (0: not waiting; with `started_only`,
        also 0 before the first data: a decode may be pulling KV or queueing)."""
        if (started_only and not self._started) or not self._waiting_since or self.closed:
            return 0.0
        return now - self._waiting_since

    def stall(self, silent_s: float, *, whole: bool = False) -> None:
        """Give up on it: the read in progress raises (the request moves to another decode),
        and the dropped connection tells the decode, if it ever wakes, that nobody listens."""
        self.stalled, self.whole = max(silent_s, 1e-3), whole
        self.close()


class StallWatch:
    """The watchdog's judgement, shared by the transports: `bound` for started streams
    (None: no stall detection), `read_timeout_s` for any stream."""

    def __init__(
        self,
        bound: StallBound | None,
        read_timeout_s: float,
        *,
        fixed_s: float | None = None,
    ) -> None:
        """`fixed_s` without `bound`: a fixed bound of that many seconds, whatever the pace."""
        if bound is None and fixed_s is not None:
            bound = StallBound(floor_s=fixed_s, ceiling_s=fixed_s)
        self._bound = bound
        self._read_timeout_s = read_timeout_s
        self._paces: dict[str, DecodePace] = {}
        self._every = DecodePace()  # all decodes' waits

    @property
    def period_s(self) -> float:
        """How often the watchdog looks: a stall is seen within half the floor."""
        floor = self._bound.floor_s if self._bound is not None else 4.0
        return min(1.0, self._read_timeout_s / 4, floor / 2)

    def pace(self, url: str) -> DecodePace:
        """The pace of the decode `url` is on (its streams share it)."""
        url = _origin(url)
        pace = self._paces.get(url)
        if pace is None:
            if len(self._paces) >= _MAX_DECODES:
                del self._paces[next(iter(self._paces))]
            pace = self._paces[url] = DecodePace(self._every)
        return pace

    def stalled(self, streams: Iterable[Watched], now: float | None = None) -> list[str]:
        """Give up the streams that waited too long; the URLs of the decodes found silent as
        a whole (every stream on them given up)."""
        now = time.monotonic() if now is None else now
        bound = self._bound
        by_url: dict[str, list[Watched]] = {}
        for stream in streams:
            if not stream.closed:
                by_url.setdefault(_origin(stream.url), []).append(stream)
        silent_decodes: list[str] = []
        for url, open_streams in by_url.items():
            pace = self._paces.get(url)
            if bound is not None:
                limit = pace.limit_s(bound) if pace is not None else bound.ceiling_s
                late = [
                    (s, silent)
                    for s in open_streams
                    if (silent := s.silent_s(now, started_only=True)) > limit
                ]
                heard = pace.heard_at if pace is not None else 0.0
                if late and now - heard > limit:
                    # Nothing from this decode on any stream for longer than its bound.
                    log.warning("decode %s silent on all %d streams for %.1f s: moving them on",
                                url, len(open_streams), now - heard)  # fmt: skip
                    for s in open_streams:
                        s.stall(now - heard, whole=True)
                    silent_decodes.append(url)
                    continue
                for s, silent in late:
                    log.warning("decode %s stalled (%.1f s without data, bound %.2f s): "
                                "moving on", url, silent, limit)  # fmt: skip
                    s.stall(silent)
            for s in open_streams:
                silent = s.silent_s(now, started_only=False)
                if not s.closed and silent > self._read_timeout_s:
                    log.warning("decode %s silent for %.1f s (upstream_read_timeout_s)", url,
                                silent)  # fmt: skip
                    s.stall(silent)
        return silent_decodes


_S = TypeVar("_S", bound=PacedStream)


class Watchdog:
    """A transport's one timer: every `StallWatch.period_s`, while any stream it was given
    is open, it gives up the streams that kept the relay waiting too long (`stalled`)."""

    def __init__(self, watch: StallWatch) -> None:
        self.watch = watch
        self.streams: weakref.WeakSet[PacedStream] = (
            weakref.WeakSet()
        )  # open, or not yet seen closed
        self._task: asyncio.Task[None] | None = None

    def add(self, stream: _S) -> _S:
        """Watch `stream` (the timer runs only while some stream is open)."""
        self.streams.add(stream)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="stall-watchdog")
        return stream

    async def aclose(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])

    async def _run(self) -> None:
        while self.streams:
            await asyncio.sleep(self.watch.period_s)
            for stream in [s for s in self.streams if s.closed]:
                self.streams.discard(stream)
            self.watch.stalled(list(self.streams))


def _origin(url: str) -> str:
    """The decode a stream's URL is on: scheme, host and port (its path is the API's)."""
    return "/".join(url.split("/", 3)[:3])
