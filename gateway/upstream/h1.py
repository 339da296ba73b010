"""`H1Upstream`: the `Upstream` seam over pdgate's own HTTP/1.1 client: keep-alive
connections on asyncio transports, answers parsed by httptools (the parser uvicorn uses).

Why a client of our own: a call to an engine is one small POST and one answer, framed by
``content-length`` or chunked, on a connection kept open. aiohttp's client spends about
100 us of CPU on such a call (building a request object, yarl URLs, header multidicts,
timer contexts, a stream reader, tracing hooks) where the exchange itself needs about 20: two
calls a request made it the largest share of the gateway's CPU (docs/results/performance).
This module does what an engine call needs and nothing else: no redirects, cookies,
proxies, compression or HTTP/2. `HttpUpstream` (aiohttp) stays, ``upstream_client =
"aiohttp"``, for anything this one lacks.

A connection serves one exchange at a time. It goes back to the pool only when its answer
was read to the end and both sides keep it alive; any other end (an error, a timeout, a
cancelled call, a stream closed early) closes it. The pool opens at most `limit` connections
at once; past that a call waits for one, within its connect timeout.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import ssl
import time
from collections.abc import AsyncIterator, Mapping
from typing import cast
from urllib.parse import urlsplit

import httptools
import orjson

from pdgate.config.wire import (
    ADMISSION_HEADER,
    DECODE_MAX_TOKENS_HEADER,
    KV_ID_HEADER,
    REQUEST_ID_HEADER,
)
from pdgate.gateway.errors import UpstreamProtocolError, UpstreamUnreachable
from pdgate.gateway.upstream.base import (
    BaseUpstream,
    Call,
    SocketErrors,
    UpstreamOptions,
    batch_body,
    status_error,
)
from pdgate.gateway.upstream.stalls import DecodePace, PacedStream, StallWatch, Watchdog

__all__ = ["H1Upstream"]

log = logging.getLogger("pdgate.upstream")

_RELEASE_TIMEOUT_S = 2.0
# Body bytes held for a reader before the socket stops being read (a slow client of a fast
# decode), and the level under which reading resumes.
_HIGH_WATER = 256 * 1024
_LOW_WATER = 64 * 1024
# An idle connection is used again only this soon: under the 5 s after which uvicorn (and so
# vLLM and the shims) closes one, so a call never goes out on a connection the server is
# closing at that moment (a POST that cannot be safely sent again).
_KEEPALIVE_S = 4.0
_MAX_TARGETS = 4096  # parsed URLs kept (instances x APIs; KV releases are not kept)
_USER_AGENT = "pdgate"
_ADMISSION = ADMISSION_HEADER.encode()

_Key = tuple[str, str, int]  # scheme, host, port: which connections may serve a URL


class _Broken(ConnectionError):
    """The connection ended or misbehaved in the middle of an exchange."""


class _Target:
    """A parsed URL: the pool key, the request line's target and the Host header."""

    __slots__ = ("host", "key", "path")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UpstreamProtocolError(url, "not an http(s) URL")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        self.key: _Key = (parts.scheme, parts.hostname, port)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.path = target.encode("ascii")
        self.host = parts.netloc.rsplit("@", 1)[-1].encode("ascii")


def _header_block(headers: Mapping[str, str]) -> bytes:
    """``name: value\\r\\n`` lines; a value that would end the line early is refused."""
    out = []
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
            raise ValueError(f"header {name!r} cannot be sent")
        out.append(f"{name}: {value}\r\n")
    return "".join(out).encode("latin-1")


