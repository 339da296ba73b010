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
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from config import PrefillAdmission, Role, ShimSettings
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
from engine_shim._kv_store import HeldKv, KvStore
from engine_shim._slots import PoolFull, Slot, SlotPool
from engine_shim._stop import StopMatcher
from engine_shim.backend import EngineBusy, InvalidRequest, PrefillBackend, PrefillOutput
from engine_shim.prefix_cache import BLOCK_SIZE
from engine_shim.wire import (
    BATCH_PATH,
    KV_DIGEST_HEADER,
    KV_ID_HEADER,
    KV_PATH,
    KV_TOKENS_HEADER,
    ClientGone,
    error_body,
    read_body,
)

__all__ = ["PrefillShim"]

log = logging.getLogger("pdgate.shim.prefill")

KV_CHUNK_BYTES = 256 * 1024
MAX_BATCH = 256  # requests in one batch call


async def _unguarded(work: Awaitable[Any]) -> Any:
    return await work


def _line(index: int, status: int, body: dict[str, Any]) -> bytes:
    return orjson.dumps({"index": index, "status": status, "body": body}) + b"\n"


def parse_batch(body: bytes, *, max_items: int) -> tuple[list[dict[str, Any]], list[str]]:
    """``{"requests": [completion body, ...], "kv_ids": [optional ids, ...]}``."""
    try:
        raw = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise bad_request("request body is not valid JSON") from None
    items = raw.get("requests") if isinstance(raw, dict) else None
    if not isinstance(items, list) or not items or not all(isinstance(i, dict) for i in items):
        raise bad_request("requests must be a non-empty list of completion requests", "requests")
    if len(items) > max_items:
        raise bad_request(f"at most {max_items} requests per batch", "requests")
    kv_ids = raw.get("kv_ids") or []
    if not isinstance(kv_ids, list) or not all(isinstance(k, str) for k in kv_ids):
        raise bad_request("kv_ids must be a list of strings", "kv_ids")
    return items, kv_ids


