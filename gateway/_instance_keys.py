"""Per-instance API keys: an `Upstream` that sends some instances a key of their own.

Every instance gets the gateway's default bearer token (``upstream_api_key``, else the
registry's ``cluster_token``). A static instance declared with ``api_key_env=VAR`` (a stock
server started with its own ``--api-key``) gets that key instead, on its prefill and decode
legs. The keys come from the gateway's environment at start-up (registry/static.py,
`static_api_keys`) and live only in this process: never in flags, config files or registry
records. KV releases are not re-keyed: a stock server has no release endpoint.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

from pdgate.config.wire import COMPLETIONS_PATH
from pdgate.gateway.upstream import DecodeStream, Upstream

__all__ = ["KeyedUpstream"]


class KeyedUpstream:
    def __init__(self, inner: Upstream, keys: Mapping[str, str]) -> None:
        """`keys`: instance base URL -> its API key."""
        self._inner = inner
        self._auth = {url: {"authorization": f"Bearer {key}"} for url, key in keys.items()}

    def __repr__(self) -> str:
        return f"KeyedUpstream({self._inner!r}, {len(self._auth)} instances with own keys)"

    def _headers(
        self, base_url: str, headers: Mapping[str, str] | None
    ) -> Mapping[str, str] | None:
        auth = self._auth.get(base_url)
        return headers if auth is None else {**(headers or {}), **auth}

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
        return await self._inner.prefill(
            base_url,
            body,
            request_id=request_id,
            timeout_s=timeout_s,
            kv_id=kv_id,
            headers=self._headers(base_url, headers),
            path=path,
        )

    def prefill_batch(
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
        return self._inner.prefill_batch(
            base_url,
            bodies,
            kv_ids=kv_ids,
            request_id=request_id,
            timeout_s=timeout_s,
            headers=self._headers(base_url, headers),
            path=path,
        )

    async def open_decode(
        self,
        base_url: str,
        body: dict[str, Any],
        *,
        request_id: str,
        connect_timeout_s: float,
        headers: Mapping[str, str] | None = None,
        path: str = COMPLETIONS_PATH,
    ) -> DecodeStream:
        return await self._inner.open_decode(
            base_url,
            body,
            request_id=request_id,
            connect_timeout_s=connect_timeout_s,
            headers=self._headers(base_url, headers),
            path=path,
        )

    async def release_kv_id(self, base_url: str, kv_id: str, *, request_id: str) -> None:
        await self._inner.release_kv_id(base_url, kv_id, request_id=request_id)

    async def release_kv(self, kv_params: dict[str, Any], *, request_id: str) -> None:
        await self._inner.release_kv(kv_params, request_id=request_id)

    async def aclose(self) -> None:
        await self._inner.aclose()
