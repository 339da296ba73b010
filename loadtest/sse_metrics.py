"""Client-side timing of one OpenAI completions SSE stream: TTFT, ITL, TPOT, E2E, verdict.

Kept free of Locust so it can be unit-tested and reused: the locustfile feeds it each line
of the response as it arrives, with the time it arrived, then asks for the result.

* **TTFT**: request sent -> first event carrying text.
* **ITL** (inter-token latency): the gap between two consecutive events carrying text (an
  event may carry more than one token; vLLM and the shims send one per token).
* **TPOT** (time per output token): (E2E - TTFT) / (completion tokens - 1), with the token
  count from the ``usage`` chunk (``stream_options.include_usage``) when there is one, else
  from the number of text events.
* **E2E**: request sent -> ``data: [DONE]`` (or the end of the body).

A stream fails when it carries an in-band ``{"error": ...}`` chunk (pdgate sends one when a
stream breaks after it started), when it ends without ``data: [DONE]``, or when no text came.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson

__all__ = ["MAX_ITL_SAMPLES", "StreamResult", "StreamTimer"]

# Bounds the per-stream memory whatever max_tokens the workload asks for.
MAX_ITL_SAMPLES = 8192
_MAX_ERROR_CHARS = 200  # error messages are reported, truncated (they never carry prompts)
_DATA = b"data:"
_DONE = b"[DONE]"


@dataclass(slots=True)
class StreamResult:
    e2e_s: float
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    text_events: int = 0
    completion_tokens: int | None = None  # from the usage chunk
    done: bool = False
    error: str | None = None  # an in-band error chunk's message

    @property
    def output_tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else self.text_events

    @property
    def tpot_s(self) -> float | None:
        tokens = self.output_tokens
        if self.ttft_s is None or tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (tokens - 1)

    @property
    def failure(self) -> str | None:
        """Why the stream counts as failed, or None when it succeeded."""
        if self.error is not None:
            return f"in-band error: {self.error}"
        if not self.done:
            return "stream ended without data: [DONE]"
        if self.ttft_s is None:
            return "no text in the stream"
        return None


class StreamTimer:
    """Feed it the lines of one SSE body, in order, with their arrival times."""

    def __init__(self, start: float) -> None:
        self._start = start
        self._last_text: float | None = None
        self._result = StreamResult(e2e_s=0.0)

    def feed(self, line: bytes, now: float) -> None:
        line = line.strip()
        if not line.startswith(_DATA):
            return  # blank separators, comments (": ping"), event:/id: fields
        payload = line[len(_DATA) :].strip()
        result = self._result
        if payload == _DONE:
            result.done = True
            result.e2e_s = now - self._start
            return
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError:
            result.error = result.error or "malformed SSE data"
            return
        if not isinstance(chunk, dict):
            return
        if "error" in chunk:
            result.error = _error_message(chunk["error"])
            return
        usage = chunk.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            result.completion_tokens = usage["completion_tokens"]
        if _has_text(chunk):
            result.text_events += 1
            if result.ttft_s is None:
                result.ttft_s = now - self._start
            elif self._last_text is not None and len(result.itl_s) < MAX_ITL_SAMPLES:
                result.itl_s.append(now - self._last_text)
            self._last_text = now

    def finish(self, now: float) -> StreamResult:
        """The result; E2E is the [DONE] time if one came, else `now` (end of the body)."""
        if not self._result.done:
            self._result.e2e_s = now - self._start
        return self._result


def _has_text(chunk: dict[str, object]) -> bool:
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        return False
    return any(isinstance(c, dict) and c.get("text") for c in choices)


def _error_message(error: object) -> str:
    message = error.get("message") if isinstance(error, dict) else error
    return str(message)[:_MAX_ERROR_CHARS]
