"""The prefill shim: queue-less admission, one batch slot per request until its KV is taken.

P/D-Serve (section 3.5): a prefill either accepts a request (a free slot) or rejects it at
once with 429, so waiting happens at the gateway, which can still send the request to
another, idle prefill. ``admission=queue`` is the paper's baseline instead: a bounded local
FIFO queue in front of the slots, 429 only when that queue is full.

A request holds its slot from admission through the prefill until a decode has fetched its
KV (``GET /v1/kv/{id}``, single consumer), the gateway released it (``DELETE``), or the hold
timeout expired. A reader that disconnects midway through the GET also frees the slot: the
KV counts as consumed (a decode that lost it fails its request, as a real transfer failure
would), which keeps a slot from waiting out the hold timeout for a transfer that is over.

Each call is counted once, admitted or rejected, and the ``DELETE`` of its KV id says which
(``x-pdgate-admission``), for a while after the call ended too: a gateway that cut a call off
unanswered counts it as the prefill did. A ``DELETE`` that comes first ("unseen") withdraws
the id: the call, arriving later, is refused and counted withdrawn, in neither count.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pdgate.config import PrefillAdmission, Role, ShimSettings
from pdgate.config.openai_api import (
    MAX_JSON_DEPTH,
    Api,
    ClientGone,
    error_body,
    load_object,
    read_body,
)
from pdgate.config.tracing import Span, Tracing
from pdgate.config.wire import (
    ADMISSION_HEADER,
    BATCH_SUFFIX,
    DECODE_MAX_TOKENS_HEADER,
    GATEWAY_ID_HEADER,
    KV_DIGEST_HEADER,
    KV_ID_HEADER,
    KV_PATH,
    KV_TOKENS_HEADER,
    MAX_BATCH,
    valid_kv_id,
)
from pdgate.engine_shim._completion import ApiRequest, shape_for, usage
from pdgate.engine_shim._gateway_watch import GatewayWatch, Liveness
from pdgate.engine_shim._http import (
    ApiError,
    ClosingStreamingResponse,
    ClusterAuth,
    bad_request,
    busy,
    conflict,
    draining,
    json_response,
    until_disconnect,
)
from pdgate.engine_shim._kv_store import HeldKv, KvStore, RecentAdmissions
from pdgate.engine_shim._metrics import Histograms
from pdgate.engine_shim._service import ShimService, caller_request_id, end_span, engine_sampling
from pdgate.engine_shim._slots import PoolFull, Slot, SlotPool
from pdgate.engine_shim._stop import StopMatcher
from pdgate.engine_shim.backend import EngineBusy, InvalidRequest, PrefillBackend, PrefillOutput
from pdgate.engine_shim.prefix_cache import BLOCK_SIZE

__all__ = ["PrefillShim"]

log = logging.getLogger("pdgate.shim.prefill")

KV_CHUNK_BYTES = 256 * 1024


async def _unguarded(work: Awaitable[Any]) -> Any:
    return await work


def _line(index: int, status: int, body: dict[str, Any]) -> bytes:
    return orjson.dumps({"index": index, "status": status, "body": body}) + b"\n"


def _strings(raw: dict[str, Any], name: str) -> list[str]:
    value = raw.get(name) or []
    if not isinstance(value, list) or not all(isinstance(k, str) for k in value):
        raise bad_request(f"{name} must be a list of strings", name)
    return value


@dataclass(frozen=True)
class Batch:
    """A batch call: the requests, and per request (by position, each list optional) the
    caller's KV id, request id and decode leg's max_tokens."""

    items: list[dict[str, Any]]
    kv_ids: list[str]
    request_ids: list[str]
    decode_max_tokens: list[int | None]


def parse_batch(body: bytes, *, max_items: int) -> Batch:
    """``{"requests": [completion body, ...], "kv_ids": [...], "request_ids": [...],
    "decode_max_tokens": [...]}``."""
    # Each request is checked as a body of its own (`parse_completion`): two levels deeper here.
    raw = load_object(body, max_depth=MAX_JSON_DEPTH + 2)
    items = raw.get("requests")
    if not isinstance(items, list) or not items or not all(isinstance(i, dict) for i in items):
        raise bad_request("requests must be a non-empty list of completion requests", "requests")
    if len(items) > max_items:
        raise bad_request(f"at most {max_items} requests per batch", "requests")
    limits = raw.get("decode_max_tokens")
    decode_max = [_positive(x) for x in limits] if isinstance(limits, list) else []
    return Batch(items, _strings(raw, "kv_ids"), _strings(raw, "request_ids"), decode_max)


def _positive(value: object) -> int | None:
    """A positive integer from a header or a JSON value; None for anything else (the
    gateway's own hint: a bad one is ignored, as a server without it would)."""
    try:
        n = int(value) if isinstance(value, str | int) and not isinstance(value, bool) else 0
    except ValueError:
        return None
    return n if n > 0 else None


def _nth(values: list[str], index: int) -> str:
    return values[index] if index < len(values) else ""


class PrefillShim(ShimService[PrefillBackend]):
    role = Role.PREFILL
    counts = (
        "admitted",
        "rejected",
        "completed",
        "cancelled",
        "kv_fetched",
        "kv_lost",
        "kv_released",
        "withdrawn",
    )

    def __init__(
        self,
        settings: ShimSettings,
        backend: PrefillBackend,
        *,
        instance_id: str,
        url: str,
        max_body_bytes: int,
        auth: ClusterAuth | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        queue_limit = (
            settings.local_queue_size if settings.admission == PrefillAdmission.QUEUE else 0
        )
        super().__init__(
            settings,
            backend,
            SlotPool(settings.capacity, queue_limit=queue_limit),
            instance_id=instance_id,
            max_body_bytes=max_body_bytes,
            auth=auth,
            tracing=tracing,
        )
        split = urlsplit(url)
        self._remote_host = split.hostname or settings.host
        self._remote_port = split.port or (443 if split.scheme == "https" else 80)
        self._store = KvStore(settings.kv_hold_timeout_s)
        # KV ids of requests admitted and not yet in the store (computing): an id is in use
        # from admission until its KV is let go, so a second request cannot claim it. Each
        # with its admission so far (None: still waiting for it in the local queue).
        self._computing: dict[str, str | None] = {}
        self._admissions = RecentAdmissions()
        self._sending = 0
        # Prompt tokens of the requests admitted (or waiting in the local queue) and not yet
        # answered: the token-work load as the prefill itself sees it, reported on /load.
        self._prompt_tokens = 0

    def watch_gateways(self, liveness: Liveness, interval_s: float) -> GatewayWatch:
        """What lets go of the KV held for gateways that left the fleet (not started)."""
        return GatewayWatch(self._store, liveness, interval_s=interval_s)

    def routes(self) -> list[Route]:
        return [
            *super().routes(),
            Route(Api.COMPLETIONS.path + BATCH_SUFFIX, self.completions_batch, methods=["POST"]),
            Route(Api.CHAT.path + BATCH_SUFFIX, self.chat_batch, methods=["POST"]),
            Route(KV_PATH, self.kv_get, methods=["GET"]),
            Route(KV_PATH, self.kv_delete, methods=["DELETE"]),
        ]

    def _load(self) -> Mapping[str, Any]:
        holds = self._store.holds
        return {
            "admission": self._settings.admission.value,
            "kv_held": len(self._store),
            # The fleet gateways some of it is held for (one held for a dead one must go).
            "kv_gateways": self._store.gateways(),
            "kv_sending": self._sending,
            "prompt_tokens_inflight": self._prompt_tokens,
            "kv_expired": self._store.expired,
            "kv_gateway_gone": self._store.gateway_gone,
            "kv_dropped_on_arrival": self._store.dropped_on_arrival,
            # How long KV stayed held after its prefill ended (the hold timeout hides leaks).
            "kv_hold_max_s": round(holds.max_s, 6),
            "kv_hold_over_5s": holds.long,
        }

    def histograms(self) -> Histograms:
        return {
            "kv_hold_seconds": (
                "Seconds a prefill's KV (and its slot) stayed held after the prefill finished, "
                "by how the hold ended",
                "outcome",
                self._store.holds.by_outcome,
            )
        }

    async def aclose(self) -> None:
        self._store.close()

    # -- POST /v1/completions, /v1/chat/completions --------------------------------------

    async def _complete(self, request: Request, api: Api, span: Span) -> Response:
        req = await self._read(request, api)
        kv_id = request.headers.get(KV_ID_HEADER, "")
        rid = caller_request_id(request)
        decode_max = _positive(request.headers.get(DECODE_MAX_TOKENS_HEADER))
        answer = await self._prefill_one(
            req,
            kv_id,
            rid,
            lambda work: until_disconnect(request, work),
            span,
            decode_max,
            gateway=_gateway(request),
        )
        end_span(span, "ok", 200)
        return json_response(answer)

    async def _prefill_one(
        self,
        req: ApiRequest,
        kv_id: str,
        rid: str | None,
        guard: Callable[[Awaitable[Any]], Awaitable[Any]],
        span: Span,
        decode_max_tokens: int | None = None,
        *,
        gateway: str = "",
    ) -> dict[str, Any]:
        """Admit, compute and hold the KV of one request (for `gateway`, the fleet gateway
        that asked, if it said: its KV is let go when that gateway leaves the fleet); its
        answer as a dict.

        `decode_max_tokens`: what the decode leg will ask for (the gateway says so); the
        context length is checked with it, so a prompt the decode would refuse is refused
        here, before it is computed, naming the client's ``max_tokens``.

        `guard` runs each wait so that the caller's disconnect cancels it (the single
        endpoint watches its own request; the batch endpoint cancels its items itself).
        `span` is the request's trace span: admission and compute are its children."""
        params = req.kv_transfer_params
        # A plain one-token request is a prefill leg too: routers that speak vLLM's P/D
        # (SMG) send the leg so and pass the answer's kv_transfer_params to the decode.
        implied = params is None and req.max_tokens == 1
        if not implied and (not params or params.get("do_remote_decode") is not True):
            raise bad_request(
                "this is a prefill instance of a disaggregated deployment: requests need "
                "kv_transfer_params with do_remote_decode=true, or max_tokens=1 (send them "
                "through the gateway)",
                "kv_transfer_params",
            )
        tokens = self._tokens(req, decode_max_tokens)
        kv_id = self._claim_kv_id(kv_id)
        self._prompt_tokens += len(tokens)
        try:
            return await self._compute(req, tokens, kv_id, rid, guard, span, gateway)
        finally:
            # In the store now, or never will be: either way no longer "computing".
            outcome = self._computing.pop(kv_id, None)
            if outcome is not None:
                self._admissions.remember(kv_id, outcome)
            self._prompt_tokens -= len(tokens)

    def _claim_kv_id(self, given: str) -> str:
        """The caller may name the KV handle (``x-pdgate-kv-id``) so it can release it even if
        it never reads the answer. An id is one request's from admission until its KV is let
        go: a second request with it gets 409 and holds nothing."""
        if not given:
            kv_id = uuid.uuid4().hex
        elif not valid_kv_id(given):
            raise bad_request(f"{KV_ID_HEADER} must be 8 to 64 ASCII letters and digits")
        elif given in self._computing or given in self._store:
            raise conflict(
                f"KV id {given} is already in use by another request", code="duplicate_kv_id"
            )
        else:
            kv_id = given
        self._computing[kv_id] = None
        return kv_id

    async def _compute(
        self,
        req: ApiRequest,
        tokens: list[int],
        kv_id: str,
        rid: str | None,
        guard: Callable[[Awaitable[Any]], Awaitable[Any]],
        span: Span,
        gateway: str,
    ) -> dict[str, Any]:
        settings = self._settings
        tools = self._tool_use(req)
        slot = await self._admit(kv_id, guard, span)
        compute = self._tracing.start("pdgate.shim.prefill_compute", parent=span)
        if compute.is_recording():
            compute.set_attribute("pdgate.prompt_tokens", len(tokens))
        # The engine call runs as its own task so that the slot follows the engine, not the
        # caller: a caller that leaves mid-prefill returns at once, but the slot is freed only
        # when the engine has dropped the prompt (see `_free_when_engine_done`).
        adapter = self._adapter(req)
        sampling = engine_sampling(req, tools)
        call = (
            self._backend.prefill(tokens, sampling)
            if adapter is None
            else self._backend.prefill(tokens, sampling, adapter=adapter)
        )
        work = asyncio.ensure_future(call)
        try:
            out = await guard(asyncio.shield(work))
        except BaseException as exc:
            _free_when_engine_done(work, slot)
            if isinstance(exc, EngineBusy):
                self._engine_refused(kv_id)
                end_span(compute, "rejected", 429)
                raise busy("prefill batch is full", code="no_free_slot") from None
            if isinstance(exc, InvalidRequest):
                end_span(compute, "invalid", 400)
                raise bad_request(str(exc)) from None
            if isinstance(exc, ClientGone | asyncio.CancelledError):
                self._counts["cancelled"] += 1
            end_span(compute, "cancelled" if isinstance(exc, ClientGone) else "failed")
            raise
        if compute.is_recording():
            compute.set_attribute("pdgate.cached_tokens", out.cached_tokens)
            compute.set_attribute("pdgate.kv_bytes", out.kv.nbytes)
        end_span(compute, "ok")
        held = HeldKv(kv_id, out.kv, slot, gateway)
        if req.logprob_count is not None and out.logprobs is None:
            held.close()
            raise bad_request("this engine does not produce logprobs", "logprobs")
        if req.return_token_ids and out.first_token_id is None:
            held.close()
            raise bad_request("this engine does not produce token ids", "return_token_ids")
        self._store.put(held)
        self._counts["completed"] += 1

        matcher = StopMatcher(req.stop_sequences)
        text, stopped = matcher.feed(out.first_token)
        if not stopped:
            text += matcher.flush()
        n_blocks = -(-out.prompt_tokens // BLOCK_SIZE)
        shape = shape_for(req, settings.model, rid, tokens, tools)
        return shape.completion(
            text,
            "stop" if stopped else "length",
            usage(out.prompt_tokens, 1, out.cached_tokens),
            () if out.logprobs is None else (out.logprobs,),
            () if out.first_token_id is None else (out.first_token_id,),
            kv_transfer_params={
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": self._instance_id,
                "remote_host": self._remote_host,
                "remote_port": self._remote_port,
                "remote_block_ids": list(range(n_blocks)),
                "remote_request_id": kv_id,
                "tp_size": 1,
            },
        )

    async def _admit(
        self, kv_id: str, guard: Callable[[Awaitable[Any]], Awaitable[Any]], parent: Span
    ) -> Slot:
        span = self._tracing.start("pdgate.shim.admission", parent=parent)
        if span.is_recording():
            span.set_attribute("pdgate.admission", self._settings.admission.value)
            span.set_attribute("pdgate.free_slots", self._slots.free)
        reject = self._settings.admission == PrefillAdmission.REJECT
        slot: Slot | None
        if reject:
            slot = self._slots.try_acquire()
        else:
            try:
                slot = await guard(self._slots.acquire())
            except PoolFull:
                slot = None
            except (ClientGone, asyncio.CancelledError):
                self._counts["cancelled"] += 1
                end_span(span, "cancelled")
                raise
        if self._store.withdrawn(kv_id):
            # Released before it was admitted or refused: the releaser heard "unseen" and
            # counted it so; it must stay out of both counts.
            if slot is not None:
                slot.release()
            self._counts["withdrawn"] += 1
            end_span(span, "withdrawn", 409)
            raise conflict(f"KV id {kv_id} was released before this request", code="kv_released")
        outcome = "rejected" if slot is None else "admitted"
        self._counts[outcome] += 1
        self._computing[kv_id] = outcome
        if slot is None:
            end_span(span, "rejected", 429)
            if reject:
                raise busy("no free prefill slot", code="no_free_slot")
            raise busy("prefill queue is full", code="queue_full")
        end_span(span, "accepted")
        return slot

    def _engine_refused(self, kv_id: str) -> None:
        """The engine refused a prompt the slots admitted: the caller gets a 429, so the call
        counts once, rejected (the admitted count steps back: a race the slots keep rare).
        Unless its id was released meanwhile: the releaser heard "admitted", and left."""
        if self._store.released_early(kv_id):
            return
        self._counts["admitted"] -= 1
        self._counts["rejected"] += 1
        self._computing[kv_id] = "rejected"

    def _admission(self, kv_id: str) -> str:
        """What this prefill did with the call that named `kv_id`, for its release."""
        outcome = self._computing.get(kv_id) or self._admissions.get(kv_id)
        return outcome or "unseen"

    # -- POST /v1/completions/batch (pdgate extension) ----------------------------------------

    async def completions_batch(self, request: Request) -> Response:
        return await self._batch(request, Api.COMPLETIONS)

    async def chat_batch(self, request: Request) -> Response:
        return await self._batch(request, Api.CHAT)

    async def _batch(self, request: Request, api: Api) -> Response:
        """Several prefill requests of one API in one call (P/D-Serve batch forwarding).

        Admission happens in list order at once: the first requests take the free slots, the
        rest are rejected individually. The answer is NDJSON, one line per request as soon as
        its outcome is known (rejections at once, completions when computed):
        ``{"index": i, "status": 200 | 4xx, "body": completion | OpenAI error}``.
        """
        try:
            self._auth.check(request)
            if self.draining:
                raise draining()
            body = await read_body(request, self._max_body_bytes, self._settings.body_timeout_s)
            batch = parse_batch(body, max_items=MAX_BATCH)
        except ApiError as exc:
            return exc.response()
        except ClientGone:
            return Response(status_code=499)
        gateway = _gateway(request)
        parsed: list[ApiRequest | ApiError] = []
        for raw in batch.items:
            try:
                parsed.append(self._parse(orjson.dumps(raw), api))
            except ApiError as exc:
                parsed.append(exc)
        # One span for the call (it carries one traceparent), a child per item.
        batch_span = self._tracing.serve("pdgate.shim.prefill_batch", request.headers)
        if batch_span.is_recording():
            batch_span.set_attribute("pdgate.instance", self._instance_id)
            batch_span.set_attribute("pdgate.api", api.value)
            batch_span.set_attribute("pdgate.batch_size", len(parsed))

        async def run(index: int) -> bytes:
            item = parsed[index]
            span = self._tracing.start("pdgate.shim.prefill", parent=batch_span)
            try:
                if isinstance(item, ApiError):
                    raise item
                rid = _nth(batch.request_ids, index) or None
                limits = batch.decode_max_tokens
                limit = limits[index] if index < len(limits) else None
                body = await self._prefill_one(
                    item, _nth(batch.kv_ids, index), rid, _unguarded, span, limit, gateway=gateway
                )
                end_span(span, "ok", 200)
                return _line(index, 200, body)
            except ApiError as exc:
                end_span(span, "error", exc.status)
                return _line(index, exc.status, exc.body())
            except Exception:
                # One item's bug must not end the others' answers.
                log.exception("batch item %d failed", index)
                end_span(span, "internal_error", 500)
                return _line(index, 500, error_body("internal error", "internal_error"))
            except BaseException:
                end_span(span, "cancelled")
                raise

        # Created in order, so admission (the first step of each) happens in list order.
        tasks = [asyncio.ensure_future(run(i)) for i in range(len(parsed))]

        async def lines() -> AsyncIterator[bytes]:
            for done in asyncio.as_completed(tasks):
                yield await done

        def cancel_rest() -> None:
            # The caller left (or the stream ended): unfinished prefills free their slots.
            for task in tasks:
                task.cancel()
            batch_span.end()

        return ClosingStreamingResponse(
            lines(), media_type="application/x-ndjson", on_close=cancel_rest
        )

    # -- KV hand-off ------------------------------------------------------------------------

    async def kv_get(self, request: Request) -> Response:
        try:
            self._auth.check(request)  # the KV is the prompt, in another form
        except ApiError as exc:
            return exc.response()
        request_id = request.path_params["request_id"]
        entry = self._store.take(request_id)
        if entry is None:
            return _unknown_kv(request_id)
        kv = entry.kv
        sent = False

        async def body() -> AsyncIterator[bytes]:
            nonlocal sent
            async for chunk in kv.chunks(KV_CHUNK_BYTES):
                yield chunk
                # uvicorn drops writes to a closed connection without an error; yielding to
                # the loop lets the disconnect listener stop this stream instead.
                await asyncio.sleep(0)
            sent = True

        def on_close() -> None:
            self._sending -= 1
            if sent:
                self._counts["kv_fetched"] += 1
            else:
                self._counts["kv_lost"] += 1
                log.info("KV reader of request %s left midway; KV dropped, slot freed", request_id)
            entry.close("fetched" if sent else "lost")

        self._sending += 1
        return ClosingStreamingResponse(
            body(),
            media_type="application/octet-stream",
            headers={
                "content-length": str(kv.nbytes),
                KV_TOKENS_HEADER: str(kv.tokens),
                KV_DIGEST_HEADER: kv.digest,
            },
            on_close=on_close,
        )

    async def kv_delete(self, request: Request) -> Response:
        try:
            self._auth.check(request)
        except ApiError as exc:
            return exc.response()
        request_id = request.path_params["request_id"]
        admission = {ADMISSION_HEADER: self._admission(request_id)}
        entry = self._store.take(request_id)
        if entry is None:
            if len(request_id) <= 64:
                # An "unseen" id is withdrawn so: its call, if it comes, is refused uncounted.
                self._store.release_unknown(request_id)
            return _unknown_kv(request_id, admission)
        entry.close("released")
        self._counts["kv_released"] += 1
        return Response(status_code=204, headers=admission)


def _gateway(request: Request) -> str:
    """The fleet gateway a call says it comes from ("": none, or not a plausible id)."""
    value = request.headers.get(GATEWAY_ID_HEADER, "")
    return value if len(value) <= 64 and value.isprintable() else ""


def _free_when_engine_done(work: asyncio.Future[PrefillOutput], slot: Slot) -> None:
    """Release `slot` once the engine call `work` is over, cancelling it if it is not.

    Cancelling withdraws a prompt that has not started at once, but an engine that is
    computing it drops it only at its next step boundary (a chunk of chunked prefill in vLLM,
    the whole batch in the sim). Freeing the slot before that would let the shim admit a
    request it cannot start, and under overload every such request misses its deadline in
    turn: the prefill advertises room while it is busy.
    """

    def done(task: asyncio.Future[PrefillOutput]) -> None:
        slot.release()
        if task.cancelled() or task.exception() is not None:  # retrieves it: no stray log
            return
        task.result().kv.release()  # finished just as its caller left: nobody will fetch it

    if work.done():
        done(work)
    else:
        work.cancel()
        work.add_done_callback(done)


def _unknown_kv(request_id: str, headers: Mapping[str, str] | None = None) -> Response:
    return ApiError(
        404,
        f"no KV held for request {request_id[:64]} (fetched, released or expired)",
        code="kv_not_found",
        headers=headers,
    ).response()
