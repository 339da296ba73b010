"""Chat events as a vLLM decode streams them, for the shapers' unit tests."""

from __future__ import annotations

from typing import Any

import orjson

from pdgate.engine_shim._completion import usage as usage_of

HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}


def chunk(delta: dict[str, Any], finish: str | None = None, **choice: Any) -> dict[str, Any]:
    return {
        **HEAD,
        "choices": [
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, **choice}
        ],
    }


def usage(prompt: int, completion: int, cached: int | None = None) -> dict[str, Any]:
    return {**HEAD, "choices": [], "usage": usage_of(prompt, completion, cached)}


def text_stream(*pieces: str, finish: str = "stop", prompt: int = 7) -> list[dict[str, Any]]:
    """A text answer: the role, one chunk per piece, the finish, the usage."""
    events = [chunk({"role": "assistant", "content": ""})]
    events += [chunk({"content": p}) for p in pieces]
    events.append(chunk({}, finish))
    events.append(usage(prompt, len(pieces)))
    return events


def tool_stream(
    name: str, *fragments: str, text: str = "", finish: str = "tool_calls"
) -> list[dict[str, Any]]:
    """A tool call as vLLM streams it: text first if any, then the call's head (id, name,
    empty arguments), then its argument fragments."""
    events = [chunk({"role": "assistant", "content": ""})]
    if text:
        events.append(chunk({"content": text}))
    events.append(
        chunk(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "call_abc",
                        "type": "function",
                        "function": {"name": name, "arguments": ""},
                    }
                ]
            }
        )
    )
    events += [
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": f}}]}) for f in fragments
    ]
    events.append(chunk({}, finish))
    events.append(usage(9, 3 + len(fragments)))
    return events


def whole_of(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The stream put together as the relay's assembler does for a non-streaming client."""
    from pdgate.gateway.stream.assemble import Assembler

    assembler = Assembler()
    for event in events:
        assembler.add(event)
    return assembler.result()


async def shaped(shaper: Any, events: list[dict[str, Any]]) -> bytes:
    """A whole stream as the shaper answers it: its opening, every event's, its close."""
    body = shaper.start(events[0]) + b"".join(shaper.chunk(e) for e in events)
    return bytes(body + await shaper.finish())


def named_events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of every event of a typed SSE stream; the name must be the data's
    type."""
    out = []
    for block in raw.decode().split("\n\n"):
        if block:
            name_line, data_line = block.split("\n")
            data = orjson.loads(data_line.removeprefix("data: "))
            assert data["type"] == name_line.removeprefix("event: ")
            out.append((data["type"], data))
    return out
