"""The decode worker: admits or rejects at once, then pulls KV asynchronously and streams.

A request holds one of `capacity` slots from admission until its stream ends (while its KV is
retrieved and while it runs); with no free slot, or no room in the KV retrieval queue, it
gets 429 at once. Once admitted, a streaming request gets its status and headers at once;
the KV is pulled by the retrieval workers (_kv_pull.py) while the running batch keeps
decoding, then the sequence joins the batch and tokens stream as OpenAI SSE chunks. A KV
failure after the headers went out is reported in-band (``data: {"error": ...}`` then
``data: [DONE]``); a non-streaming request still gets a real 502.

A client that disconnects leaves the batch at once and frees its slot; a KV pull it no
longer needs is cancelled or released at the prefill. Streams go out through sse-starlette
(`_sse.EventStream`: keep-alive pings, disconnect watch, send timeout).

The decode pulls only from prefills registered in its own registry (`_kv_sources`), with
the cluster token: ``kv_transfer_params`` naming another host get 400 (`unknown_kv_source`).

A plain request (no ``kv_transfer_params``) is computed here, when the backend can
(`LocalPrefill`) and ``local_prefill`` is on (the registry record then declares
``EXT_LOCAL_PREFILL``): the same slot, stream and counts, with a job that is done from the
start instead of a KV pull (conditional disaggregation: the gateway skips the prefill leg
for prompts with few uncached tokens). Otherwise it gets 400 as before.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from contextlib import aclosing
from typing import Any

import aiohttp
from starlette.requests import Request
from starlette.responses import Response

from pdgate.config import Role, ShimSettings
from pdgate.config.openai_api import Api, ClientGone
from pdgate.config.tracing import Span, Tracing
from pdgate.config.wire import (
    SSE_DONE,
    TPOT_SLO_HEADER,
    TTFT_LEFT_HEADER,
    UNKNOWN_KV_SOURCE,
    kv_url,
    valid_kv_id,
)
from pdgate.engine_shim._completion import ApiRequest, Shape, shape_for, usage
from pdgate.engine_shim._http import (
    ApiError,
    ClusterAuth,
    bad_request,
    busy,
    json_response,
    until_disconnect,
)
from pdgate.engine_shim._kv_pull import KvRetriever, KvTransferError, PullJob
from pdgate.engine_shim._kv_sources import KvSources, endpoint
from pdgate.engine_shim._phases import PhaseGate
from pdgate.engine_shim._service import ShimService, caller_request_id, end_span, engine_sampling
from pdgate.engine_shim._slots import SlotPool
from pdgate.engine_shim._sse import EventStream
from pdgate.engine_shim._stop import StopMatcher
from pdgate.engine_shim.backend import (
    DecodeBackend,
    DecodeJob,
    EngineBusy,
    InvalidRequest,
    LocalPrefill,
    Sampling,
    TokenLogprobs,
)

__all__ = ["AggregatedWorker", "DecodeWorker"]

log = logging.getLogger("pdgate.shim.decode")

_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


class _Decoding:
    """One admitted request on its way out: what it asked, its KV pull, the shape of its
    answer, its span, and how far it got."""

    __slots__ = (
        "admitted",
        "finish_reason",
        "generated",
        "job",
        "outcome",
        "prompt",
        "req",
        "sampling",
        "shape",
        "span",
        "tpot_slo_s",
        "ttft_left_s",
    )

    def __init__(
        self,
        req: ApiRequest,
        prompt: list[int],
        job: PullJob,
        shape: Shape,
        span: Span,
        sampling: Sampling,
    ) -> None:
        self.req = req
        self.prompt = prompt  # the prompt's token ids
        self.job = job
        self.shape = shape
        self.sampling = sampling  # what the engine gets (`_service.engine_sampling`)
        self.span = span
        self.generated = 0  # tokens
        self.finish_reason = "length"
        self.outcome = "cancelled"  # until it ends otherwise
        self.ttft_left_s: float | None = None  # as the gateway said (TTFT_LEFT_HEADER)
        self.tpot_slo_s: float | None = None  # as the gateway said (TPOT_SLO_HEADER)
        self.admitted = time.monotonic()

    def usage(self) -> dict[str, Any]:
        return usage(len(self.prompt), self.generated)


# (text, finish reason, logprobs and ids of the tokens behind the text) per piece
_Piece = tuple[str, str | None, Sequence[TokenLogprobs], Sequence[int]]


def local_prefill(settings: ShimSettings, backend: DecodeBackend) -> LocalPrefill | None:
    """The backend, if this decode takes plain requests (``EXT_LOCAL_PREFILL``)."""
    if settings.local_prefill and isinstance(backend, LocalPrefill):
        return backend
    return None


def _kv_error(exc: BaseException) -> ApiError:
    return ApiError(
        502, f"KV transfer failed: {exc}", type_="upstream_error", code="kv_transfer_failed"
    )


class DecodeWorker(ShimService[DecodeBackend]):
    role = Role.DECODE
    counts = ("admitted", "rejected", "completed", "cancelled", "failed", "local_prefills")

    def __init__(
        self,
        settings: ShimSettings,
        backend: DecodeBackend,
        *,
        instance_id: str,
        max_body_bytes: int,
        sources: KvSources | None = None,
        auth: ClusterAuth | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        super().__init__(
            settings,
            backend,
            SlotPool(settings.capacity),
            instance_id=instance_id,
            max_body_bytes=max_body_bytes,
            auth=auth,
            tracing=tracing,
        )
        # None only for a worker built without a registry to check against (unit tests).
        self._sources = sources
        self._local = local_prefill(settings, backend)
        if self.role is Role.AGGREGATED and self._local is None:
            raise ValueError(
                "an aggregated instance computes prompts itself: it needs local_prefill on and "
                "an engine that takes plain requests"
            )
        # Temporal disaggregation (aggregated instances with `phases`): None otherwise.
        self._gate: PhaseGate | None = None
        if self.role is Role.AGGREGATED and settings.phases:
            self._gate = PhaseGate(tpot_slo_s=settings.tpot_slo_s, ttft_slo_s=settings.ttft_slo_s)
        self._seq = itertools.count()
        # Phase-switching waits (`_pieces`): how many, and their seconds in all.
        self._switch_waits = 0
        self._switch_wait_s = 0.0
        self._retriever = KvRetriever(
            backend,
            queue_size=settings.kv_retrieval_queue,
            workers=settings.kv_retrieval_workers,
            fetch_timeout_s=settings.kv_fetch_timeout_s,
            headers=self._auth.headers,
            tracing=self._tracing,
        )

    def _load(self) -> Mapping[str, Any]:
        phases = self._gate.load() if self._gate is not None else {}
        return {
            "queued": self._retriever.queued,
            "retrieving": self._retriever.retrieving,
            "phase_switch_waits": self._switch_waits,
            "phase_switch_wait_s": round(self._switch_wait_s, 6),
            **phases,
        }

    def start(self, session: aiohttp.ClientSession) -> None:
        self._retriever.start(session)

    async def aclose(self) -> None:
        await self._retriever.aclose()

    # -- POST /v1/completions, /v1/chat/completions --------------------------------------

    async def _complete(self, request: Request, api: Api, span: Span) -> Response:
        req = await self._read(request, api)
        params = req.kv_transfer_params
        if not params and self._local is not None:
            return await self._run(request, req, self._tokens(req), None, span)
        if not params or params.get("do_remote_prefill") is not True:
            raise bad_request(
                "this is a decode instance of a disaggregated deployment: requests need "
                "kv_transfer_params with do_remote_prefill=true naming the prefill that holds "
                "the KV (send them through the gateway)",
                "kv_transfer_params",
            )
        source = endpoint(params.get("remote_host"), params.get("remote_port"))
        # The KV is pulled from the endpoint checked below as checked, not another spelling.
        url = (
            None
            if source is None
            else kv_url({**params, "remote_host": source[0], "remote_port": source[1]})
        )
        if source is None or url is None:
            raise bad_request(
                "kv_transfer_params needs remote_host, remote_port and remote_request_id",
                "kv_transfer_params",
            )
        kv_id = str(params.get("remote_request_id"))
        if not valid_kv_id(kv_id):
            # It becomes part of a URL this decode calls with the cluster token.
            raise bad_request(
                "kv_transfer_params.remote_request_id must be 8 to 64 ASCII letters and digits",
                "kv_transfer_params",
            )
        host, port = source
        # Known at once in the usual case; a miss may wait for one more read of the registry.
        if (
            self._sources is not None
            and not self._sources.known(host, port)
            and not await until_disconnect(request, self._sources.allowed(host, port))
        ):
            raise ApiError(
                400,
                "kv_transfer_params name no prefill instance of this cluster",
                param="kv_transfer_params",
                code=UNKNOWN_KV_SOURCE,
            )
        return await self._run(request, req, self._tokens(req), (url, kv_id), span)

    async def _run(
        self,
        request: Request,
        req: ApiRequest,
        tokens: list[int],
        kv: tuple[str, str] | None,
        span: Span,
    ) -> Response:
        """Admit the request (429 without a free slot or retrieval room), then stream it or
        answer it whole. `kv` is where its KV is pulled from (URL, id); None: computed here."""
        settings = self._settings
        # Everything read of the request comes before the slot: past it, only `close` ends.
        tools = self._tool_use(req)
        shape = shape_for(req, settings.model, caller_request_id(request), tokens, tools)
        ttft_left_s = _ms_header(request, TTFT_LEFT_HEADER)
        tpot_slo_s = _ms_header(request, TPOT_SLO_HEADER)
        slot = self._slots.try_acquire()
        if slot is None:
            self._counts["rejected"] += 1
            raise busy("no free decode slot", code="no_free_slot")
        try:
            job = self._job(tokens, kv, span)
        except asyncio.QueueFull:
            slot.release()
            self._counts["rejected"] += 1
            raise busy("KV retrieval queue is full", code="kv_queue_full") from None
        self._counts["admitted"] += 1
        decoding = _Decoding(req, tokens, job, shape, span, engine_sampling(req, tools))
        decoding.ttft_left_s = ttft_left_s
        decoding.tpot_slo_s = tpot_slo_s

        def close() -> None:
            self._retriever.abandon(job)
            slot.release()

        if req.stream:

            def close_stream() -> None:
                close()
                end_span(span, decoding.outcome)

            return EventStream(
                self._stream(decoding),
                headers=_SSE_HEADERS,
                on_close=close_stream,
                ping_s=settings.sse_ping_interval_s,
                send_timeout_s=settings.sse_send_timeout_s or None,
            )
        try:
            response = await until_disconnect(request, self._whole(decoding))
        except ClientGone:
            self._counts["cancelled"] += 1
            raise
        finally:
            close()
        end_span(span, "ok", 200)
        return response

    def _job(self, tokens: list[int], kv: tuple[str, str] | None, span: Span) -> PullJob:
        """The pull of the request's KV; raises `asyncio.QueueFull` when the queue is full.
        A plain request's job is done from the start (the engine computes the prompt) and
        has nothing to release at a prefill."""
        if kv is not None:
            url, kv_id = kv
            return self._retriever.submit(url, tokens, kv_id, span)
        assert self._local is not None
        job = PullJob("", tokens, "local-prefill", span, released=True)
        job.future.set_result(self._local.local_kv(tokens))
        self._counts["local_prefills"] += 1
        return job

    async def _pieces(self, decoding: _Decoding) -> AsyncGenerator[_Piece, None]:
        """The completion after stop handling, piece by piece; the last piece has a finish
        reason. Raises `KvTransferError` before the first one."""
        req = decoding.req
        sink = await self._retriever.wait(decoding.job)
        span = self._tracing.start("pdgate.shim.decode_stream", parent=decoding.span)
        matcher = StopMatcher(req.stop_sequences)
        max_tokens = req.max_tokens or 0
        want_logprobs = req.logprob_count is not None
        want_ids = bool(req.return_token_ids)
        # Logprobs and ids of the tokens whose text was not sent yet: they go with it.
        logprobs: list[TokenLogprobs] = []
        ids: list[int] = []

        def piece(text: str, finish: str | None) -> _Piece:
            out = text, finish, logprobs.copy(), ids.copy()
            logprobs.clear()
            ids.clear()
            return out

        local = decoding.job.url == ""
        gate = self._gate if local else None
        seq = next(self._seq)
        # The phase-switching wait (EcoServe 4.2.2): from the end of the prompt's prefill to
        # its first decode step, whatever the strategy. A prompt prefilled elsewhere had
        # finished before it arrived: it waits from admission (its KV pull, then a place in
        # the batch) to its first token here. One computed here ends its prefill with its
        # first token and waits until its second (other prompts' chunks, other phases).
        switch_from, switch_at = decoding.admitted, 2 if local else 1
        try:
            if gate is not None:  # a prompt computed here waits for a prefill phase
                await gate.admit(
                    seq, len(decoding.prompt), decoding.ttft_left_s, decoding.tpot_slo_s
                )
            job = DecodeJob(
                decoding.prompt, max_tokens, sink, decoding.sampling, self._adapter(req)
            )
            generate = self._backend.generate(job)
            async with aclosing(generate) as generated:
                async for token in generated:
                    if gate is not None:
                        gate.token(seq)
                    decoding.generated += 1
                    if decoding.generated <= switch_at:
                        now = time.monotonic()
                        if decoding.generated == switch_at:
                            self._switch_waits += 1
                            self._switch_wait_s += now - switch_from
                        switch_from = now
                    if want_logprobs:
                        if token.logprobs is None:
                            raise InvalidRequest("this engine does not produce logprobs")
                        logprobs.append(token.logprobs)
                    if want_ids:
                        if token.token_id is None:
                            raise InvalidRequest("this engine does not produce token ids")
                        ids.append(token.token_id)
                    text, stopped = matcher.feed(token.text)
                    if stopped:
                        decoding.finish_reason = "stop"
                        yield piece(text, "stop")
                        return
                    if decoding.generated >= max_tokens:
                        yield piece(text + matcher.flush(), "length")
                        return
                    if text:
                        yield piece(text, None)
            # The engine ended before max_tokens: it generated its end-of-sequence token.
            decoding.finish_reason = "stop"
            yield piece(matcher.flush(), "stop")
        finally:
            if gate is not None:
                gate.finished(seq)
            if span.is_recording():
                span.set_attribute("pdgate.completion_tokens", decoding.generated)
                span.set_attribute("pdgate.finish_reason", decoding.finish_reason)
            span.end()

    async def _stream(self, decoding: _Decoding) -> AsyncIterator[bytes]:
        shape = decoding.shape
        started = False
        try:
            try:
                async with aclosing(self._pieces(decoding)) as pieces:
                    async for text, finish, logprobs, token_ids in pieces:
                        if not started:
                            # After the KV arrived: a first event tells the gateway so.
                            started = True
                            if head := shape.start():
                                yield head
                        if event := shape.chunk(text, finish, logprobs, token_ids):
                            yield event
            except (KvTransferError, EngineBusy, InvalidRequest) as exc:
                decoding.outcome = "failed"
                yield self._failed(exc, decoding.job).sse()
                yield SSE_DONE
                return
            if decoding.req.include_usage:
                yield shape.usage_chunk(decoding.usage())
            yield SSE_DONE
            decoding.outcome = "ok"
            self._counts["completed"] += 1
        except (asyncio.CancelledError, GeneratorExit):
            self._counts["cancelled"] += 1
            raise

    async def _whole(self, decoding: _Decoding) -> Response:
        parts: list[str] = []
        logprobs: list[TokenLogprobs] = []
        token_ids: list[int] = []
        try:
            async with aclosing(self._pieces(decoding)) as pieces:
                async for text, _, piece_logprobs, piece_ids in pieces:
                    parts.append(text)
                    logprobs.extend(piece_logprobs)
                    token_ids.extend(piece_ids)
        except (KvTransferError, EngineBusy, InvalidRequest) as exc:
            raise self._failed(exc, decoding.job) from None
        self._counts["completed"] += 1
        return json_response(
            decoding.shape.completion(
                "".join(parts), decoding.finish_reason, decoding.usage(), logprobs, token_ids
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


def _ms_header(request: Request, name: str) -> float | None:
    """Seconds from the gateway's header `name` (milliseconds); None if absent or bad."""
    raw = request.headers.get(name)
    try:
        value = int(raw) / 1000 if raw is not None else None
    except (ValueError, OverflowError):
        return None  # a header this shim cannot read (or beyond any float) sets nothing
    return value if value is not None and value > 0 else None


class AggregatedWorker(DecodeWorker):
    """An instance of an aggregated group: every request comes whole (no KV from a prefill)
    and is prefilled in the running batch, as a decode's local prefill is; with ``phases``,
    only in prefill phases (engine_shim/_phases.py)."""

    role = Role.AGGREGATED
