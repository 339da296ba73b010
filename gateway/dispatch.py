"""Placing one request: a prefill that accepts, then a decode that accepts.

Prefill leg, ``dispatch = "queue"`` (P/D-Serve on-demand forwarding): the request joins its
(model, group) queue and a `PrefillForwarder` sends it to an idle prefill, retrying on 429s
until the request's TTFT deadline. ``dispatch = "direct"`` is the paper's baseline gateway:
one try at the top-ranked prefill (which may queue locally), no retries.

Decode leg: the prefill's ``kv_transfer_params`` go to a decode chosen by the decode policy;
a 429 tries the next one, then waits for a freed slot or a back-off, until the deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from config import DispatchMode, GatewaySettings, Role
from engine_shim.wire import prefill_kv_request
from gateway.affinity import PrefixIndex
from gateway.errors import (
    BadGateway,
    BadRequest,
    DeadlineExceeded,
    GatewayError,
    PayloadTooLarge,
    UpstreamError,
    UpstreamRejected,
    UpstreamStatus,
    UpstreamUnreachable,
)
from gateway.forwarder import ForwardingOptions, PrefillForwarder, PrefillGrant
from gateway.instances import InstanceTracker, Lease
from gateway.metrics import GatewayMetrics
from gateway.queue import Waiter, WaitQueue
from gateway.upstream import Upstream, upstream_error_message
from policies.base import Backoff, DecodePolicy, InstanceLoad, PrefillPolicy, RequestInfo

log = logging.getLogger("pdgate.dispatch")

# Queues exist only for (model, group) pairs the registry knows, so this bound is a backstop.
_MAX_QUEUES = 1024


@dataclass
class Placement:
    """A request placed on a prefill and a decode; the decode's response is open."""

    response: aiohttp.ClientResponse
    prefill_id: str
    decode_id: str
    leases: list[Lease] = field(default_factory=list)
    prefill_attempts: int = 1
    prefill_rejections: int = 0

    def close(self) -> None:
        """Release every count and the upstream connection; safe to call more than once.

        Closing (not releasing) the decode connection mid-stream is what tells the decode
        the client is gone, so it frees the slot at once.
        """
        for lease in self.leases:
            lease.release()
        if not self.response.closed:
            self.response.close()


