"""The client side of an OpenAI completions SSE stream: one module for every benchmark.

Two readers of the same format, for two kinds of client:

* `post_stream` (aiohttp; the scheduling, gateway-cost and soak benchmarks) does as little
  work per byte as possible, because the load generator shares two cores with what it
  measures: the stream is not parsed. It looks for the first token event (``data: {"id"``
  in OpenAI's chunk layout, which an in-band error ``data: {"error"`` is not), for an
  in-band error and for ``data: [DONE]``, and counts ``data:`` events, carrying a few bytes
  across chunk boundaries so a marker split between two reads is still found. The
  Responses API's and Anthropic's streams have markers of their own (`Dialect`: a text
  delta, a failure, the last event).
* `StreamTimer` (the Locust user, which gets the body line by line from requests) parses
  every event, for inter-token latency, TPOT and the usage chunk:

  - **TTFT**: request sent -> first event carrying text;
  - **ITL**: the gap between two consecutive events carrying text;
  - **TPOT**: (E2E - TTFT) / (completion tokens - 1), tokens from the ``usage`` chunk
    (``stream_options.include_usage``) when there is one, else the number of text events;
  - **E2E**: request sent -> ``data: [DONE]`` (or the end of the body).

Either way a stream fails when it carries an in-band ``{"error": ...}`` chunk (pdgate sends
one when a stream breaks after it started) or ends without ``data: [DONE]``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp
import orjson

__all__ = [
    "MAX_ITL_SAMPLES",
    "MESSAGES",
    "OPENAI",
    "PREFILL_HEADER",
    "PRIORITY_HEADER",
    "RESPONSES",
    "TENANT_HEADER",
    "TTFT_HEADER",
    "Dialect",
    "StreamOutcome",
    "StreamResult",
    "StreamTimer",
    "post_stream",
    "retry_after_s",
    "tpot_s",
]

TTFT_HEADER = "x-pdgate-ttft-timeout-ms"  # the gateway may only shorten its deadline by it
# Who a request is for and its priority class (high | normal | low), for the gateway's
# per-tenant fairness and priority classes.
TENANT_HEADER = "x-pdgate-tenant"
PRIORITY_HEADER = "x-pdgate-priority"
PREFILL_HEADER = "x-pdgate-prefill"  # the prefill that served the request, as pdgate says

_DATA = b"data:"
_JSON = {"content-type": "application/json"}


@dataclass(frozen=True, slots=True)
class Dialect:
    """What marks a token, a failure and the end in one API's stream. `count`: the marker
    counted once per token event."""

    token: bytes
    error: bytes
    done: bytes
    count: bytes

    @property
    def carry(self) -> int:
        return max(len(self.token), len(self.error), len(self.done)) - 1


# OpenAI's completions and chat: each event is a chunk; tokens are counted as data events.
OPENAI = Dialect(b'data: {"id"', b'data: {"error"', b"data: [DONE]", _DATA)
# The Responses API and Anthropic Messages (gateway/translate/): typed events.
RESPONSES = Dialect(
    b"event: response.output_text.delta",
    b"event: response.failed",
    b"event: response.completed",
    b"event: response.output_text.delta",
)
MESSAGES = Dialect(
    b"event: content_block_delta",
    b"event: error",
    b"event: message_stop",
    b"event: content_block_delta",
)


@dataclass(slots=True)
class StreamOutcome:
    """What one streaming request did, as seen by the client."""

    status: int = 0  # HTTP status; 0 when no response came (connection failed)
    ttft_s: float | None = None  # request sent -> first token event
    events: int = 0  # data events before [DONE]
    done: bool = False  # saw data: [DONE]
    errored: bool = False  # saw an in-band error event
    end: float = 0.0  # time.monotonic() when the response (or the failure) ended
    retry_after_s: float | None = None  # a refusal's Retry-After, in seconds
    prefill: str = ""  # the prefill pdgate says served it (x-pdgate-prefill; "": none)

    @property
    def completed(self) -> bool:
        """Ended with [DONE] and carried no in-band error."""
        return self.status == 200 and self.done and not self.errored


async def _scan(
    resp: aiohttp.ClientResponse, start: float, out: StreamOutcome, dialect: Dialect
) -> None:
    token, error, done, count = dialect.token, dialect.error, dialect.done, dialect.count
    carry = dialect.carry
    # A whole marker cannot fit in this carry, so counting in carry + chunk never counts one
    # twice.
    count_carry = len(count) - 1
    tail = b""
    data_tail = b""
    events = 0
    try:
        async for chunk in resp.content.iter_any():
            window = tail + chunk
            if out.ttft_s is None and token in window:
                out.ttft_s = time.monotonic() - start
            if error in window:
                out.errored = True
            if done in window:
                out.done = True
            tail = window[-carry:]
            counted = data_tail + chunk
            events += counted.count(count)
            data_tail = counted[-count_carry:]
    finally:  # a stream that broke still says how far it got
        # OpenAI's [DONE] is a data event too.
        out.events = events - (out.done and count is _DATA)


async def post_stream(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    *,
    headers: Mapping[str, str] | None = None,
    client_timeout: aiohttp.ClientTimeout | None = None,
    start: float | None = None,
    dialect: Dialect = OPENAI,
) -> StreamOutcome:
    """POST a streaming completion and read the answer to its end. Never raises for what the
    server or the network does: a failure is in the outcome (status 0, no [DONE], ...).
    TTFT counts from `start` (a ``time.monotonic()``; default: now), e.g. from an earlier
    leg of the same request. `client_timeout`: aiohttp's, default the session's. `dialect`:
    the API whose stream it is (OpenAI's by default)."""
    out = StreamOutcome()
    start = time.monotonic() if start is None else start
    try:
        async with session.post(
            url, data=body, headers={**_JSON, **(headers or {})}, timeout=client_timeout
        ) as resp:
            out.status = resp.status
            if resp.status != 200:
                out.retry_after_s = retry_after_s(resp.headers)
                await resp.read()
            else:
                out.prefill = resp.headers.get(PREFILL_HEADER, "")
                await _scan(resp, start, out, dialect)
    except (aiohttp.ClientError, TimeoutError, OSError):
        out.done = False
    out.end = time.monotonic()
    return out


def retry_after_s(headers: Mapping[str, str]) -> float | None:
    """The wait a refusal tells, in seconds, read as the OpenAI clients read it:
    ``retry-after-ms`` first, then ``Retry-After`` (None: neither, or an HTTP date, which
    the gateway never sends)."""
    for name, scale in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            return max(0.0, float(value) / scale)
        except ValueError:
            continue
    return None


def tpot_s(e2e_s: float, ttft_s: float | None, tokens: int) -> float | None:
    """TPOT: the time after the first token over the tokens after it (None: fewer than 2)."""
    if ttft_s is None or tokens < 2:
        return None
    return (e2e_s - ttft_s) / (tokens - 1)


# -- the line parser (Locust) --------------------------------------------------------------

# Bounds the per-stream memory whatever max_tokens the workload asks for.
MAX_ITL_SAMPLES = 8192
_MAX_ERROR_CHARS = 200  # error messages are reported, truncated (they never carry prompts)
_DONE_PAYLOAD = b"[DONE]"


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
        return tpot_s(self.e2e_s, self.ttft_s, self.output_tokens)

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
        if payload == _DONE_PAYLOAD:
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
