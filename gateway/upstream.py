"""The aiohttp boundary: calls to prefill and decode instances.

Every aiohttp failure is mapped here to an `UpstreamError` (``raise ... from exc``), so the
dispatcher reasons about rejections, unreachable instances and bad answers, never sockets.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson

from engine_shim.wire import BATCH_PATH, KV_ID_HEADER, kv_release_url, kv_url
from gateway.errors import (
    UpstreamProtocolError,
    UpstreamRejected,
    UpstreamStatus,
    UpstreamUnreachable,
)

log = logging.getLogger("pdgate.upstream")

_JSON = {"content-type": "application/json"}
_MAX_ERROR_BODY = 64 * 1024


class Upstream:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        connect_timeout_s: float,
        read_timeout_s: float,
        max_response_bytes: int = 16 * 1024 * 1024,
    ) -> None:
        self._session = session
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._max_response_bytes = max_response_bytes

    async def prefill(
        self,
        base_url: str,
        body: dict[str, Any],
        *,
        request_id: str,
        timeout_s: float,
        kv_id: str | None = None,
    ) -> dict[str, Any]:
        """POST the prefill leg; returns the completion JSON (with ``kv_transfer_params``).

        `kv_id` names the KV handle at the prefill (pdgate shims honour it), so a call that
        is abandoned mid-way can still be released with `release_kv_id`."""
        url = base_url + "/v1/completions"
        timeout = aiohttp.ClientTimeout(
            total=timeout_s, connect=min(self._connect_timeout_s, timeout_s)
        )
        headers = {**_JSON, "x-request-id": request_id}
        if kv_id is not None:
            headers[KV_ID_HEADER] = kv_id
        try:
            async with self._session.post(
                url,
                data=orjson.dumps(body),
                headers=headers,
                timeout=timeout,
            ) as resp:
                raw = await self._read_limited(resp, url)
                if resp.status == 429:
                    raise UpstreamRejected(url, "no free prefill slot")
                if resp.status != 200:
                    raise UpstreamStatus(url, resp.status, raw[:_MAX_ERROR_BODY])
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise UpstreamUnreachable(url, f"{type(exc).__name__}: {exc}") from exc
        try:
            reply = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise UpstreamProtocolError(url, "prefill answer is not JSON") from exc
        if not isinstance(reply, dict) or not isinstance(reply.get("kv_transfer_params"), dict):
            raise UpstreamProtocolError(url, "prefill answer has no kv_transfer_params")
        return reply

    async def prefill_batch(
        self,
        base_url: str,
        bodies: list[dict[str, Any]],
        *,
        kv_ids: list[str],
        request_id: str,
        timeout_s: float,
    ) -> AsyncIterator[tuple[int, int, dict[str, Any]]]:
        """POST several prefill legs at once (pdgate shims' batch endpoint); yields
        ``(index, status, body)`` per request as the prefill reports it (rejections first)."""
        url = base_url + BATCH_PATH
        timeout = aiohttp.ClientTimeout(
            total=timeout_s, connect=min(self._connect_timeout_s, timeout_s)
        )
        payload = orjson.dumps({"requests": bodies, "kv_ids": kv_ids})
        try:
            async with self._session.post(
                url, data=payload, headers={**_JSON, "x-request-id": request_id}, timeout=timeout
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
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise UpstreamUnreachable(url, f"{type(exc).__name__}: {exc}") from exc

    async def open_decode(
        self, base_url: str, body: dict[str, Any], *, request_id: str, connect_timeout_s: float
    ) -> aiohttp.ClientResponse:
        """POST the decode leg; returns the open 200 response for the caller to relay and close."""
        url = base_url + "/v1/completions"
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=max(0.001, min(self._connect_timeout_s, connect_timeout_s)),
            sock_read=self._read_timeout_s,
        )
        try:
            resp = await self._session.post(
                url,
                data=orjson.dumps(body),
                headers={**_JSON, "x-request-id": request_id},
                timeout=timeout,
            )
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise UpstreamUnreachable(url, f"{type(exc).__name__}: {exc}") from exc
        if resp.status == 200:
            return resp
        try:
            raw = await self._read_limited(resp, url)
        except (aiohttp.ClientError, TimeoutError, OSError):
            raw = b""
        finally:
            resp.release()
        if resp.status == 429:
            raise UpstreamRejected(url, "no free decode slot")
        raise UpstreamStatus(url, resp.status, raw[:_MAX_ERROR_BODY])

    async def release_kv_id(self, base_url: str, kv_id: str, *, request_id: str) -> None:
        """Release KV by the id this gateway chose for it (see `prefill`); best effort."""
        await self._delete(kv_release_url(base_url, kv_id), request_id)

    async def release_kv(self, kv_params: dict[str, Any], *, request_id: str) -> None:
        """Tell a prefill to free KV nobody will fetch.

        Best effort: the prefill's hold timeout is the backstop."""
        url = kv_url(kv_params)
        if url is not None:
            await self._delete(url, request_id)

    async def _delete(self, url: str, request_id: str) -> None:
        try:
            async with self._session.delete(
                url, headers={"x-request-id": request_id}, timeout=aiohttp.ClientTimeout(total=2.0)
            ) as resp:
                await resp.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            log.info(
                "releasing KV at %s failed (%s); the prefill's hold timeout frees it", url, exc
            )

    async def read_body(self, resp: aiohttp.ClientResponse) -> bytes:
        """A whole (bounded) decode body, for non-streaming clients."""
        try:
            return await self._read_limited(resp, str(resp.url))
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise UpstreamUnreachable(str(resp.url), f"{type(exc).__name__}: {exc}") from exc

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


def upstream_error_message(exc: UpstreamStatus) -> str:
    """The instance's own OpenAI error message, if it sent one (it is about the request)."""
    try:
        data = orjson.loads(exc.body)
        msg = data["error"]["message"]
        if isinstance(msg, str):
            return msg[:1024]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        pass
    return f"upstream answered HTTP {exc.status}"
