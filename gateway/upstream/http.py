"""`HttpUpstream`: the `Upstream` seam over aiohttp (`BaseUpstream` holds what an answer
means; this module moves the bytes).

Every aiohttp failure becomes an `UpstreamError` here, in one place (`_mapped`), with
``raise ... from exc``; nothing above this module sees an aiohttp type.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import aiohttp
import orjson

from pdgate.config.wire import (
    ADMISSION_HEADER,
    DECODE_MAX_TOKENS_HEADER,
    KV_ID_HEADER,
    REQUEST_ID_HEADER,
)
from pdgate.gateway.errors import UpstreamProtocolError, UpstreamUnreachable
from pdgate.gateway.upstream import base
from pdgate.gateway.upstream.stalls import DecodePace, PacedStream, StallWatch, Watchdog

__all__ = ["HttpUpstream"]

log = logging.getLogger("pdgate.upstream")

_JSON = {"content-type": "application/json"}
_RELEASE_TIMEOUT_S = 2.0


class _mapped(base.SocketErrors):
    """aiohttp's failures too: nothing above this module sees an aiohttp type."""

    __slots__ = ()
    KINDS = (aiohttp.ClientError, TimeoutError, OSError)


class _Stream(PacedStream):
    """`DecodeStream` over an aiohttp response."""

    __slots__ = ("_guard", "_resp")

    def __init__(self, resp: aiohttp.ClientResponse, url: str, pace: DecodePace) -> None:
        super().__init__(url, pace)
        self._resp = resp
        self._guard = _mapped(url)  # it holds nothing per use: one for every read

    async def read(self, size: int) -> bytes:
        # What has arrived, up to `size`: no iterator of aiohttp's in between (this runs for
        # every token of every stream).
        self._waiting_since = since = time.monotonic()
        try:
            with self._guard:
                data = await self._resp.content.read(size)
        except UpstreamUnreachable:
            if self.stalled:
                raise self._stalled() from None
            raise
        finally:
            self._waiting_since = 0.0
        if data:
            self._heard(since)
        return data

    @property
    def closed(self) -> bool:
        return self._resp.closed

    def at_eof(self) -> bool:
        return self._resp.content.at_eof()

    def close(self) -> None:
        if not self._resp.closed:
            self._resp.close()


class HttpUpstream(base.BaseUpstream):
    def __init__(self, session: aiohttp.ClientSession, options: base.UpstreamOptions) -> None:
        """Calls through `session`; `options.connections` is the session's to bound
        (`connect` makes one that does)."""
        self._session = session
        self._watches = options.stall_timeout_s is not None or options.stall_bound is not None
        # aiohttp's own timeout bounds the reads: the watchdog judges started streams only.
        self._stalls = StallWatch(
            options.stall_bound, float("inf"), fixed_s=options.stall_timeout_s
        )
        self._watchdog = Watchdog(self._stalls)
        self._header_timeout_s = options.header_timeout_s
        self._connect_timeout_s = options.connect_timeout_s
        self._read_timeout_s = options.read_timeout_s
        self._max_response_bytes = options.max_response_bytes
        self._headers = {**_JSON, **options.headers}
        self._by_instance = {
            url: {**self._headers, **extra} for url, extra in options.instance_headers.items()
        }

    def __repr__(self) -> str:
        return f"HttpUpstream({len(self._by_instance)} instances with headers of their own)"

    @classmethod
    def connect(cls, options: base.UpstreamOptions) -> HttpUpstream:
        """A new session with the gateway's pool settings; `aclose()` closes it."""
        connector = aiohttp.TCPConnector(
            limit=options.connections, limit_per_host=0, keepalive_timeout=30, ttl_dns_cache=60
        )
        # No cookie jar: cookies one upstream sets must never ride along on other clients'
        # requests (and the jar's bookkeeping is per-call work on the hot path).
        session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar()
        )
        return cls(session, options)

    async def aclose(self) -> None:
        await self._watchdog.aclose()
        await self._session.close()

    def _watch(self, stream: _Stream) -> _Stream:
        return self._watchdog.add(stream) if self._watches else stream

    def _timeout(self, total_s: float) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=total_s, connect=min(self._connect_timeout_s, total_s))

    def _sent(self, call: base.Call) -> dict[str, str]:
        return {
            **self._by_instance.get(call.url, self._headers),
            **call.headers,
            REQUEST_ID_HEADER: call.request_id,
        }

    async def _post(self, call: base.Call, timeout_s: float) -> tuple[int, bytes]:
        url = call.url + call.path
        sent = self._sent(call)
        if call.kv_id is not None:
            sent[KV_ID_HEADER] = call.kv_id
        with _mapped(url):
            async with self._session.post(
                url, data=orjson.dumps(call.body), headers=sent, timeout=self._timeout(timeout_s)
            ) as resp:
                return resp.status, await self._read_limited(resp, url)

    async def _post_batch(
        self, url: str, calls: list[base.Call], timeout_s: float
    ) -> AsyncIterator[bytes]:
        sent = self._sent(calls[0])
        sent.pop(DECODE_MAX_TOKENS_HEADER, None)
        with _mapped(url):
            async with self._session.post(
                url, data=base.batch_body(calls), headers=sent, timeout=self._timeout(timeout_s)
            ) as resp:
                if resp.status != 200:
                    raise base.status_error(url, resp.status, await resp.read(), "prefill")
                while line := await resp.content.readline():
                    yield line

    async def _open(self, call: base.Call, connect_timeout_s: float) -> _Stream | tuple[int, bytes]:
        url = call.url + call.path
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=max(0.001, min(self._connect_timeout_s, connect_timeout_s)),
            sock_read=self._read_timeout_s,
        )
        with _mapped(url):
            # A decode that accepts the connection and never answers is a failure too.
            async with asyncio.timeout(min(self._header_timeout_s, max(connect_timeout_s, 0.001))):
                resp = await self._session.post(
                    url, data=orjson.dumps(call.body), headers=self._sent(call), timeout=timeout
                )
        if resp.status == 200:
            return self._watch(_Stream(resp, url, self._stalls.pace(url)))
        try:
            with _mapped(url):
                raw = await self._read_limited(resp, url)
        except UpstreamUnreachable:
            raw = b""
        finally:
            resp.release()
        return resp.status, raw

    async def _delete(self, url: str, request_id: str) -> str | None:
        try:
            with _mapped(url):
                async with self._session.delete(
                    url,
                    headers={**self._headers, REQUEST_ID_HEADER: request_id},
                    timeout=aiohttp.ClientTimeout(total=_RELEASE_TIMEOUT_S),
                ) as resp:
                    await resp.read()
                    return resp.headers.get(ADMISSION_HEADER)
        except UpstreamUnreachable as exc:
            log.info(
                "releasing KV at %s failed (%s); the prefill's hold timeout frees it", url, exc
            )
            return None

    async def _read_limited(self, resp: aiohttp.ClientResponse, url: str) -> bytes:
        chunks: list[bytes] = []
        size = 0
        async for chunk in resp.content.iter_any():
            size += len(chunk)
            if size > self._max_response_bytes:
                raise UpstreamProtocolError(
                    url, f"answer larger than {self._max_response_bytes} bytes"
                )
            chunks.append(chunk)
        return b"".join(chunks)