class _Connection(asyncio.Protocol):
    """One keep-alive connection and the answer being read on it. httptools calls the
    ``on_*`` methods from `data_received`."""

    def __init__(self, pool: _Pool, key: _Key) -> None:
        self._pool = pool
        self.key = key
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[None] | None = None
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False
        self._keep_alive = False
        # One exchange's state, set afresh by each `send` (`_begin`).
        self._busy = False  # an exchange is under way
        self._status: int | None = None
        self._framed = False  # content-length or chunked: the end is in the bytes, not EOF
        self._complete = False
        self._error: str | None = None  # why the answer cannot be read further
        self.admission: bytes | None = None  # a KV release's ADMISSION_HEADER
        self.closed = False
        self.counted = False  # counts against the pool's limit (from connect until closed)
        self.idle_since = 0.0

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but are one.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if not self._busy or self._complete:
            # Bytes nobody asked for: the connection cannot be trusted with the next call.
            self.close()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"malformed answer: {exc}")
            self.close()

    def eof_received(self) -> bool | None:
        return None  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        ours = self.closed  # we closed it: whatever was being read is cut short
        self.closed = True
        if self._busy and not self._complete and self._error is None:
            if self._status is not None and not self._framed and exc is None and not ours:
                self._complete = True  # a body that runs until the server closes
                self._keep_alive = False
            else:
                self._fail("the instance closed the connection mid-answer")
        self._wake()
        self._pool.gone(self)

    # httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        lower = name.lower()
        if lower == b"content-length" or (
            lower == b"transfer-encoding" and b"chunked" in value.lower()
        ):
            self._framed = True
        elif lower == _ADMISSION:
            self.admission = value

    def on_headers_complete(self) -> None:
        self._status = self._parser.get_status_code()
        self._keep_alive = self._parser.should_keep_alive()
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > _HIGH_WATER and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self._complete = True
        self._wake()

    # the exchange

    def send(self, head: bytes, body: bytes) -> None:
        if self.closed or self._transport is None or self._transport.is_closing():
            raise _Broken("the connection closed before the call was sent")
        self._begin()
        self._transport.writelines((head, body))

    def _begin(self) -> None:
        """A new exchange on this (kept-alive) connection: nothing of the last one's answer
        counts for it."""
        self._busy = True
        self._status = None
        self._framed = False
        self._complete = False
        self._error = None
        self.admission = None

    async def status(self) -> int:
        while self._status is None:
            await self._wait()
        return self._status

    async def read(self, size: int) -> bytes:
        """What has arrived of the body, up to `size` bytes; ``b""`` at its end."""
        while not self._chunks:
            if self._complete:
                return b""
            await self._wait()
        chunks = self._chunks
        first = chunks.popleft()
        if len(first) > size:
            chunks.appendleft(first[size:])
            first = first[:size]
        elif chunks and len(first) + len(chunks[0]) <= size:
            # Several events waiting: one read, one write to the client.
            parts = [first]
            taken = len(first)
            while chunks and taken + len(chunks[0]) <= size:
                part = chunks.popleft()
                parts.append(part)
                taken += len(part)
            first = b"".join(parts)
        self._consumed(len(first))
        return first

    async def readline(self, limit: int) -> bytes:
        """The body's next line (with its ``\\n``; the rest at the end); ``b""`` at its end."""
        line = bytearray()
        while True:
            while not self._chunks:
                if self._complete:
                    return bytes(line)
                await self._wait()
            chunk = self._chunks.popleft()
            end = chunk.find(b"\n")
            if end >= 0 and end + 1 < len(chunk):
                self._chunks.appendleft(chunk[end + 1 :])
                chunk = chunk[: end + 1]
            self._consumed(len(chunk))
            line += chunk
            if end >= 0:
                return bytes(line)
            if len(line) > limit:
                raise _Broken(f"a line longer than {limit} bytes")

    def _consumed(self, size: int) -> None:
        self._buffered -= size
        if self._paused and self._buffered < _LOW_WATER and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()

    @property
    def at_eof(self) -> bool:
        return self._complete and not self._chunks

    @property
    def reusable(self) -> bool:
        return (
            not self.closed
            and self._keep_alive
            and self._complete
            and not self._chunks
            and self._transport is not None
            and not self._transport.is_closing()
        )

    def done(self) -> None:
        """The exchange is over: back to the pool if the connection can serve another."""
        self._busy = False
        if self.reusable:
            self._pool.put(self)
        else:
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self._transport is not None:
                self._transport.close()
        if self._busy and not self._complete:
            self._fail("the connection was closed mid-answer")
        self._pool.gone(self)

    async def _wait(self) -> None:
        # A new exception each time: one raised again and again would grow its traceback.
        if self._error is not None:
            raise _Broken(self._error)
        if self.closed:
            raise _Broken("the connection is closed")
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self._error is not None:
            raise _Broken(self._error)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, error: str) -> None:
        if self._error is None:
            self._error = error
        self._wake()


