"""Stop sequences over streamed text.

Text that could be the beginning of a stop sequence is held back until the next piece shows
whether the sequence completes, so a stream never emits text that a later match would have
cut off (vLLM behaves the same way).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    __slots__ = ("_held", "_stops")

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        """Text safe to emit after `piece`, and whether a stop sequence matched (the text is
        then everything before the match and the generation must end)."""
        if not self._stops:
            return piece, False
        buf = self._held + piece
        found = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if found:
            self._held = ""
            return buf[: min(found)], True
        keep = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(buf)), keep, -1):
                if buf.endswith(stop[:k]):
                    keep = k
                    break
        cut = len(buf) - keep
        self._held = buf[cut:]
        return buf[:cut], False

    def flush(self) -> str:
        """Held-back text, at the end of a generation that did not stop."""
        held, self._held = self._held, ""
        return held
