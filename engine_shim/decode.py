"""The decode worker: admits or rejects at once, then pulls KV asynchronously and streams.

A request holds one of `capacity` slots from admission until its stream ends (while its KV is
retrieved and while it runs); with no free slot, or no room in the KV retrieval queue, it
gets 429 at once. Once admitted, a streaming request gets its status and headers at once;
the KV is pulled by the retrieval workers (_kv_pull.py) while the running batch keeps
decoding, then the sequence joins the batch and tokens stream as OpenAI SSE chunks. A KV
failure after the headers went out is reported in-band (``data: {"error": ...}`` then
``data: [DONE]``); a non-streaming request still gets a real 502.

A client that disconnects leaves the batch at once and frees its slot; a KV pull it no
longer needs is cancelled or released at the prefill.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from typing import Any

import aiohttp
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from config import Role, ShimSettings
from engine_shim._completion import (
    CompletionRequest,
    CompletionShape,
    check_length,
    check_model,
    parse_completion,
    usage,
)
from engine_shim._http import (
    ApiError,
    ClosingStreamingResponse,
    bad_request,
    busy,
    draining,
    json_response,
    until_disconnect,
)
from engine_shim._kv_pull import KvRetriever, KvTransferError, PullJob
from engine_shim._slots import SlotPool
from engine_shim._stop import StopMatcher
from engine_shim.backend import DecodeBackend, EngineBusy, InvalidRequest
from engine_shim.wire import SSE_DONE, ClientGone, kv_url, read_body

__all__ = ["DecodeWorker"]

log = logging.getLogger("pdgate.shim.decode")

_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


class _Progress:
    __slots__ = ("finish_reason", "tokens")

    def __init__(self) -> None:
        self.tokens = 0
        self.finish_reason = "length"


def _kv_error(exc: BaseException) -> ApiError:
    return ApiError(
        502, f"KV transfer failed: {exc}", type_="upstream_error", code="kv_transfer_failed"
    )


class DecodeWorker:
    role = Role.DECODE

    def __init__(
        self,
        settings: ShimSettings,
        backend: DecodeBackend,
        *,
        instance_id: str,
        max_body_bytes: int,
    ) -> None:
        self._settings = settings
        self._backend = backend
        self._instance_id = instance_id
        self._max_body_bytes = max_body_bytes
        self._slots = SlotPool(settings.capacity)
        self._retriever = KvRetriever(
            backend,
            queue_size=settings.kv_retrieval_queue,
            workers=settings.kv_retrieval_workers,
            fetch_timeout_s=settings.kv_fetch_timeout_s,
        )
        self.draining = False
        self._counts = dict.fromkeys(
            ("admitted", "rejected", "completed", "cancelled", "failed"), 0
        )

    @property
    def slots(self) -> SlotPool:
        return self._slots

    def routes(self) -> list[Route]:
        return [Route("/v1/completions", self.completions, methods=["POST"])]

    def load(self) -> dict[str, Any]:
        stats = self._backend.stats()
        return {
            "role": self.role.value,
            "instance_id": self._instance_id,
            "model": self._settings.model,
            "group": self._settings.group,
            "draining": self.draining,
            "capacity": self._slots.capacity,
            "used": self._slots.used,
            "free": self._slots.free,
            "queued": self._retriever.queued,
            "waiting": stats.waiting,
            "running": stats.running,
            "retrieving": self._retriever.retrieving,
            "kv_held": 0,
            "kv_sending": 0,
            "prefix_cache_hit_tokens": stats.prefix_hit_tokens,
            "prefix_cache_total_tokens": stats.prefix_query_tokens,
            "kv_cache_usage": stats.kv_cache_usage,
            "engine_aborted": stats.aborted,
            **self._counts,
        }

    def start(self, session: aiohttp.ClientSession) -> None:
        self._retriever.start(session)

    async def aclose(self) -> None:
        await self._retriever.aclose()

    # -- POST /v1/completions -------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        try:
            return await self._complete(request)
        except ApiError as exc:
            return exc.response()
        except ClientGone:
            return Response(status_code=499)  # nobody is listening; for the access log only

    async def _complete(self, request: Request) -> Response:
        settings = self._settings
        if self.draining:
            raise draining()
        req = parse_completion(
            await read_body(request, self._max_body_bytes), max_model_len=settings.max_model_len
        )
        check_model(req, settings.model)
        params = req.kv_transfer_params
        if not params or params.get("do_remote_prefill") is not True:
            raise bad_request(
                "this is a decode instance of a disaggregated deployment: requests need "
                "kv_transfer_params with do_remote_prefill=true naming the prefill that holds "
                "the KV (send them through the gateway)",
                "kv_transfer_params",
            )
        try:
            url = kv_url(params)
        except (TypeError, ValueError):
            url = None
        if url is None:
            raise bad_request(
                "kv_transfer_params needs remote_host, remote_port and remote_request_id",
                "kv_transfer_params",
            )
        try:
            tokens = self._backend.tokenize(req.prompt)
        except ValueError as exc:
            raise bad_request(str(exc), "prompt") from None
        check_length(len(tokens), req.max_tokens, settings.max_model_len)

        slot = self._slots.try_acquire()
        if slot is None:
            self._counts["rejected"] += 1
            raise busy("no free decode slot", code="no_free_slot")
        request_id = str(params.get("remote_request_id"))
        try:
            job = self._retriever.submit(url, tokens, request_id)
        except asyncio.QueueFull:
            slot.release()
            self._counts["rejected"] += 1
            raise busy("KV retrieval queue is full", code="kv_queue_full") from None
        self._counts["admitted"] += 1

        def close() -> None:
            self._retriever.abandon(job)
            slot.release()

        if req.stream:
            return ClosingStreamingResponse(
                self._stream(req, tokens, job),
                media_type="text/event-stream",
                headers=_SSE_HEADERS,
                on_close=close,
            )
        try:
            return await until_disconnect(request, self._whole(req, tokens, job))
        except ClientGone:
            self._counts["cancelled"] += 1
            raise
        finally:
            close()

    async def _pieces(
        self, req: CompletionRequest, tokens: Sequence[int], job: PullJob, progress: _Progress
    ) -> AsyncGenerator[tuple[str, str | None], None]:
        """(text, finish_reason) per generated token, after stop handling; the last one has a
        finish reason. Raises `KvTransferError` before the first one."""
        sink = await self._retriever.wait(job)
        matcher = StopMatcher(req.stop)
        generate = self._backend.generate(tokens, req.max_tokens, sink, req.sampling)
        async with aclosing(generate) as pieces:
            async for piece in pieces:
                progress.tokens += 1
                text, stopped = matcher.feed(piece)
                if stopped:
                    progress.finish_reason = "stop"
                    yield text, "stop"
                    return
                if progress.tokens >= req.max_tokens:
                    yield text + matcher.flush(), "length"
                    return
                if text:
                    yield text, None
        # The engine ended before max_tokens: it generated its end-of-sequence token.
        progress.finish_reason = "stop"
        yield matcher.flush(), "stop"

    async def _stream(
        self, req: CompletionRequest, tokens: Sequence[int], job: PullJob
    ) -> AsyncIterator[bytes]:
        shape = CompletionShape(req.model or self._settings.model)
        progress = _Progress()
        try:
            try:
                async with aclosing(self._pieces(req, tokens, job, progress)) as pieces:
                    async for text, finish in pieces:
                        yield shape.chunk(text, finish)
            except (KvTransferError, EngineBusy, InvalidRequest) as exc:
                yield self._failed(exc, job).sse()
                yield SSE_DONE
                return
            if req.include_usage:
                yield shape.usage_chunk(usage(len(tokens), progress.tokens))
            yield SSE_DONE
            self._counts["completed"] += 1
        except (asyncio.CancelledError, GeneratorExit):
            self._counts["cancelled"] += 1
            raise

    async def _whole(self, req: CompletionRequest, tokens: Sequence[int], job: PullJob) -> Response:
        shape = CompletionShape(req.model or self._settings.model)
        progress = _Progress()
        parts: list[str] = []
        try:
            async with aclosing(self._pieces(req, tokens, job, progress)) as pieces:
                async for text, _ in pieces:
                    parts.append(text)
        except (KvTransferError, EngineBusy, InvalidRequest) as exc:
            raise self._failed(exc, job) from None
        self._counts["completed"] += 1
        return json_response(
            shape.completion(
                "".join(parts), progress.finish_reason, usage(len(tokens), progress.tokens)
            )
        )

    def _failed(self, exc: BaseException, job: PullJob) -> ApiError:
        self._counts["failed"] += 1
        log.warning("request %s failed before decoding: %s", job.request_id, exc)
        if isinstance(exc, EngineBusy):
            return ApiError(
                503, str(exc), type_="service_unavailable", code="batch_full", retry_after=1
            )
        if isinstance(exc, InvalidRequest):
            return bad_request(str(exc))
        return _kv_error(exc)
