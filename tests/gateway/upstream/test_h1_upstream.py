"""`H1Upstream`, pdgate's own HTTP/1.1 client, against real servers on real sockets: it keeps
and reuses connections only when an answer was read whole and both sides keep it alive,
closes them on every other path, holds at most its limit open, and turns every socket-level
failure into `UpstreamUnreachable`.

The server here is a small asyncio one whose answers the tests script byte for byte, so the
framings engines use (content-length, chunked, until the server closes) and the failures
(a server that closes idle connections, one that closes mid-answer, one that never answers)
are each exercised."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest

from pdgate.gateway.errors import UpstreamProtocolError, UpstreamStatus, UpstreamUnreachable
from pdgate.gateway.upstream.base import UpstreamOptions
from pdgate.gateway.upstream.h1 import H1Upstream

PREFILL_ANSWER = orjson.dumps({"id": "cmpl-1", "choices": [], "kv_transfer_params": {"k": 1}})


def _sized(body: bytes, status: str = "200 OK", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        status.encode(),
        len(body),
        extra,
        body,
    )


def _chunked(*parts: bytes) -> bytes:
    out = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    for part in parts:
        out += b"%x\r\n%s\r\n" % (len(part), part)
    return out + b"0\r\n\r\n"


@dataclass
class Server:
    """Answers each request with what `answer(head)` returns (None: nothing, for now)."""

    answer: Callable[[bytes], bytes | None]
    url: str = ""
    connections: int = 0  # accepted so far
    open: set[asyncio.Transport] = field(default_factory=set)
    requests: list[bytes] = field(default_factory=list)
    close_after_answer: bool = False


class _Handler(asyncio.Protocol):
    def __init__(self, server: Server) -> None:
        self.server = server
        self.buf = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.server.connections += 1
        self.server.open.add(transport)  # type: ignore[arg-type]

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.open.discard(self.transport)  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (end := self.buf.find(b"\r\n\r\n")) >= 0:
            head = self.buf[:end]
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(self.buf) < end + 4 + length:
                return
            self.buf = self.buf[end + 4 + length :]
            self.server.requests.append(head)
            answer = self.server.answer(head)
            if answer is not None:
                self.transport.write(answer)  # type: ignore[attr-defined]
                if self.server.close_after_answer:
                    self.transport.close()


Answer = Callable[[bytes], bytes | None]
Serve = Callable[[Answer], Awaitable[Server]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """Starts servers on free ports; each one's connections are cut at the end."""
    made: list[tuple[Server, asyncio.Server]] = []

    async def start(answer: Answer) -> Server:
        state = Server(answer)
        srv = await asyncio.get_running_loop().create_server(
            lambda: _Handler(state), "127.0.0.1", 0
        )
        state.url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
        made.append((state, srv))
        return state

    yield start
    for state, srv in made:
        for transport in list(state.open):
            transport.close()
        srv.close()
        await srv.wait_closed()


def _upstream(keepalive_s: float = 4.0, **options: Any) -> H1Upstream:
    defaults: dict[str, Any] = {
        "connections": 8,
        "connect_timeout_s": 1.0,
        "read_timeout_s": 5.0,
        "header_timeout_s": 1.0,
    }
    return H1Upstream(UpstreamOptions(**{**defaults, **options}), keepalive_s=keepalive_s)


async def _prefill(upstream: H1Upstream, url: str, **kw: object) -> dict[str, object]:
    return await upstream.prefill(url, {"prompt": "hi"}, request_id="r1", timeout_s=2, **kw)  # type: ignore[arg-type]


async def test_sequential_calls_share_one_connection_and_send_the_headers(serve: Serve) -> None:
    server = await serve(lambda head: _sized(PREFILL_ANSWER))
    upstream = _upstream(headers={"authorization": "Bearer tok"})
    try:
        for _ in range(5):
            reply = await _prefill(upstream, server.url, kv_id="kv-1", headers={"traceparent": "t"})
            assert reply["kv_transfer_params"] == {"k": 1}
        assert server.connections == 1
        head = server.requests[0].decode().lower()
        assert head.startswith("post /v1/completions http/1.1")
        for line in ("authorization: bearer tok", "x-request-id: r1", "traceparent: t"):
            assert line in head
        assert "x-pdgate-kv-id: kv-1" in head or "kv-1" in head
        assert f"host: {server.url.removeprefix('http://')}" in head
    finally:
        await upstream.aclose()


async def test_an_error_answer_keeps_the_connection_and_carries_its_body(serve: Serve) -> None:
    error = orjson.dumps({"error": {"message": "bad prompt"}})
    server = await serve(lambda head: _sized(error, "400 Bad Request"))
    upstream = _upstream()
    try:
        for _ in range(3):
            with pytest.raises(UpstreamStatus) as info:
                await _prefill(upstream, server.url)
            assert info.value.status == 400 and b"bad prompt" in info.value.body
        assert server.connections == 1
    finally:
        await upstream.aclose()