class Dispatcher:
    def __init__(
        self,
        settings: GatewaySettings,
        tracker: InstanceTracker,
        upstream: Upstream,
        prefill_policy: PrefillPolicy,
        decode_policy: DecodePolicy,
        backoff: Backoff,
        metrics: GatewayMetrics,
        index: PrefixIndex | None,
    ) -> None:
        self._settings = settings
        self._tracker = tracker
        self._upstream = upstream
        self._prefill_policy = prefill_policy
        self._decode_policy = decode_policy
        self._backoff = backoff
        self._metrics = metrics
        self._index = index
        self._forwarders: dict[tuple[str, str | None], PrefillForwarder] = {}
        self._options = ForwardingOptions(
            batch_forwarding=settings.batch_forwarding,
            batch_endpoint=settings.prefill_batch_endpoint,
            retry_after_s=settings.retry_after_s,
            client_error=client_error,
            early_drop=settings.early_drop,
            prefill_estimate_quantile=settings.prefill_estimate_quantile,
        )

    async def close(self) -> None:
        for fwd in self._forwarders.values():
            await fwd.close()
        self._forwarders.clear()

    def queued(self) -> int:
        """Requests waiting at the gateway for a prefill (queued or being tried)."""
        return sum(f.waiting for f in self._forwarders.values())

    async def place(
        self, info: RequestInfo, forward: dict[str, Any], *, request_id: str, deadline: float
    ) -> Placement:
        body = {k: v for k, v in forward.items() if k != "stream_options"}
        body.update(max_tokens=1, stream=False, kv_transfer_params=prefill_kv_request())
        grant = await self._prefill(info, body, request_id, deadline)
        leases = [grant.stream, grant.inflight]
        kv_params: dict[str, Any] = grant.reply["kv_transfer_params"]
        try:
            decode_body = {**forward, "kv_transfer_params": kv_params}
            decode, response, decode_leases = await self._decode(
                info, decode_body, request_id, deadline
            )
        except BaseException:
            for lease in leases:
                lease.release()
            # Shielded: a cancelled (disconnected) request must still free the prefill's KV.
            await _shielded(self._upstream.release_kv(kv_params, request_id=request_id))
            raise
        # The decode owns the KV pull from here; the prefill frees its slot once pulled.
        grant.inflight.release()
        self._metrics.prefill_rejections.observe(grant.rejections)
        return Placement(
            response=response,
            prefill_id=grant.instance.id,
            decode_id=decode.id,
            leases=[*leases, *decode_leases],
            prefill_attempts=grant.attempts,
            prefill_rejections=grant.rejections,
        )

    async def _prefill(
        self, info: RequestInfo, body: dict[str, Any], request_id: str, deadline: float
    ) -> PrefillGrant:
        if self._settings.dispatch is DispatchMode.DIRECT:
            return await self._prefill_direct(info, body, request_id, deadline)
        waiter = Waiter(
            info=info,
            body=body,
            request_id=request_id,
            deadline=deadline,
            future=asyncio.get_running_loop().create_future(),
        )
        return await self._forwarder(info).acquire(waiter)

    def _forwarder(self, info: RequestInfo) -> PrefillForwarder:
        key = (info.model, info.group)
        fwd = self._forwarders.get(key)
        if fwd is None:
            if len(self._forwarders) >= _MAX_QUEUES:
                for k in [k for k, f in self._forwarders.items() if f.idle]:
                    del self._forwarders[k]
            fwd = self._forwarders[key] = PrefillForwarder(
                info.model,
                info.group,
                WaitQueue(self._settings.queue_size, self._settings.queue_order),
                self._tracker,
                self._upstream,
                self._prefill_policy,
                self._backoff,
                self._metrics,
                self._index,
                self._options,
            )
        return fwd

    async def _prefill_direct(
        self, info: RequestInfo, body: dict[str, Any], request_id: str, deadline: float
    ) -> PrefillGrant:
        """The paper's original gateway: the top-ranked prefill or nothing."""
        ranked = self._prefill_policy.rank(
            info, self._tracker.loads(Role.PREFILL, info.model, info.group)
        )
        if not ranked:
            raise DeadlineExceeded(
                "no prefill instance is available", retry_after=self._settings.retry_after_s
            )
        inst = ranked[0]
        stream, inflight = self._tracker.open_stream(inst.id), self._tracker.begin(inst.id)
        counter = self._metrics.prefill_attempts
        kv_id = uuid.uuid4().hex
        try:
            remaining = max(deadline - time.monotonic(), 0.001)
            reply = await self._upstream.prefill(
                inst.url, body, request_id=request_id, timeout_s=remaining, kv_id=kv_id
            )
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError | TimeoutError | UpstreamUnreachable):
                # The prefill may hold KV for an answer we will never read.
                await _shielded(
                    self._upstream.release_kv_id(inst.url, kv_id, request_id=request_id)
                )
            _release_after(exc, stream, inflight)
            if isinstance(exc, UpstreamRejected):
                self._tracker.rejected(inst.id)
                counter.labels("rejected").inc()
                raise DeadlineExceeded(
                    "the prefill instance is busy", retry_after=self._settings.retry_after_s
                ) from exc
            if isinstance(exc, UpstreamStatus) and exc.is_client_error:
                raise client_error(exc) from exc
            if isinstance(exc, TimeoutError | UpstreamError):
                counter.labels("failed").inc()
                raise DeadlineExceeded(
                    "the prefill did not answer before the TTFT deadline",
                    retry_after=self._settings.retry_after_s,
                ) from exc
            raise
        counter.labels("accepted").inc()
        if self._index is not None:
            self._index.record(self._index.hashes(info.prompt), inst.id)
        return PrefillGrant(inst, reply, stream, inflight, attempts=1, rejections=0)

    async def _decode(
        self, info: RequestInfo, body: dict[str, Any], request_id: str, deadline: float
    ) -> tuple[InstanceLoad, aiohttp.ClientResponse, list[Lease]]:
        counter = self._metrics.decode_attempts
        round_no = 0
        failures: list[str] = []
        while True:
            ranked = self._decode_policy.rank(
                info, self._tracker.loads(Role.DECODE, info.model, info.group)
            )
            for inst in ranked[: self._settings.max_candidates]:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                stream, inflight = self._tracker.open_stream(inst.id), self._tracker.begin(inst.id)
                try:
                    response = await self._upstream.open_decode(
                        inst.url, body, request_id=request_id, connect_timeout_s=remaining
                    )
                except BaseException as exc:
                    _release_after(exc, stream, inflight)
                    if isinstance(exc, UpstreamRejected):
                        self._tracker.rejected(inst.id)
                        counter.labels("rejected").inc()
                        continue
                    if isinstance(exc, UpstreamStatus) and exc.is_client_error:
                        counter.labels("client_error").inc()
                        raise client_error(exc) from exc
                    if isinstance(exc, UpstreamError):
                        # The KV pull may have consumed the prefill's copy: do not try another
                        # decode with the same kv_transfer_params.
                        self._tracker.failed(inst.id)
                        counter.labels("failed").inc()
                        log.warning("decode %s failed: %s", inst.id, exc)
                        failures.append(str(exc))
                        if isinstance(exc, UpstreamStatus):
                            raise BadGateway("the decode instance failed") from exc
                        continue
                    raise
                counter.labels("accepted").inc()
                return inst, response, [stream, inflight]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if failures and not ranked:
                    raise BadGateway(f"every decode instance failed; last error: {failures[-1]}")
                what = (
                    "no decode instance is available"
                    if not ranked
                    else "no decode instance accepted the request before its TTFT deadline"
                )
                raise DeadlineExceeded(what, retry_after=self._settings.retry_after_s)
            await self._tracker.wait_freed(min(self._backoff.delay(round_no), remaining))
            round_no += 1


def _release_after(exc: BaseException, *leases: Lease) -> None:
    """Give back the counts of a call that failed with `exc`. A rejected or unreachable
    instance never took the request, so its end is no sign of a freed slot."""
    took_slot = not isinstance(exc, UpstreamRejected | UpstreamUnreachable)
    for lease in leases:
        lease.release(slot_freed=took_slot)


def client_error(exc: UpstreamStatus) -> GatewayError:
    """An instance said the request itself is bad: tell the client in its words."""
    message = upstream_error_message(exc)
    if exc.status == 413:
        return PayloadTooLarge(message)
    return BadRequest(message)


async def _shielded(coro: Awaitable[None]) -> None:
    task = asyncio.ensure_future(coro)
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.shield(task)
