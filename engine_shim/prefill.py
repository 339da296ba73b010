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
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from config import PrefillAdmission, Role, ShimSettings
from engine_shim._completion import (
    CompletionShape,
    check_length,
    check_model,
    parse_completion,
    usage,
)
from engine_shim._http import (
    ApiError,
    ClientGone,
    ClosingStreamingResponse,
    bad_request,
    busy,
    draining,
    json_response,
    read_body,
    until_disconnect,
)
from engine_shim._kv_store import HeldKv, KvStore
from engine_shim._slots import PoolFull, Slot, SlotPool
from engine_shim._stop import StopMatcher
from engine_shim.backend import EngineBusy, InvalidRequest, PrefillBackend
from engine_shim.prefix_cache import BLOCK_SIZE
from engine_shim.wire import KV_DIGEST_HEADER, KV_ID_HEADER, KV_PATH, KV_TOKENS_HEADER

__all__ = ["PrefillShim"]

log = logging.getLogger("pdgate.shim.prefill")

KV_CHUNK_BYTES = 256 * 1024


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
        settings = self._settings
        if self.draining:
            raise draining()
        req = parse_completion(
            await read_body(request, self._max_body_bytes), max_model_len=settings.max_model_len
        )
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

        slot = await self._admit(request)
        try:
            out = await until_disconnect(request, self._backend.prefill(tokens, req.sampling))
        except EngineBusy:
            slot.release()
            self._counts["rejected"] += 1
            raise busy("prefill batch is full", code="no_free_slot") from None
        except InvalidRequest as exc:
            slot.release()
            raise bad_request(str(exc)) from None
        except BaseException as exc:
            slot.release()
            if isinstance(exc, ClientGone):
                self._counts["cancelled"] += 1
            raise
        request_id = self._kv_id(request)
        self._store.put(HeldKv(request_id, out.kv, slot))
        self._counts["completed"] += 1

        matcher = StopMatcher(req.stop)
        text, stopped = matcher.feed(out.first_token)
        if not stopped:
            text += matcher.flush()
        n_blocks = -(-out.prompt_tokens // BLOCK_SIZE)
        shape = CompletionShape(req.model or settings.model)
        return json_response(
            shape.completion(
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
                    "remote_request_id": request_id,
                    "tp_size": 1,
                },
            )
        )

    def _kv_id(self, request: Request) -> str:
        """The caller may name the KV handle (``x-pdgate-kv-id``) so it can release it even if
        it never reads this answer; anything unusable gets a fresh id."""
        given = request.headers.get(KV_ID_HEADER, "")
        if (
            8 <= len(given) <= 64
            and given.isascii()
            and given.isalnum()
            and given not in self._store
        ):
            return given
        return uuid.uuid4().hex

    async def _admit(self, request: Request) -> Slot:
        if self._settings.admission == PrefillAdmission.REJECT:
            slot = self._slots.try_acquire()
            if slot is None:
                self._counts["rejected"] += 1
                raise busy("no free prefill slot", code="no_free_slot")
        else:
            try:
                slot = await until_disconnect(request, self._slots.acquire())
            except PoolFull:
                self._counts["rejected"] += 1
                raise busy("prefill queue is full", code="queue_full") from None
            except ClientGone:
                self._counts["cancelled"] += 1
                raise
        self._counts["admitted"] += 1
        return slot

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


def _unknown_kv(request_id: str) -> Response:
    return ApiError(
        404,
        f"no KV held for request {request_id[:64]} (fetched, released or expired)",
        code="kv_not_found",
    ).response()
