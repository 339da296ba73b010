"""What the client receives: its response's status, headers and body, as the relay hands
over the decode's events (gateway/stream/relay.py).

`StreamOut` and `WholeOut` answer in the API the request came in (completions or chat):
events go out as they are, or are assembled into one JSON answer. `ShapedStreamOut` and
`ShapedWholeOut` answer in another API (the Responses API, Anthropic Messages) whose
requests the gateway serves as chat requests (gateway/translate/): a `Shaper` turns the
chat events into that API's events or answer. The relay sees one interface, `ClientOut`.

Nothing goes out before the first event: until then a failure is still a real status.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import orjson
from starlette.types import Send

from pdgate.config.openai_api import OpenAIError
from pdgate.config.wire import SSE_DONE
from pdgate.gateway.errors import GatewayError
from pdgate.gateway.stream.assemble import Assembler

__all__ = [
    "SSE_HEADERS",
    "ClientOut",
    "Item",
    "ShapedStreamOut",
    "ShapedWholeOut",
    "Shaper",
    "StreamOut",
    "WholeOut",
    "response_headers",
]

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # tell nginx-style proxies in front not to buffer
]
# An event of the client's stream: parsed, and its bytes when it goes out unchanged (a
# stream's usual event is not parsed at all: its bytes alone, `Progress.passthrough_bytes`).
Item = tuple[dict[str, Any] | None, bytes | None]


def response_headers(
    request_id: str, prefill: str | None, decode: str | None
) -> list[tuple[bytes, bytes]]:
    """The request's id and the instances that served it (the decode is unknown when the
    first token went out early)."""
    out = [(b"x-request-id", request_id.encode("latin-1"))]
    for name, value in ((b"x-pdgate-prefill", prefill), (b"x-pdgate-decode", decode)):
        if value is not None:
            out.append((name, value.encode("latin-1")))
    return out


def sse(items: Sequence[Item]) -> bytes:
    if len(items) == 1:  # the usual chunk: one token's event
        event, raw = items[0]
        return b"data: " + (raw if raw is not None else orjson.dumps(event)) + b"\n\n"
    return b"".join(
        [
            b"data: " + (raw if raw is not None else orjson.dumps(event)) + b"\n\n"
            for event, raw in items
        ]
    )


class ClientOut(Protocol):
    """The client's response as the relay drives it."""

    send: Send
    started: bool  # the status went out: failures are in-band from now on
    prefill_id: str | None
    decode_id: str | None
    # Every event must reach `events` parsed (no bytes passed through past it).
    parsed: bool

    async def events(self, items: Sequence[Item]) -> None: ...

    async def done(self, items: Sequence[Item] = ()) -> None:
        """The last events, if any, and the end of the response."""
        ...

    async def error(self, error: GatewayError) -> None:
        """A failure: in-band once started (the response's end); raised before."""
        ...


class StreamOut:
    """The client's SSE response; its status and headers go out with the first event."""

    parsed = False

    def __init__(self, send: Send, request_id: str) -> None:
        self.send = send
        self._request_id = request_id
        self.started = False
        self.prefill_id: str | None = None
        self.decode_id: str | None = None

    async def raw(self, body: bytes, *, last: bool = False) -> None:
        if not self.started:
            self.started = True
            headers = SSE_HEADERS + response_headers(
                self._request_id, self.prefill_id, self.decode_id
            )
            await self.send({"type": "http.response.start", "status": 200, "headers": headers})
        await self.send({"type": "http.response.body", "body": body, "more_body": not last})

    async def events(self, items: Sequence[Item]) -> None:
        if self.started:  # every chunk but the first: straight to the client
            await self.send({"type": "http.response.body", "body": sse(items), "more_body": True})
        else:
            await self.raw(sse(items))

    async def done(self, items: Sequence[Item] = ()) -> None:
        """The last events, if any, and ``[DONE]``: one send, the response's last."""
        await self.raw(sse(items) + SSE_DONE if items else SSE_DONE, last=True)

    async def error(self, error: GatewayError) -> None:
        await self.raw(error.sse() + SSE_DONE, last=True)

    async def end(self) -> None:
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})


