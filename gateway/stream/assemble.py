"""A whole OpenAI response assembled from a decode's SSE stream (for non-streaming clients).

The decode leg always streams (gateway/placement/decode_leg.py), so a client that asked for one JSON
answer gets the chunks put together the way OpenAI's own clients accumulate a stream: text
and message fields concatenated, logprobs lists joined, tool-call fragments merged by index
(a message with calls and no text has null content, as a whole answer does),
``token_ids`` (vLLM's ``return_token_ids``) joined, the first event's ``prompt_token_ids``,
the last finish reason and the usage chunk kept.
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["Assembler", "StreamError", "one_event", "parse_event", "sse_events"]

_CHUNK_OBJECTS = {"text_completion": "text_completion", "chat.completion.chunk": "chat.completion"}
# Choice fields merged across chunks (the rest keep their first non-null value).
_MERGED = frozenset({"index", "text", "delta", "logprobs", "finish_reason", "token_ids"})


class StreamError(Exception):
    """The stream carried an in-band error event, or an event that is not OpenAI JSON."""

    def __init__(self, message: str, body: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.body = body


def one_event(chunk: bytes) -> bytes | None:
    """The data of `chunk` if it is exactly one whole one-line data event (its only newlines
    the two at its end), as vLLM and pdgate's shims send a token; None otherwise. A few C
    calls."""
    if (
        chunk.endswith(b"\n\n")
        and chunk.find(b"\n") == len(chunk) - 2
        and chunk.startswith(b"data:")
        and b"\r" not in chunk
    ):
        return chunk[5:-2].lstrip(b" ")
    return None


def sse_events(buffer: bytearray) -> list[bytes]:
    """Pop every complete event's data from `buffer` (``data: ...`` lines of events ended by
    a blank line); comments (``: ping``) and other fields are dropped. (A chunk that is one
    whole event needs no buffer: `one_event`.)"""
    out: list[bytes] = []
    # Either line ending: pdgate and vLLM send "\n\n", other servers "\r\n\r\n".
    crlf = b"\r" in buffer
    if not crlf:
        # The usual case, in C: every whole event at once (this runs for every chunk of
        # every stream the relay parses).
        end = buffer.rfind(b"\n\n")
        if end < 0:
            return out
        whole = bytes(buffer[:end])
        del buffer[: end + 2]
        for event in whole.split(b"\n\n"):
            if event.startswith(b"data:") and b"\n" not in event:
                out.append(event[5:].lstrip(b" "))
            elif data := [ln[5:].lstrip(b" ") for ln in event.split(b"\n") if ln[:5] == b"data:"]:
                out.append(b"\n".join(data))
        return out
    start = 0
    while True:
        cut, sep = buffer.find(b"\n\n", start), 2
        if crlf:
            other = buffer.find(b"\r\n\r\n", start)
            if other >= 0 and (cut < 0 or other < cut):
                cut, sep = other, 4
        if cut < 0:
            break
        event = bytes(buffer[start:cut])
        start = cut + sep
        if event.startswith(b"data:") and b"\n" not in event:
            out.append(event[5:].lstrip(b" "))  # the usual event: one data line
            continue
        data = [line[5:].lstrip(b" ") for line in event.splitlines() if line.startswith(b"data:")]
        if data:
            out.append(b"\n".join(data))
    if start:
        del buffer[:start]
    return out


def parse_event(data: bytes) -> dict[str, Any]:
    """One event's data as a JSON object; raises `StreamError` for anything else."""
    try:
        event = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise StreamError("the decode sent an event that is not JSON") from None
    if not isinstance(event, dict):
        raise StreamError("the decode sent an event that is not a JSON object")
    return event


def _merge_logprobs(into: dict[str, Any] | None, part: Any) -> dict[str, Any] | None:
    if not isinstance(part, dict):
        return into
    if into is None:
        into = {}
    for key, value in part.items():
        if isinstance(value, list):
            into.setdefault(key, []).extend(value)
        elif key not in into:
            into[key] = value
    return into


