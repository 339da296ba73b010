"""`MockUpstream`: an in-memory `Upstream` for tests, as httpx's `MockTransport` is for its
transports. A handler function answers each call (a batch call: each of its requests), and
the answers go through the same rules as `HttpUpstream`'s (`BaseUpstream`: 429 ->
`UpstreamRejected`, other non-200 -> `UpstreamStatus`, a prefill answer without
``kv_transfer_params`` -> `UpstreamProtocolError`), so code tested against it behaves the
same over HTTP. It keeps every call (`calls`, `batches`) and decode stream (`streams`),
unless told not to (``record=False``: a benchmark's thousands of requests).

    async def handler(call: Call) -> Reply:
        if call.leg == "prefill":
            return Reply(json={"choices": [...], "kv_transfer_params": {...}})
        return Reply(chunks=[b'data: {...}\\n\\n', b"data: [DONE]\\n\\n"])

    upstream = MockUpstream(handler)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from pdgate.gateway.errors import DecodeSilent, UpstreamStatus, UpstreamUnreachable
from pdgate.gateway.upstream.base import BaseUpstream, Call

__all__ = ["Call", "MockUpstream", "Reply"]


@dataclass
class Reply:
    status: int = 200
    json: dict[str, Any] | None = None
    chunks: Sequence[bytes] = ()  # a decode's stream
    chunk_delay_s: float = 0.0
    # The instance dies after sending this many chunks (the stream raises UpstreamUnreachable).
    fail_after: int | None = None
    # ... by going silent on every stream: the stall watchdog's `DecodeSilent` instead.
    silent: bool = False
    # The connection fails before any answer (refused, reset, timed out).
    unreachable: bool = False


Handler = Callable[[Call], Awaitable[Reply]]


@dataclass
class _MockStream:
    url: str
    reply: Reply
    closed: bool = False
    sent: int = 0  # chunks read so far

    async def read(self, size: int) -> bytes:
        """One chunk of the reply per call (`size` is the caller's cap; the test's chunks
        are what it means to send)."""
        reply = self.reply
        if self.closed:
            return b""
        if reply.fail_after is not None and self.sent >= min(reply.fail_after, len(reply.chunks)):
            if reply.silent:
                raise DecodeSilent(self.url, "decode silent on every stream")
            raise UpstreamUnreachable(self.url, "connection lost mid-stream")
        if self.sent >= len(reply.chunks):
            return b""
        if reply.chunk_delay_s:
            await asyncio.sleep(reply.chunk_delay_s)
        self.sent += 1
        return reply.chunks[self.sent - 1]

    def at_eof(self) -> bool:
        # A stream that fails at its end still has its failure to deliver.
        return self.sent >= len(self.reply.chunks) and self.reply.fail_after is None

    def close(self) -> None:
        self.closed = True


@dataclass
class MockUpstream(BaseUpstream):
    handler: Handler
    batch_endpoint: bool = True  # False: the batch endpoint answers 404 (a stock server)
    calls: list[Call] = field(default_factory=list)
    batches: list[list[Call]] = field(default_factory=list)  # each batch call's prefill legs
    streams: list[_MockStream] = field(default_factory=list)
    record: bool = True
    # What every KV release answers in its admission header (None: none, as a stock server).
    admission: str | None = None

    async def _answer(self, call: Call) -> Reply:
        if self.record:
            self.calls.append(call)
        reply = await self.handler(call)
        if reply.unreachable:
            raise UpstreamUnreachable(call.url, "connection refused")
        return reply

    async def _post(self, call: Call, timeout_s: float) -> tuple[int, bytes]:
        try:
            async with asyncio.timeout(timeout_s):
                reply = await self._answer(call)
        except TimeoutError as exc:
            raise UpstreamUnreachable(call.url + call.path, "TimeoutError") from exc
        return reply.status, orjson.dumps(reply.json or {})

    async def _post_batch(
        self, url: str, calls: list[Call], timeout_s: float
    ) -> AsyncIterator[bytes]:
        if self.record:
            self.batches.append(calls)
        if not self.batch_endpoint:
            raise UpstreamStatus(url, 404, b"{}")
        tasks = [asyncio.ensure_future(self._answer(c)) for c in calls]
        try:
            for index, task in enumerate(tasks):
                reply = await task
                yield orjson.dumps(
                    {"index": index, "status": reply.status, "body": reply.json or {}}
                )
        finally:
            for task in tasks:
                task.cancel()

    async def _open(self, call: Call, connect_timeout_s: float) -> _MockStream | tuple[int, bytes]:
        # As the HTTP client: the answer's headers are due within the connect timeout.
        try:
            async with asyncio.timeout(max(connect_timeout_s, 0.001)):
                reply = await self._answer(call)
        except TimeoutError as exc:
            raise UpstreamUnreachable(call.url + call.path, "TimeoutError") from exc
        if reply.status != 200:
            return reply.status, orjson.dumps(reply.json or {})
        stream = _MockStream(call.url + call.path, reply)
        if self.record:
            self.streams.append(stream)
        return stream

    async def _delete(self, url: str, request_id: str) -> str | None:
        if self.record:
            self.calls.append(Call("release", url, None, request_id))
        return self.admission

    async def aclose(self) -> None:
        return None

    def released(self) -> list[str]:
        """URLs of every KV release sent."""
        return [c.url for c in self.calls if c.leg == "release"]