class _Pool:
    """Keep-alive connections by (scheme, host, port), at most `limit` open at once."""

    def __init__(self, limit: int, keepalive_s: float) -> None:
        self._limit = limit
        self._keepalive_s = keepalive_s
        self._idle: dict[_Key, list[_Connection]] = {}
        self._open = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._ssl: ssl.SSLContext | None = None
        self._prune: asyncio.TimerHandle | None = None
        self._closing = False

    @property
    def open(self) -> int:
        return self._open

    def idle(self, key: _Key) -> _Connection | None:
        """An idle connection to `key` still fit to use, if there is one."""
        idle = self._idle.get(key)
        if not idle or self._closing:
            return None
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if self._fit(conn, now):
                return conn
            conn.close()
        return None

    def _fit(self, conn: _Connection, now: float) -> bool:
        """Still fit to reuse: both sides kept it alive, and it has been idle for less than
        the keep-alive time (under the servers' own, so none is closing it as we send)."""
        return conn.reusable and now - conn.idle_since < self._keepalive_s

    async def get(self, key: _Key) -> _Connection:
        """A connection to `key`: an idle one, or a new one once the limit allows."""
        while True:
            if self._closing:
                raise _Broken("the upstream client is closed")
            conn = self.idle(key)
            if conn is not None:
                return conn
            if self._open < self._limit:
                return await self._connect(key)
            if not self._close_one_idle():
                await self._wait_for_room()

    def put(self, conn: _Connection) -> None:
        if self._closing:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.key, []).append(conn)
        if self._waiters:
            self._wake_one()  # it may be waiting for this host
        if self._prune is None:
            self._prune = asyncio.get_running_loop().call_later(self._keepalive_s, self._pruned)

    def gone(self, conn: _Connection) -> None:
        """`conn` closed (called once or more; counted once)."""
        if conn.counted:
            conn.counted = False
            self._open -= 1
            self._wake_one()

    async def close(self) -> None:
        self._closing = True
        if self._prune is not None:
            self._prune.cancel()
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
        await asyncio.sleep(0)  # let the transports finish closing

    async def _connect(self, key: _Key) -> _Connection:
        scheme, host, port = key
        self._open += 1
        loop = asyncio.get_running_loop()
        try:
            if scheme == "https":
                if self._ssl is None:
                    self._ssl = ssl.create_default_context()
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, key), host, port, ssl=self._ssl
                )
            else:
                _, conn = await loop.create_connection(lambda: _Connection(self, key), host, port)
        except BaseException:
            self._open -= 1
            self._wake_one()
            raise
        conn.counted = True  # the place taken above is the connection's now
        return conn

    def _close_one_idle(self) -> bool:
        """At the limit with idle connections to other hosts: close the oldest of them."""
        oldest: _Connection | None = None
        for conns in self._idle.values():
            if conns and (oldest is None or conns[0].idle_since < oldest.idle_since):
                oldest = conns[0]
        if oldest is None:
            return False
        self._idle[oldest.key].remove(oldest)
        oldest.close()
        return True

    async def _wait_for_room(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self._wake_one()  # woken as we gave up: pass it on
            else:
                waiter.cancel()
            raise

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _pruned(self) -> None:
        """Close connections idle longer than the keep-alive time (an instance that left
        would otherwise keep them)."""
        self._prune = None
        now = time.monotonic()
        for key in list(self._idle):
            conns = self._idle[key]
            kept = []
            for conn in conns:
                if self._fit(conn, now):
                    kept.append(conn)
                else:
                    conn.close()
            if kept:
                self._idle[key] = kept
            else:
                del self._idle[key]
        if self._idle and not self._closing:
            self._prune = asyncio.get_running_loop().call_later(self._keepalive_s, self._pruned)


class _Stream(PacedStream):
    """`DecodeStream` over a connection whose answer is a 200 being read."""

    __slots__ = ("_conn", "_guard", "closed")

    closed: bool  # a plain flag here: set by `close`

    def __init__(self, conn: _Connection, url: str, pace: DecodePace) -> None:
        super().__init__(url, pace)
        self._conn = conn
        self._guard = SocketErrors(url)
        self.closed = False

    async def read(self, size: int) -> bytes:
        if self.closed:
            if self.stalled:
                raise self._stalled()
            return b""
        self._waiting_since = since = time.monotonic()
        try:
            with self._guard:
                data = await self._conn.read(size)
        except UpstreamUnreachable:
            if self.stalled:
                raise self._stalled() from None
            self.close()
            raise
        except BaseException:
            self.close()  # cancelled mid-read: the rest of the answer is nobody's
            raise
        finally:
            self._waiting_since = 0.0
        if data:
            self._heard(since)
        else:
            self.close()  # read to the end: the connection goes back to the pool
        return data

    def at_eof(self) -> bool:
        return self.closed or self._conn.at_eof

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self._conn.at_eof:
                self._conn.done()  # read to the end: the connection serves the next call
            else:
                self._conn.close()


class H1Upstream(BaseUpstream):
    def __init__(self, options: UpstreamOptions, *, keepalive_s: float = _KEEPALIVE_S) -> None:
        """A started decode stream silent for `options.stall_timeout_s` (or, with
        `options.stall_bound`, for as long as its decode's pace says: stalls.py) is given up,
        and any stream silent for `options.read_timeout_s`; an idle connection is used again
        only within `keepalive_s`."""
        self._pool = _Pool(options.connections, keepalive_s)
        self._connect_timeout_s = options.connect_timeout_s
        self._read_timeout_s = options.read_timeout_s
        self._header_timeout_s = options.header_timeout_s
        self._stalls = StallWatch(
            options.stall_bound, options.read_timeout_s, fixed_s=options.stall_timeout_s
        )
        self._max_response_bytes = options.max_response_bytes
        base = {"content-type": "application/json", "user-agent": _USER_AGENT, **options.headers}
        self._headers = _header_block(base)
        self._by_instance = {
            url: _header_block({**base, **extra}) for url, extra in options.instance_headers.items()
        }
        self._targets: dict[str, _Target] = {}
        self._watchdog = Watchdog(self._stalls)

    def __repr__(self) -> str:
        return f"H1Upstream({self._pool.open} connections open)"

    @classmethod
    def connect(cls, options: UpstreamOptions) -> H1Upstream:
        """The same call as `HttpUpstream.connect` (nothing opens until the first call)."""
        return cls(options)

    @property
    def open_connections(self) -> int:
        return self._pool.open

    async def aclose(self) -> None:
        await self._watchdog.aclose()
        for stream in list(self._watchdog.streams):
            stream.close()
        await self._pool.close()

    def _target(self, url: str) -> _Target:
        target = self._targets.get(url)
        if target is None:
            if len(self._targets) >= _MAX_TARGETS:
                self._targets.clear()
            target = self._targets[url] = _Target(url)
        return target

    def _head(self, method: bytes, target: _Target, base: bytes, extra: bytes, size: int) -> bytes:
        return b"%s %s HTTP/1.1\r\nhost: %s\r\n%s%scontent-length: %d\r\n\r\n" % (
            method,
            target.path,
            target.host,
            base,
            extra,
            size,
        )

    def _call_head(self, call: Call, target: _Target, size: int) -> bytes:
        extra = {**call.headers, REQUEST_ID_HEADER: call.request_id}
        if call.kv_id is not None:
            extra[KV_ID_HEADER] = call.kv_id
        base = self._by_instance.get(call.url, self._headers)
        return self._head(b"POST", target, base, _header_block(extra), size)

    async def _read_limited(self, conn: _Connection, url: str) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while chunk := await conn.read(1 << 20):
            size += len(chunk)
            if size > self._max_response_bytes:
                raise UpstreamProtocolError(
                    url, f"answer larger than {self._max_response_bytes} bytes"
                )
            chunks.append(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def _answer(self, conn: _Connection, url: str) -> tuple[int, bytes]:
        """The status and whole body; the connection is done with either way."""
        try:
            status = await conn.status()
            raw = await self._read_limited(conn, url)
        except BaseException:
            conn.close()
            raise
        conn.done()
        return status, raw

    async def _sent(
        self, target: _Target, head: bytes, body: bytes, connect_s: float
    ) -> _Connection:
        """A pooled connection (within `connect_s`) with the call sent on it and its answer's
        status in. Any failure or cancellation on the way closes the connection."""
        conn = self._pool.idle(target.key)
        if conn is None:  # the connect timeout only where there is waiting to bound
            async with asyncio.timeout(connect_s):
                conn = await self._pool.get(target.key)
        try:
            conn.send(head, body)
            await conn.status()
        except BaseException:
            conn.close()
            raise
        return conn

    async def _post(self, call: Call, timeout_s: float) -> tuple[int, bytes]:
        url = call.url + call.path
        with SocketErrors(url):
            target = self._target(url)
            body = orjson.dumps(call.body)
            head = self._call_head(call, target, len(body))
            async with asyncio.timeout(timeout_s):
                connect_s = min(self._connect_timeout_s, timeout_s)
                return await self._answer(await self._sent(target, head, body, connect_s), url)

    async def _post_batch(
        self, url: str, calls: list[Call], timeout_s: float
    ) -> AsyncIterator[bytes]:
        first = calls[0]
        extra = {k: v for k, v in first.headers.items() if k != DECODE_MAX_TOKENS_HEADER}
        extra[REQUEST_ID_HEADER] = first.request_id
        body = batch_body(calls)
        # The deadline spans the yields: a timeout around them would cancel the consumer.
        deadline = asyncio.get_running_loop().time() + timeout_s
        with SocketErrors(url):
            target = self._target(url)
            head = self._head(
                b"POST",
                target,
                self._by_instance.get(first.url, self._headers),
                _header_block(extra),
                len(body),
            )
            async with asyncio.timeout_at(deadline):
                conn = await self._sent(target, head, body, min(self._connect_timeout_s, timeout_s))
                status = await conn.status()
            if status != 200:
                async with asyncio.timeout_at(deadline):
                    _, raw = await self._answer(conn, url)
                raise status_error(url, status, raw, "prefill")
            finished = False
            try:
                while True:
                    async with asyncio.timeout_at(deadline):
                        line = await conn.readline(self._max_response_bytes)
                    if not line:
                        finished = True
                        break
                    yield line
            finally:
                if finished:
                    conn.done()
                else:
                    conn.close()

    async def _open(self, call: Call, connect_timeout_s: float) -> _Stream | tuple[int, bytes]:
        url = call.url + call.path
        with SocketErrors(url):
            target = self._target(url)
            body = orjson.dumps(call.body)
            head = self._call_head(call, target, len(body))
            # A decode that accepts the connection and never answers is a failure too.
            connect_s = max(0.001, min(self._connect_timeout_s, connect_timeout_s))
            async with asyncio.timeout(min(self._header_timeout_s, max(connect_timeout_s, 0.001))):
                conn = await self._sent(target, head, body, connect_s)
                status = await conn.status()
        if status == 200:
            return self._watchdog.add(_Stream(conn, url, self._stalls.pace(url)))
        try:
            with SocketErrors(url):
                async with asyncio.timeout(self._read_timeout_s):
                    return await self._answer(conn, url)
        except UpstreamUnreachable:
            return status, b""

    async def _delete(self, url: str, request_id: str) -> str | None:
        try:
            with SocketErrors(url):
                target = _Target(url)
                head = self._head(
                    b"DELETE",
                    target,
                    self._headers,
                    _header_block({REQUEST_ID_HEADER: request_id}),
                    0,
                )
                async with asyncio.timeout(_RELEASE_TIMEOUT_S):
                    conn = await self._sent(target, head, b"", self._connect_timeout_s)
                    await self._answer(conn, url)
                    # Read before any await: the connection is back in the pool, free for
                    # the next call (which clears it).
                    admission = conn.admission
        except (UpstreamUnreachable, UpstreamProtocolError) as exc:
            log.info(
                "releasing KV at %s failed (%s); the prefill's hold timeout frees it", url, exc
            )
            return None
        return None if admission is None else admission.decode("latin-1")
