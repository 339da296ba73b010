"""The upstream seam: the gateway's calls to prefill and decode instances.

`Upstream` is the Protocol the dispatcher and the relay see; `HttpUpstream`
(gateway/http_upstream.py) speaks HTTP through aiohttp and maps every aiohttp failure to an
`UpstreamError` in one place; `MockUpstream` (gateway/mock_upstream.py) is an in-memory fake
beside it for unit tests, as httpx's `MockTransport` is for its transports. Nothing above this
seam sees sockets or aiohttp types.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

import orjson

from pdgate.config.wire import COMPLETIONS_PATH
from pdgate.gateway.errors import UpstreamProtocolError, UpstreamStatus

__all__ = ["DecodeStream", "Upstream", "prefill_reply", "upstream_error_message"]


class DecodeStream(Protocol):
    """A decode's open 200 answer (an SSE stream), owned by whoever placed the request."""

    @property
    def url(self) -> str: ...

    def chunks(self, size: int) -> AsyncIterator[bytes]:
        """The body as it arrives; raises `UpstreamError` if the instance fails mid-way."""
        ...

    def close(self) -> None:
        """Drop the connection (idempotent). Closing mid-stream is what tells the decode the
        client is gone, so it frees its slot at once."""
        ...


class Upstream(Protocol):
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
        """POST the prefill leg to `path` (``/v1/completions`` or ``/v1/chat/completions``);
        the answer's JSON with ``kv_transfer_params``.

        `kv_id` names the KV handle at the prefill (pdgate shims honour it), so a call that
        is abandoned mid-way can still be released with `release_kv_id`. Raises
        `UpstreamRejected` (429), `UpstreamStatus` (other non-200), `UpstreamUnreachable`
        (connect failure, reset, timeout), `UpstreamProtocolError` (not the handshake)."""
        ...

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
        """POST several prefill legs of one API at once (pdgate shims' batch endpoint,
        `path` + ``/batch``); yields ``(index, status, body)`` per request as the prefill
        reports it (rejections first). An instance without the endpoint raises
        `UpstreamStatus` 404 or 405."""
        ...

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
        """POST the decode leg to `path`; the open stream for the caller to relay and close.
        `headers`
        (here and on the prefill legs) are extra ones, e.g. the trace's ``traceparent``."""
        ...

    async def release_kv_id(self, base_url: str, kv_id: str, *, request_id: str) -> None:
        """Release KV by the id this gateway chose for it; best effort, never raises."""
        ...

    async def release_kv(self, kv_params: dict[str, Any], *, request_id: str) -> None:
        """Tell a prefill to free KV nobody will fetch; best effort, never raises (the
        prefill's hold timeout is the backstop)."""
        ...

    async def aclose(self) -> None: ...


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


def prefill_reply(url: str, raw: bytes) -> dict[str, Any]:
    """A prefill's 200 body, checked against the handshake."""
    try:
        reply = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise UpstreamProtocolError(url, "prefill answer is not JSON") from exc
    if not isinstance(reply, dict):
        raise UpstreamProtocolError(url, "prefill answer is not a JSON object")
    params = reply.get("kv_transfer_params", False)
    if params is None:
        # Stock vLLM whose connector moves KV through storage the decode reads by the prompt
        # itself (vLLM's ExampleConnector, LMCache) answers `"kv_transfer_params": null`;
        # the decode then gets empty params, as vLLM's own proxies send.
        reply["kv_transfer_params"] = params = {}
    if not isinstance(params, dict):
        raise UpstreamProtocolError(url, "prefill answer has no kv_transfer_params")
    return reply