class PrefillShim:
    role = Role.PREFILL

    def __init__(
        self,
        settings: ShimSettings,
        backend: PrefillBackend,
        *,
        instance_id: str,
        url: str,
        max_body_bytes: int,
    ) -> None:
        self._settings = settings
        self._backend = backend
        self._instance_id = instance_id
        self._max_body_bytes = max_body_bytes
        split = urlsplit(url)
        self._remote_host = split.hostname or settings.host
        self._remote_port = split.port or (443 if split.scheme == "https" else 80)
        queue_limit = (
            settings.local_queue_size if settings.admission == PrefillAdmission.QUEUE else 0
        )
        self._slots = SlotPool(settings.capacity, queue_limit=queue_limit)
        self._store = KvStore(settings.kv_hold_timeout_s)
        self._sending = 0
        self.draining = False
        self._counts = dict.fromkeys(
            (
                "admitted",
                "rejected",
                "completed",
                "cancelled",
                "kv_fetched",
                "kv_lost",
                "kv_released",
            ),
            0,
        )

    @property
    def slots(self) -> SlotPool:
        return self._slots

    def routes(self) -> list[Route]:
        return [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route(BATCH_PATH, self.completions_batch, methods=["POST"]),
            Route(KV_PATH, self.kv_get, methods=["GET"]),
            Route(KV_PATH, self.kv_delete, methods=["DELETE"]),
        ]

    def load(self) -> dict[str, Any]:
        stats = self._backend.stats()
        return {
            "role": self.role.value,
            "instance_id": self._instance_id,
            "model": self._settings.model,
            "group": self._settings.group,
            "admission": self._settings.admission.value,
            "draining": self.draining,
            "capacity": self._slots.capacity,
            "used": self._slots.used,
            "free": self._slots.free,
            "queued": self._slots.queued,
            "waiting": stats.waiting,
            "running": stats.running,
            "retrieving": 0,
            "kv_held": len(self._store),
            "kv_sending": self._sending,
            "prefix_cache_hit_tokens": stats.prefix_hit_tokens,
            "prefix_cache_total_tokens": stats.prefix_query_tokens,
            "kv_cache_usage": stats.kv_cache_usage,
            "engine_aborted": stats.aborted,
            **self._counts,
            "kv_expired": self._store.expired,
            "kv_dropped_on_arrival": self._store.dropped_on_arrival,
        }

    def start(self) -> None:
        return None

    async def aclose(self) -> None:
        self._store.close()

    # -- POST /v1/completions -------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        try:
            return await self._complete(request)
        except ApiError as exc:
            return exc.response()
        except ClientGone:
            return Response(status_code=499)  # nobody is listening; for the access log only

    async def _complete(self, request: Request) -> Response:
        if self.draining:
            raise draining()
        req = parse_completion(
            await read_body(request, self._max_body_bytes),
            max_model_len=self._settings.max_model_len,
        )
        kv_id = self._kv_id(request.headers.get(KV_ID_HEADER, ""))
        return json_response(
            await self._prefill_one(req, kv_id, lambda work: until_disconnect(request, work))
        )

    async def _prefill_one(
        self,
        req: CompletionRequest,
        kv_id: str,
        guard: Callable[[Awaitable[Any]], Awaitable[Any]],
    ) -> dict[str, Any]:
        """Admit, compute and hold the KV of one request; its completion as a dict.

        `guard` runs each wait so that the caller's disconnect cancels it (the single
        endpoint watches its own request; the batch endpoint cancels its items itself)."""
        settings = self._settings
        check_model(req, settings.model)
        params = req.kv_transfer_params
        if not params or params.get("do_remote_decode") is not True:
            raise bad_request(
                "this is a prefill instance of a disaggregated deployment: requests need "
                "kv_transfer_params with do_remote_decode=true (send them through the gateway)",
                "kv_transfer_params",
            )
        try:
            tokens = self._backend.tokenize(req.prompt)
        except ValueError as exc:
            raise bad_request(str(exc), "prompt") from None
        check_length(len(tokens), req.max_tokens, settings.max_model_len)

        slot = await self._admit(guard)
        # The engine call runs as its own task so that the slot follows the engine, not the
        # caller: a caller that leaves mid-prefill returns at once, but the slot is freed only
        # when the engine has dropped the prompt (see `_free_when_engine_done`).
        work = asyncio.ensure_future(self._backend.prefill(tokens, req.sampling))
        try:
            out = await guard(asyncio.shield(work))
        except BaseException as exc:
            _free_when_engine_done(work, slot)
            if isinstance(exc, EngineBusy):
                self._counts["rejected"] += 1
                raise busy("prefill batch is full", code="no_free_slot") from None
            if isinstance(exc, InvalidRequest):
                raise bad_request(str(exc)) from None
            if isinstance(exc, ClientGone | asyncio.CancelledError):
                self._counts["cancelled"] += 1
            raise
        self._store.put(HeldKv(kv_id, out.kv, slot))
        self._counts["completed"] += 1

        matcher = StopMatcher(req.stop)
        text, stopped = matcher.feed(out.first_token)
        if not stopped:
            text += matcher.flush()
        n_blocks = -(-out.prompt_tokens // BLOCK_SIZE)
        shape = CompletionShape(req.model or settings.model)
        return shape.completion(
            text,
            "stop" if stopped else "length",
            usage(out.prompt_tokens, 1, out.cached_tokens),
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

    def _kv_id(self, given: str) -> str:
        """The caller may name the KV handle (``x-pdgate-kv-id``) so it can release it even if
        it never reads the answer; anything unusable gets a fresh id."""
        if (
            8 <= len(given) <= 64
            and given.isascii()
            and given.isalnum()
            and given not in self._store
        ):
            return given
        return uuid.uuid4().hex

    async def _admit(self, guard: Callable[[Awaitable[Any]], Awaitable[Any]]) -> Slot:
        if self._settings.admission == PrefillAdmission.REJECT:
            slot = self._slots.try_acquire()
            if slot is None:
                self._counts["rejected"] += 1
                raise busy("no free prefill slot", code="no_free_slot")
        else:
            try:
                slot = await guard(self._slots.acquire())
            except PoolFull:
                self._counts["rejected"] += 1
                raise busy("prefill queue is full", code="queue_full") from None
            except (ClientGone, asyncio.CancelledError):
                self._counts["cancelled"] += 1
                raise
        self._counts["admitted"] += 1
        return slot

    # -- POST /v1/completions/batch (pdgate extension) ----------------------------------------

    async def completions_batch(self, request: Request) -> Response:
        """Several prefill requests in one call (P/D-Serve batch forwarding).

        Admission happens in list order at once: the first requests take the free slots, the
        rest are rejected individually. The answer is NDJSON, one line per request as soon as
        its outcome is known (rejections at once, completions when computed):
        ``{"index": i, "status": 200 | 4xx, "body": completion | OpenAI error}``.
        """
        try:
            if self.draining:
                raise draining()
            items, kv_ids = parse_batch(
                await read_body(request, self._max_body_bytes), max_items=MAX_BATCH
            )
        except ApiError as exc:
            return exc.response()
        except ClientGone:
            return Response(status_code=499)
        parsed: list[CompletionRequest | ApiError] = []
        for raw in items:
            try:
                parsed.append(
                    parse_completion(orjson.dumps(raw), max_model_len=self._settings.max_model_len)
                )
            except ApiError as exc:
                parsed.append(exc)

        async def run(index: int) -> bytes:
            item = parsed[index]
            try:
                if isinstance(item, ApiError):
                    raise item
                kv_id = self._kv_id(kv_ids[index] if index < len(kv_ids) else "")
                body = await self._prefill_one(item, kv_id, _unguarded)
                return _line(index, 200, body)
            except ApiError as exc:
                return _line(index, exc.status, error_body(exc.message, exc.type, code=exc.code))

        # Created in order, so admission (the first step of each) happens in list order.
        tasks = [asyncio.ensure_future(run(i)) for i in range(len(parsed))]

        async def lines() -> AsyncIterator[bytes]:
            for done in asyncio.as_completed(tasks):
                yield await done

        def cancel_rest() -> None:
            # The caller left (or the stream ended): unfinished prefills free their slots.
            for task in tasks:
                task.cancel()

        return ClosingStreamingResponse(
            lines(), media_type="application/x-ndjson", on_close=cancel_rest
        )

    # -- KV hand-off ------------------------------------------------------------------------

    async def kv_get(self, request: Request) -> Response:
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
            entry.close()

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
        request_id = request.path_params["request_id"]
        entry = self._store.take(request_id)
        if entry is None:
            if len(request_id) <= 64:
                self._store.release_unknown(request_id)
            return _unknown_kv(request_id)
        entry.close()
        self._counts["kv_released"] += 1
        return Response(status_code=204)


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


def _unknown_kv(request_id: str) -> Response:
    return ApiError(
        404,
        f"no KV held for request {request_id[:64]} (fetched, released or expired)",
        code="kv_not_found",
    ).response()
