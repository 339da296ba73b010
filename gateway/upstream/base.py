"""The upstream seam: the gateway's calls to prefill and decode instances.

`Upstream` is the Protocol the dispatcher and the relay see. `BaseUpstream` implements it
once: which URL a leg goes to, what an answer's status means, what a prefill answer and a
batch line must hold. Its subclasses only move bytes: `HttpUpstream`
(gateway/upstream/http.py) through aiohttp, mapping every aiohttp failure to an
`UpstreamError` in one place, and `MockUpstream` (gateway/upstream/mock.py), an in-memory fake
for unit tests, as httpx's `MockTransport` is for its transports. So code tested against the
fake meets the same rules over HTTP. Nothing above this seam sees sockets or aiohttp types.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, ClassVar, Literal, Protocol

import orjson

from pdgate.config.wire import (
    ADMISSIONS,
    BATCH_SUFFIX,
    COMPLETIONS_PATH,
    DECODE_MAX_TOKENS_HEADER,
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
from pdgate.gateway.upstream.stalls import StallBound

__all__ = [
    "BaseUpstream",
    "Call",
    "DecodeStream",
    "SocketErrors",
    "Upstream",
    "UpstreamOptions",
    "batch_body",
    "prefill_reply",
    "status_error",
    "upstream_error_message",
]

Leg = Literal["prefill", "decode", "release", "side"]

_MAX_ERROR_BODY = 64 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class UpstreamOptions:
    """How a transport calls the instances, the same for each (`upstream_client`).

    `headers` go with every call (e.g. the cluster token towards the shims);
    `instance_headers` (base URL -> headers) replace some of them towards one instance: a
    static server with an API key of its own (registry/static.py, `static_api_keys`).
    `stall_timeout_s`: a decode stream that started and then keeps the relay waiting this
    long is given up (a hung or stopped decode); `stall_bound` instead: as long as its
    decode's pace says (stalls.py); neither: only `read_timeout_s`."""

    connections: int
    connect_timeout_s: float
    read_timeout_s: float
    max_response_bytes: int = 16 * 1024 * 1024
    headers: Mapping[str, str] = field(default_factory=dict)
    instance_headers: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    header_timeout_s: float = 5.0
    stall_timeout_s: float | None = None
    stall_bound: StallBound | None = None


class DecodeStream(Protocol):
    """A decode's open 200 answer (an SSE stream), owned by whoever placed the request."""

    @property
    def url(self) -> str: ...

    async def read(self, size: int) -> bytes:
        """The next part of the body as it arrives, at most `size` bytes; ``b""`` at its
        end. Raises `UpstreamError` if the instance fails mid-way. A method, not an async
        iterator: a relay that stops at ``[DONE]`` would leave an unfinished generator for
        the event loop to close, a task and a wake-up per request."""
        ...

    def at_eof(self) -> bool:
        """Whether the whole body has arrived and been read (nothing left to drain)."""
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
        decode_max_tokens: Sequence[int] = (),
    ) -> AsyncIterator[tuple[int, int, dict[str, Any]]]:
        """POST several prefill legs of one API at once (pdgate shims' batch endpoint,
        `path` + ``/batch``); yields ``(index, status, body)`` per request as the prefill
        reports it (rejections first). `decode_max_tokens`: per request, as the
        ``DECODE_MAX_TOKENS_HEADER`` of a single call. An instance without the endpoint
        raises `UpstreamStatus` 404 or 405."""
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

    async def release_kv_id(self, base_url: str, kv_id: str, *, request_id: str) -> str | None:
        """Release KV by the id this gateway chose for it; best effort, never raises. What
        the prefill did with the call that named the id, as it says (``ADMISSIONS``:
        admitted, rejected, unseen); None when it does not say (a stock server, a failed
        or timed-out release)."""
        ...

    async def post(
        self,
        base_url: str,
        path: str,
        body: dict[str, Any],
        *,
        request_id: str,
        timeout_s: float,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, bytes]:
        """POST `body` to `path` whole (a side endpoint: ``/tokenize``, ``/v1/embeddings``,
        ...); the answer's status and body, whatever the status. Raises
        `UpstreamUnreachable` (connect failure, reset, `timeout_s` passed) or
        `UpstreamProtocolError` (an answer larger than the transport's bound)."""
        ...

    async def release_kv(self, kv_params: dict[str, Any], *, request_id: str) -> None:
        """Tell a prefill to free KV nobody will fetch; best effort, never raises (the
        prefill's hold timeout is the backstop)."""
        ...

    async def aclose(self) -> None: ...


@dataclass(slots=True)
class Call:
    """One call to an instance, as `BaseUpstream` hands it to the transport (and as
    `MockUpstream` records it)."""

    leg: Leg
    url: str  # the instance's base URL (release: the KV's full URL)
    body: dict[str, Any] | None
    request_id: str
    kv_id: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)  # extra ones, e.g. traceparent
    path: str = COMPLETIONS_PATH  # the API the call goes to (release: none)