def _merge_tool_calls(calls: list[dict[str, Any]], deltas: list[Any]) -> None:
    for delta in deltas:
        if not isinstance(delta, dict):
            continue
        index = int(delta.get("index", len(calls)))
        while len(calls) <= index:
            calls.append(
                {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
            )
        call = calls[index]
        if delta.get("id"):
            call["id"] = delta["id"]
        if delta.get("type"):
            call["type"] = delta["type"]
        fn = delta.get("function") or {}
        if isinstance(fn, dict):
            if fn.get("name"):
                call["function"]["name"] += fn["name"]
            if fn.get("arguments"):
                call["function"]["arguments"] += fn["arguments"]


class _Choice:
    __slots__ = (
        "extra",
        "finish_reason",
        "logprobs",
        "message",
        "text",
        "token_ids",
        "tool_calls",
    )

    def __init__(self) -> None:
        self.token_ids: list[Any] | None = None  # each chunk carries its tokens' ids
        self.text: list[str] = []
        self.message: dict[str, Any] = {}
        self.tool_calls: list[dict[str, Any]] = []
        self.logprobs: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.extra: dict[str, Any] = {}


class Assembler:
    """Feed it a stream's events (`feed`) and ``[DONE]``; `result()` is the whole answer."""

    def __init__(self) -> None:
        self._head: dict[str, Any] | None = None
        self._choices: dict[int, _Choice] = {}
        self._usage: Any = None
        self.done = False
        self.events = 0

    def feed(self, data: bytes) -> None:
        """One event's data. Raises `StreamError` for an in-band error or bad JSON."""
        if data.strip() == b"[DONE]":
            self.done = True
            return
        event = parse_event(data)
        if "error" in event:
            err = event["error"]
            message = err.get("message") if isinstance(err, dict) else None
            raise StreamError(str(message or "the decode failed"), event)
        self.add(event)

    def add(self, event: dict[str, Any]) -> None:
        """One event already parsed (and checked for an error)."""
        self.events += 1
        if self._head is None:
            self._head = {k: v for k, v in event.items() if k not in ("choices", "usage")}
        if event.get("usage") is not None:
            self._usage = event["usage"]
        for raw in event.get("choices") or ():
            if isinstance(raw, dict):
                self._feed_choice(raw)

    def _feed_choice(self, raw: dict[str, Any]) -> None:
        choice = self._choices.setdefault(int(raw.get("index", 0)), _Choice())
        if isinstance(raw.get("text"), str):
            choice.text.append(raw["text"])
        delta = raw.get("delta")
        if isinstance(delta, dict):
            for key, value in delta.items():
                if key == "tool_calls" and isinstance(value, list):
                    _merge_tool_calls(choice.tool_calls, value)
                elif isinstance(value, str):
                    choice.message[key] = (
                        value if key == "role" else choice.message.get(key, "") + value
                    )
                elif value is not None and key not in choice.message:
                    choice.message[key] = value
        choice.logprobs = _merge_logprobs(choice.logprobs, raw.get("logprobs"))
        if raw.get("finish_reason") is not None:
            choice.finish_reason = raw["finish_reason"]
        if isinstance(ids := raw.get("token_ids"), list):
            if choice.token_ids is None:
                choice.token_ids = []
            choice.token_ids.extend(ids)
        for key, value in raw.items():
            if key not in _MERGED and (value is not None or key not in choice.extra):
                choice.extra[key] = value

    def result(self) -> dict[str, Any]:
        if self._head is None:
            raise StreamError("the decode's stream ended without a completion")
        out = dict(self._head)
        chat = out.get("object") == "chat.completion.chunk"
        out["object"] = _CHUNK_OBJECTS.get(str(out.get("object")), out.get("object"))
        choices = []
        for index in sorted(self._choices):
            c = self._choices[index]
            item: dict[str, Any] = {"index": index}
            if chat:
                message = {"role": "assistant", "content": None, **c.message}
                if c.tool_calls:
                    message["tool_calls"] = c.tool_calls
                    # The role's chunk carries "" as content; a call with no text before
                    # it has null content in a whole answer (OpenAI's and the shims').
                    message["content"] = message["content"] or None
                item["message"] = message
            else:
                item["text"] = "".join(c.text)
            item["logprobs"] = c.logprobs
            item["finish_reason"] = c.finish_reason
            item.update(c.extra)
            if c.token_ids is not None:
                item["token_ids"] = c.token_ids
            choices.append(item)
        out["choices"] = choices
        out["usage"] = self._usage
        return out
