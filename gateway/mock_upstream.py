"""`MockUpstream`: an in-memory `Upstream` for tests, as httpx's `MockTransport` is for its
transports. A handler function answers each call; the fake applies the same rules as
`HttpUpstream` (429 -> `UpstreamRejected`, other non-200 -> `UpstreamStatus`, a prefill answer
without ``kv_transfer_params`` -> `UpstreamProtocolError`), so code tested against it behaves
the same over HTTP.

    async def handler(call: Call) -> Reply:
        if call.leg == "prefill":
            return Reply(json={"choices": [...], "kv_transfer_params": {...}})
        return Reply(chunks=[b'data: {...}\\n\\n', b"data: [DONE]\\n\\n"])

    upstream = MockUpstream(handler)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from pdgate.config.wire import BATCH_SUFFIX, COMPLETIONS_PATH, kv_release_url, kv_url
from pdgate.gateway.errors import UpstreamRejected, UpstreamStatus, UpstreamUnreachable
from pdgate.gateway.upstream import prefill_reply

__all__ = ["Call", "MockUpstream", "Reply"]

Leg = Literal["prefill", "decode", "release"]


@dataclass(frozen=True)
class Call:
    leg: Leg
    url: str  # the instance's base URL (release: the KV's full URL)
    body: dict[str, Any] | None
    request_id: str
    kv_id: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    path: str = COMPLETIONS_PATH  # the API the call went to (release: none)


@dataclass
class Reply:
    status: int = 200
    json: dict[str, Any] | None = None
    chunks: Sequence[bytes] = ()  # a decode's stream
    chunk_delay_s: float = 0.0
    # The instance dies after sending this many chunks (the stream raises UpstreamUnreachable).
    fail_after: int | None = None
    # The connection fails before any answer (refused, reset, timed out).
    unreachable: bool = False


Handler = Callable[[Call], Awaitable[Reply]]


@dataclass
class _MockStream:
    url: str
    reply: Reply
    closed: bool = False

    async def chunks(self, size: int) -> AsyncIterator[bytes]:
        for sent, chunk in enumerate(self.reply.chunks):
            if self.closed:
                return
            if self.reply.fail_after is not None and sent >= self.reply.fail_after:
                raise UpstreamUnreachable(self.url, "connection lost mid-stream")
            if self.reply.chunk_delay_s:
                await asyncio.sleep(self.reply.chunk_delay_s)
            yield chunk
        if self.reply.fail_after is not None and self.reply.fail_after >= len(self.reply.chunks):
            raise UpstreamUnreachable(self.url, "connection lost mid-stream")

    def close(self) -> None:
        self.closed = True


@dataclass
class MockUpstream:
    handler: Handler
    batch_endpoint: bool = True  # False: the batch endpoint answers 404 (a stock server)
    calls: list[Call] = field(default_factory=list)
    streams: list[_MockStream] = field(default_factory=list)

    async def _answer(self, call: Call) -> Reply:
        self.calls.append(call)
        reply = await self.handler(call)
        if reply.unreachable:
            raise UpstreamUnreachable(call.url, "connection refused")
        return reply

    async def prefill(
        self,
        base_url: str,
        body: dict[str, Any],
        *,
        request_id: str,
        timeout_s: float,
        kv_id: str | None = None,
        headers: Mapping[str, str] | None = None,
        path: str = COMPLETIONS_PATH,
    ) -> dict[str, Any]:
        url = base_url + path
        call = Call("prefill", base_url, body, request_id, kv_id, dict(headers or {}), path)
        try:
            async with asyncio.timeout(timeout_s):
                reply = await self._answer(call)
        except TimeoutError as exc:
            raise UpstreamUnreachable(url, "TimeoutError") from exc
        raw = orjson.dumps(reply.json or {})
        if reply.status == 429:
            raise UpstreamRejected(url, "no free prefill slot")
        if reply.status != 200:
            raise UpstreamStatus(url, reply.status, raw)
        return prefill_reply(url, raw)

    async def prefill_batch(
        self,
        base_url: str,
        bodies: list[dict[str, Any]],
        *,
        kv_ids: list[str],
        request_id: str,
        timeout_s: float,
        headers: Mapping[str, str] | None = None,
        path: str = COMPLETIONS_PATH,
    ) -> AsyncIterator[tuple[int, int, dict[str, Any]]]:
        if not self.batch_endpoint:
            raise UpstreamStatus(base_url + path + BATCH_SUFFIX, 404, b"{}")
        calls = [
            Call("prefill", base_url, body, request_id, kv_id, dict(headers or {}), path)
            for body, kv_id in zip(bodies, kv_ids, strict=True)
        ]
        tasks = [asyncio.ensure_future(self._answer(c)) for c in calls]
        try:
            for index, task in enumerate(tasks):
                reply = await task
                yield index, reply.status, reply.json or {}
        finally:
            for task in tasks:
                task.cancel()

    async def open_decode(
        self,
        base_url: str,
        body: dict[str, Any],
        *,
        request_id: str,
        connect_timeout_s: float,
        headers: Mapping[str, str] | None = None,
        path: str = COMPLETIONS_PATH,
    ) -> _MockStream:
        call = Call("decode", base_url, body, request_id, None, dict(headers or {}), path)
        reply = await self._answer(call)
        url = base_url + path
        if reply.status == 429:
            raise UpstreamRejected(url, "no free decode slot")
        if reply.status != 200:
            raise UpstreamStatus(url, reply.status, orjson.dumps(reply.json or {}))
        stream = _MockStream(url, reply)
        self.streams.append(stream)
        return stream

    async def release_kv_id(self, base_url: str, kv_id: str, *, request_id: str) -> None:
        self.calls.append(Call("release", kv_release_url(base_url, kv_id), None, request_id))

    async def release_kv(self, kv_params: dict[str, Any], *, request_id: str) -> None:
        url = kv_url(kv_params)
        if url is not None:
            self.calls.append(Call("release", url, None, request_id))

    async def aclose(self) -> None:
        return None

    def released(self) -> list[str]:
        """URLs of every KV release sent."""
        return [c.url for c in self.calls if c.leg == "release"]