class BaseUpstream:
    """`Upstream`'s rules, once for every transport; subclasses implement the four
    transport methods below and `aclose`."""

    async def _post(self, call: Call, timeout_s: float) -> tuple[int, bytes]:
        """POST `call` (a prefill leg); the answer's status and body."""
        raise NotImplementedError

    def _post_batch(self, url: str, calls: list[Call], timeout_s: float) -> AsyncIterator[bytes]:
        """POST `calls` as one batch to `url`; the answer's lines (a non-200 answer raises
        its `status_error`)."""
        raise NotImplementedError

    async def _open(self, call: Call, connect_timeout_s: float) -> DecodeStream | tuple[int, bytes]:
        """POST `call` (a decode leg); the open stream of a 200, else the status and body."""
        raise NotImplementedError

    async def _delete(self, url: str, request_id: str) -> str | None:
        """DELETE `url` (a KV release); best effort, never raises. The answer's
        ``ADMISSION_HEADER``, if it came with one."""
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError

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
        call = Call("prefill", base_url, body, request_id, kv_id, headers or {}, path)
        status, raw = await self._post(call, timeout_s)
        if status != 200:
            raise status_error(base_url + path, status, raw, "prefill")
        return prefill_reply(base_url + path, raw)

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
        decode_max_tokens: Sequence[int] = (),
    ) -> AsyncIterator[tuple[int, int, dict[str, Any]]]:
        url = base_url + path + BATCH_SUFFIX
        sent = headers or {}
        limits = [{DECODE_MAX_TOKENS_HEADER: str(n)} for n in decode_max_tokens]
        calls = [
            Call("prefill", base_url, body, request_id, kv_id, {**sent, **limit}, path)
            for body, kv_id, limit in zip(bodies, kv_ids, limits or [{}] * len(bodies), strict=True)
        ]
        async for line in self._post_batch(url, calls, timeout_s):
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
    ) -> DecodeStream:
        call = Call("decode", base_url, body, request_id, None, headers or {}, path)
        opened = await self._open(call, connect_timeout_s)
        if isinstance(opened, tuple):
            raise status_error(base_url + path, *opened, "decode")
        return opened

    async def release_kv_id(self, base_url: str, kv_id: str, *, request_id: str) -> str | None:
        admission = await self._delete(kv_release_url(base_url, kv_id), request_id)
        return admission if admission in ADMISSIONS else None

    async def post(
        self,
        base_url: str,
        path: str,
        body: dict[str, Any],
        *,
        request_id: str,
        timeout_s: float,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, bytes]:
        call = Call("side", base_url, body, request_id, None, headers or {}, path)
        return await self._post(call, timeout_s)

    async def release_kv(self, kv_params: dict[str, Any], *, request_id: str) -> None:
        url = kv_url(kv_params)
        if url is not None:
            await self._delete(url, request_id)


def batch_body(calls: Sequence[Call]) -> bytes:
    """The body of one batch call for `calls` (pdgate shims' batch endpoint)."""
    batch: dict[str, Any] = {
        "requests": [c.body for c in calls],
        "kv_ids": [c.kv_id for c in calls],
    }
    if all(DECODE_MAX_TOKENS_HEADER in c.headers for c in calls):
        # Per request: a call's one header would say only the first one's.
        batch["decode_max_tokens"] = [int(c.headers[DECODE_MAX_TOKENS_HEADER]) for c in calls]
    return orjson.dumps(batch)


class SocketErrors:
    """Where a transport's socket-level failures (`KINDS`) become `UpstreamUnreachable`, with
    ``raise ... from exc``; an `UpstreamError` raised inside passes through unchanged. A
    class, not a generator context manager: it wraps every call and every stream read."""

    __slots__ = ("_url",)
    KINDS: ClassVar[tuple[type[BaseException], ...]] = (OSError, TimeoutError)

    def __init__(self, url: str) -> None:
        self._url = url

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if isinstance(exc, self.KINDS):
            raise UpstreamUnreachable(self._url, f"{type(exc).__name__}: {exc}") from exc


def status_error(url: str, status: int, raw: bytes, leg: Leg) -> UpstreamError:
    """What a non-200 answer means: 429 is "no free slot" (`UpstreamRejected`), any other
    status an `UpstreamStatus` carrying the start of the body."""
    if status == 429:
        return UpstreamRejected(url, f"no free {leg} slot")
    return UpstreamStatus(url, status, raw[:_MAX_ERROR_BODY])


def upstream_error_message(exc: UpstreamStatus) -> str:
    """The instance's own OpenAI error message, if it sent one (it is about the request)."""
    msg = _error_field(exc, "message")
    return msg[:1024] if msg is not None else f"upstream answered HTTP {exc.status}"


def upstream_error_param(exc: UpstreamStatus) -> str | None:
    """The request field the instance's OpenAI error names (``param``), if a plausible one."""
    param = _error_field(exc, "param")
    return param if param is not None and 0 < len(param) <= 64 and param.isprintable() else None


def upstream_error_code(exc: UpstreamStatus) -> str | None:
    """The ``code`` of the instance's OpenAI error, if it sent one."""
    return _error_field(exc, "code")


def _error_field(exc: UpstreamStatus, name: str) -> str | None:
    try:
        value = orjson.loads(exc.body)["error"][name]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    return value if isinstance(value, str) else None


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