class WholeOut:
    """A non-streaming client's answer, assembled from every leg's events."""

    parsed = True

    def __init__(self, send: Send, request_id: str, client_ids: bool) -> None:
        self.send = send
        self._request_id = request_id
        self._client_ids = client_ids
        self.assembler = Assembler()
        self.started = False  # nothing goes out before the answer is whole
        self.prefill_id: str | None = None
        self.decode_id: str | None = None

    async def events(self, items: Sequence[Item]) -> None:
        for event, _ in items:
            assert event is not None  # only a stream's events go out unparsed
            self.assembler.add(event)

    async def done(self, items: Sequence[Item] = ()) -> None:
        await self.events(items)
        answer = self.assembler.result()
        answer["id"] = self._request_id  # one id: a stock decode answers with its own
        if not self._client_ids:
            answer.pop("prompt_token_ids", None)
            for choice in answer.get("choices") or ():
                choice.pop("prompt_token_ids", None)
                choice.pop("token_ids", None)
        await self._answer(orjson.dumps(answer))

    async def _answer(self, body: bytes) -> None:
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            *response_headers(self._request_id, self.prefill_id, self.decode_id),
        ]
        self.started = True
        await self.send({"type": "http.response.start", "status": 200, "headers": headers})
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    async def error(self, error: GatewayError) -> None:
        raise error  # never started: the endpoint answers with the error's status


class Shaper(Protocol):
    """One request's answer in another API, made from the chat events of its internal chat
    request (gateway/translate/)."""

    def start(self, first: dict[str, Any]) -> bytes:
        """A stream's opening events, sent with those of its `first` chunk."""
        ...

    def chunk(self, event: dict[str, Any]) -> bytes:
        """One chat chunk as the API's events (b"" for none)."""
        ...

    async def finish(self) -> bytes:
        """A stream's closing events; what the answer leaves behind (a stored response) is
        written before they go out."""
        ...

    def fail(self, error: OpenAIError) -> bytes:
        """A stream's in-band failure: its last events."""
        ...

    async def whole(self, answer: dict[str, Any]) -> dict[str, Any]:
        """The assembled chat completion as the API's answer (written before it goes out,
        as `finish`)."""
        ...


class ShapedStreamOut(StreamOut):
    """A stream in the shaper's API: every chat event parsed and reshaped."""

    parsed = True

    def __init__(self, send: Send, request_id: str, shaper: Shaper) -> None:
        super().__init__(send, request_id)
        self._shaper = shaper

    def _body(self, items: Sequence[Item]) -> bytes:
        shaper = self._shaper
        out = [] if self.started or not items else [shaper.start(items[0][0] or {})]
        for event, _ in items:
            assert event is not None
            out.append(shaper.chunk(event))
        return b"".join(out)

    async def events(self, items: Sequence[Item]) -> None:
        if body := self._body(items):
            await self.raw(body)

    async def done(self, items: Sequence[Item] = ()) -> None:
        body = self._body(items)
        if not self.started and not items:
            body = self._shaper.start({})
        await self.raw(body + await self._shaper.finish(), last=True)

    async def error(self, error: GatewayError) -> None:
        if not self.started:
            raise error
        await self.raw(self._shaper.fail(error), last=True)


class ShapedWholeOut(WholeOut):
    """One answer in the shaper's API, from the whole chat completion."""

    def __init__(self, send: Send, request_id: str, shaper: Shaper) -> None:
        super().__init__(send, request_id, client_ids=False)
        self._shaper = shaper

    async def done(self, items: Sequence[Item] = ()) -> None:
        await self.events(items)
        answer = await self._shaper.whole(self.assembler.result())
        await self._answer(orjson.dumps(answer))