async def test_a_chunked_stream_read_to_its_end_returns_the_connection(serve: Serve) -> None:
    events = (b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n")
    server = await serve(lambda head: _chunked(*events))
    upstream = _upstream()
    try:
        for _ in range(3):
            stream = await upstream.open_decode(server.url, {}, request_id="r", connect_timeout_s=1)
            got = b""
            while chunk := await stream.read(4096):
                got += chunk
            assert got == b"".join(events)
            assert stream.at_eof()
            stream.close()
        assert server.connections == 1
        assert upstream.open_connections == 1
    finally:
        await upstream.aclose()


async def test_a_stream_closed_before_its_end_closes_its_connection(serve: Serve) -> None:
    # The answer's end never comes: the client left mid-stream.
    server = await serve(lambda head: _chunked(b"data: 1\n\n")[:-5])
    upstream = _upstream()
    try:
        for _ in range(2):
            stream = await upstream.open_decode(server.url, {}, request_id="r", connect_timeout_s=1)
            assert await stream.read(4096) == b"data: 1\n\n"
            stream.close()
        assert server.connections == 2  # the half-read one was not reused
        await asyncio.sleep(0.05)
        assert upstream.open_connections == 0
    finally:
        await upstream.aclose()


async def test_a_server_that_dies_mid_stream_is_an_unreachable_upstream(serve: Serve) -> None:
    server = await serve(lambda head: _chunked(b"data: 1\n\n")[:-5])
    server.close_after_answer = True
    upstream = _upstream()
    try:
        stream = await upstream.open_decode(server.url, {}, request_id="r", connect_timeout_s=1)
        assert await stream.read(4096) == b"data: 1\n\n"
        with pytest.raises(UpstreamUnreachable, match="mid-answer"):
            await stream.read(4096)
        assert upstream.open_connections == 0
    finally:
        await upstream.aclose()


async def test_a_body_that_runs_until_the_server_closes_is_read_whole(serve: Serve) -> None:
    server = await serve(lambda head: b"HTTP/1.0 200 OK\r\n\r\n" + PREFILL_ANSWER)
    server.close_after_answer = True
    upstream = _upstream()
    try:
        for _ in range(2):
            assert (await _prefill(upstream, server.url))["kv_transfer_params"] == {"k": 1}
        assert server.connections == 2
    finally:
        await upstream.aclose()


async def test_a_connection_the_server_closed_while_idle_is_not_used_again(serve: Serve) -> None:
    server = await serve(lambda head: _sized(PREFILL_ANSWER))
    upstream = _upstream()
    try:
        await _prefill(upstream, server.url)
        for transport in list(server.open):
            transport.close()  # the server's keep-alive timeout
        await asyncio.sleep(0.05)
        assert upstream.open_connections == 0
        await _prefill(upstream, server.url)
        assert server.connections == 2
    finally:
        await upstream.aclose()


async def test_connection_close_from_the_server_is_honoured(serve: Serve) -> None:
    server = await serve(lambda head: _sized(PREFILL_ANSWER, extra=b"connection: close\r\n"))
    upstream = _upstream()
    try:
        for _ in range(3):
            await _prefill(upstream, server.url)
        assert server.connections == 3
        await asyncio.sleep(0.05)
        assert upstream.open_connections == 0
    finally:
        await upstream.aclose()


async def test_an_answer_over_the_limit_is_refused_and_its_connection_closed(serve: Serve) -> None:
    server = await serve(lambda head: _sized(b"x" * 5000))
    upstream = _upstream(max_response_bytes=4096)
    try:
        with pytest.raises(UpstreamProtocolError, match="larger than 4096"):
            await _prefill(upstream, server.url)
        await asyncio.sleep(0.05)
        assert upstream.open_connections == 0
    finally:
        await upstream.aclose()


async def test_a_server_that_never_answers_times_out_and_is_disconnected(
    serve: Serve,
) -> None:
    server = await serve(lambda head: None)
    # Only the call's own timeouts can end a call before the test's time limit.
    upstream = _upstream(read_timeout_s=600, header_timeout_s=600)
    try:
        with pytest.raises(UpstreamUnreachable, match="TimeoutError"):
            await upstream.prefill(server.url, {}, request_id="r", timeout_s=0.3)
        with pytest.raises(UpstreamUnreachable, match="TimeoutError"):
            await upstream.open_decode(server.url, {}, request_id="r", connect_timeout_s=0.3)
        await asyncio.sleep(0.05)
        assert upstream.open_connections == 0 and not server.open
    finally:
        await upstream.aclose()


async def test_a_cancelled_call_does_not_leave_its_answer_for_the_next(serve: Serve) -> None:
    answers = iter([None, _sized(b'{"kv_transfer_params": {"n": 2}}')])
    server = await serve(lambda head: next(answers))
    upstream = _upstream()
    try:
        task = asyncio.create_task(_prefill(upstream, server.url))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (await _prefill(upstream, server.url))["kv_transfer_params"] == {"n": 2}
        assert server.connections == 2
    finally:
        await upstream.aclose()


async def test_no_more_connections_than_the_limit_and_every_call_is_answered(serve: Serve) -> None:
    server = await serve(lambda head: _sized(PREFILL_ANSWER))
    upstream = _upstream(connections=2)
    try:
        replies = await asyncio.gather(*[_prefill(upstream, server.url) for _ in range(10)])
        assert len(replies) == 10
        assert server.connections <= 2
        assert upstream.open_connections <= 2
    finally:
        await upstream.aclose()


async def test_at_the_limit_an_idle_connection_to_another_instance_makes_room(serve: Serve) -> None:
    first = await serve(lambda head: _sized(PREFILL_ANSWER))
    second = await serve(lambda head: _sized(PREFILL_ANSWER))
    upstream = _upstream(connections=1)
    try:
        await _prefill(upstream, first.url)
        await asyncio.wait_for(_prefill(upstream, second.url), 2)
        await asyncio.sleep(0.05)
        assert not first.open and len(second.open) == 1
    finally:
        await upstream.aclose()


async def test_a_refused_connection_is_an_unreachable_upstream() -> None:
    upstream = _upstream()
    try:
        with pytest.raises(UpstreamUnreachable):
            await _prefill(upstream, "http://127.0.0.1:9")
        assert upstream.open_connections == 0
    finally:
        await upstream.aclose()


async def test_batch_lines_arrive_one_by_one(serve: Serve) -> None:
    lines = [orjson.dumps({"index": i, "status": 200, "body": {"i": i}}) + b"\n" for i in range(3)]
    server = await serve(lambda head: _chunked(lines[0] + lines[1][:5], lines[1][5:], lines[2]))
    upstream = _upstream()
    try:
        got = [
            item
            async for item in upstream.prefill_batch(
                server.url, [{}, {}, {}], kv_ids=["a", "b", "c"], request_id="r", timeout_s=2
            )
        ]
        assert got == [(i, 200, {"i": i}) for i in range(3)]
        assert b"POST /v1/completions/batch" in server.requests[0]
        assert upstream.open_connections == 1
    finally:
        await upstream.aclose()


async def test_a_header_value_that_would_end_its_line_is_not_sent(serve: Serve) -> None:
    server = await serve(lambda head: _sized(PREFILL_ANSWER))
    upstream = _upstream()
    try:
        with pytest.raises(ValueError, match="cannot be sent"):
            await _prefill(upstream, server.url, headers={"traceparent": "a\r\nx-evil: 1"})
        assert not server.requests
    finally:
        await upstream.aclose()


async def test_a_stream_silent_past_the_read_timeout_is_given_up(serve: Serve) -> None:
    # Headers, then nothing: not started, so only the read timeout applies (the stall limit
    # is past the test's time limit anyway).
    server = await serve(lambda head: b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
    upstream = _upstream(read_timeout_s=0.4, stall_timeout_s=600)
    try:
        stream = await upstream.open_decode(server.url, {}, request_id="r", connect_timeout_s=1)
        with pytest.raises(UpstreamUnreachable, match="no data for"):
            await stream.read(1024)
    finally:
        await upstream.aclose()


async def test_a_long_stream_read_slowly_arrives_whole(serve: Serve) -> None:
    # Far more than the client buffers before it stops reading the socket: reading resumes
    # as the reader catches up, and nothing is lost or reordered.
    parts = [bytes([65 + i % 26]) * 65536 for i in range(48)]
    server = await serve(lambda head: _chunked(*parts))
    upstream = _upstream()
    try:
        stream = await upstream.open_decode(server.url, {}, request_id="r", connect_timeout_s=1)
        got = bytearray()
        while chunk := await stream.read(16384):
            got += chunk
            await asyncio.sleep(0)
        assert bytes(got) == b"".join(parts)
        assert server.connections == 1 and upstream.open_connections == 1
    finally:
        await upstream.aclose()


async def test_a_connection_idle_past_the_keepalive_time_is_closed_not_reused(
    serve: Serve,
) -> None:
    server = await serve(lambda head: _sized(PREFILL_ANSWER))
    upstream = _upstream(keepalive_s=0.2)
    try:
        await _prefill(upstream, server.url)
        await asyncio.sleep(0.5)
        assert upstream.open_connections == 0 and not server.open  # closed while idle
        await _prefill(upstream, server.url)
        assert server.connections == 2
    finally:
        await upstream.aclose()
