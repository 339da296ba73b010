"""`HttpUpstream`: the `Upstream` seam over aiohttp.

Every aiohttp failure becomes an `UpstreamError` here, in one place (`_mapped`), with
``raise ... from exc``; nothing above this module sees an aiohttp type.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import aiohttp
import orjson

from pdgate.config.wire import (
    BATCH_SUFFIX,
    COMPLETIONS_PATH,
    KV_ID_HEADER,
    REQUEST_ID_HEADER,
    kv_release_url,
    kv_url,
)
from pdgate.gateway.errors import (
    UpstreamError,
    UpstreamProtocolError,
    UpstreamRejected,
    UpstreamStatus,
    UpstreamUnreachable,
)
from pdgate.gateway.upstream import prefill_reply

__all__ = ["HttpUpstream"]

log = logging.getLogger("pdgate.upstream")

_JSON = {"content-type": "application/json"}
_MAX_ERROR_BODY = 64 * 1024
_RELEASE_TIMEOUT_S = 2.0


@contextlib.contextmanager
def _mapped(url: str) -> Iterator[None]:
    """The one place where socket-level failures become `UpstreamUnreachable`."""
    try:
        yield
    except UpstreamError:
        raise
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise UpstreamUnreachable(url, f"{type(exc).__name__}: {exc}") from exc


class _Stream:
    """`DecodeStream` over an aiohttp response."""

    __slots__ = ("_resp",)

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp

    @property
    def url(self) -> str:
        return str(self._resp.url)

    async def chunks(self, size: int) -> AsyncIterator[bytes]:
        with _mapped(self.url):
            async for chunk in self._resp.content.iter_chunked(size):
                yield chunk

    def close(self) -> None:
        if not self._resp.closed:
            self._resp.close()


class HttpUpstream:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        connect_timeout_s: float,
        read_timeout_s: float,
        max_response_bytes: int = 16 * 1024 * 1024,
        headers: dict[str, str] | None = None,
        header_timeout_s: float = 5.0,
    ) -> None:
        self._session = session
        self._header_timeout_s = header_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._max_response_bytes = max_response_bytes
        # Sent on every call (e.g. the cluster token towards the shims).
        self._headers = {**_JSON, **(headers or {})}

    @classmethod
    def connect(
        cls,
        *,
        connections: int,
        connect_timeout_s: float,
        read_timeout_s: float,
        headers: dict[str, str] | None = None,
        header_timeout_s: float = 5.0,
    ) -> HttpUpstream:
        """A new session with the gateway's pool settings; `aclose()` closes it."""
        connector = aiohttp.TCPConnector(
            limit=connections, limit_per_host=0, keepalive_timeout=30, ttl_dns_cache=60
        )
        # No cookie jar: cookies one upstream sets must never ride along on other clients'
        # requests (and the jar's bookkeeping is per-call work on the hot path).
        session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar()
        )
        return cls(
            session,
            connect_timeout_s=connect_timeout_s,
            read_timeout_s=read_timeout_s,
            headers=headers,
            header_timeout_s=header_timeout_s,
        )

    async def aclose(self) -> None:
        await self._session.close()

    def _timeout(self, total_s: float) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=total_s, connect=min(self._connect_timeout_s, total_s))

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
        sent = {**self._headers, **(headers or {}), REQUEST_ID_HEADER: request_id}
        if kv_id is not None:
            sent[KV_ID_HEADER] = kv_id
        with _mapped(url):
            async with self._session.post(
                url, data=orjson.dumps(body), headers=sent, timeout=self._timeout(timeout_s)
            ) as resp:
                raw = await self._read_limited(resp, url)
                if resp.status == 429:
                    raise UpstreamRejected(url, "no free prefill slot")
                if resp.status != 200:
                    raise UpstreamStatus(url, resp.status, raw[:_MAX_ERROR_BODY])
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
        url = base_url + path + BATCH_SUFFIX
        payload = orjson.dumps({"requests": bodies, "kv_ids": kv_ids})
        sent = {**self._headers, **(headers or {}), REQUEST_ID_HEADER: request_id}
        with _mapped(url):
            async with self._session.post(
                url, data=payload, headers=sent, timeout=self._timeout(timeout_s)
            ) as resp:
                if resp.status == 429:
                    raise UpstreamRejected(url, "no free prefill slot")
                if resp.status != 200:
                    raise UpstreamStatus(url, resp.status, (await resp.read())[:_MAX_ERROR_BODY])
                while line := await resp.content.readline():
                    try:
                        item = orjson.loads(line)
                        yield int(item["index"]), int(item["status"]), item["body"]
                    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                        raise UpstreamProtocolError(url, "bad line in a batch answer") from exc

    async def open_decode(
        self,
        base_url: str,
        body: dict[str, Any],
        *,
        request_id: str,
        connect_timeout_s: float,
        headers: Mapping[str, str] | None = None,
        path: str = COMPLETIONS_PATH,
    ) -> _Stream:
        url = base_url + path
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=max(0.001, min(self._connect_timeout_s, connect_timeout_s)),
            sock_read=self._read_timeout_s,
        )
        with _mapped(url):
            # A decode that accepts the connection and never answers is a failure too.
            async with asyncio.timeout(min(self._header_timeout_s, max(connect_timeout_s, 0.001))):
                resp = await self._session.post(
                    url,
                    data=orjson.dumps(body),
                    headers={**self._headers, **(headers or {}), REQUEST_ID_HEADER: request_id},
                    timeout=timeout,
                )
        if resp.status == 200:
            return _Stream(resp)
        try:
            with _mapped(url):
                raw = await self._read_limited(resp, url)
        except UpstreamUnreachable:
            raw = b""
        finally:
            resp.release()
        if resp.status == 429:
            raise UpstreamRejected(url, "no free decode slot")
        raise UpstreamStatus(url, resp.status, raw[:_MAX_ERROR_BODY])

    async def release_kv_id(self, base_url: str, kv_id: str, *, request_id: str) -> None:
        await self._delete(kv_release_url(base_url, kv_id), request_id)

    async def release_kv(self, kv_params: dict[str, Any], *, request_id: str) -> None:
        url = kv_url(kv_params)
        if url is not None:
            await self._delete(url, request_id)

    async def _delete(self, url: str, request_id: str) -> None:
        try:
            with _mapped(url):
                async with self._session.delete(
                    url,
                    headers={**self._headers, REQUEST_ID_HEADER: request_id},
                    timeout=aiohttp.ClientTimeout(total=_RELEASE_TIMEOUT_S),
                ) as resp:
                    await resp.read()
        except UpstreamUnreachable as exc:
            log.info(
                "releasing KV at %s failed (%s); the prefill's hold timeout frees it", url, exc
            )

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
