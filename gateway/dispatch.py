"""Placing one request: a prefill that accepts, then a decode that accepts.

This is the P/D-Serve on-demand forwarding loop (section 3.5): rank prefills (policies/),
try them one after another; a 429 means "busy, try the next"; when every candidate of a
round rejected, wait for a slot to free (or a back-off) and go again, until the request's
TTFT deadline. Then the same for the decode leg with the prefill's ``kv_transfer_params``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp

from config import Role
from engine_shim.wire import prefill_kv_request
from gateway.errors import (
    BadGateway,
    BadRequest,
    DeadlineExceeded,
    GatewayError,
    PayloadTooLarge,
    UpstreamError,
    UpstreamRejected,
    UpstreamStatus,
)
from gateway.instances import InstanceTracker, Lease
from gateway.metrics import GatewayMetrics
from gateway.upstream import Upstream, upstream_error_message
from policies.base import Backoff, DecodePolicy, InstanceLoad, PrefillPolicy, RequestInfo

log = logging.getLogger("pdgate.dispatch")

T = TypeVar("T")


@dataclass
class Placement:
    """A request placed on a prefill and a decode; the decode's response is open."""

    response: aiohttp.ClientResponse
    prefill_id: str
    decode_id: str
    leases: list[Lease] = field(default_factory=list)

    def close(self) -> None:
        """Release every count and the upstream connection; safe to call more than once.

        Closing (not releasing) the decode connection mid-stream is what tells the decode
        the client is gone, so it frees the slot at once.
        """
        for lease in self.leases:
            lease.release()
        if not self.response.closed:
            self.response.close()


@dataclass
class _Attempt:
    """Bookkeeping of one request's retry loop, for metrics and errors."""

    rounds: int = 0
    rejections: int = 0
    failures: int = 0
    last_error: str = ""


class Dispatcher:
    def __init__(
        self,
        tracker: InstanceTracker,
        upstream: Upstream,
        prefill_policy: PrefillPolicy,
        decode_policy: DecodePolicy,
        backoff: Backoff,
        metrics: GatewayMetrics,
        *,
        max_candidates: int,
        retry_after_s: int,
    ) -> None:
        self._tracker = tracker
        self._upstream = upstream
        self._prefill_policy = prefill_policy
        self._decode_policy = decode_policy
        self._backoff = backoff
        self._metrics = metrics
        self._max_candidates = max_candidates
        self._retry_after_s = retry_after_s

    async def place(
        self, info: RequestInfo, forward: dict[str, Any], *, request_id: str, deadline: float
    ) -> Placement:
        leases: list[Lease] = []
        kv_params: dict[str, Any] | None = None
        attempt = _Attempt()
        try:
            prefill_id, reply, prefill_inflight = await self._prefill(
                info, forward, request_id, deadline, leases, attempt
            )
            kv_params = reply["kv_transfer_params"]
            decode_body = {**forward, "kv_transfer_params": kv_params}
            decode_id, response = await self._decode(
                info, decode_body, request_id, deadline, leases, attempt
            )
            # The decode owns the KV pull from here; the prefill's slot is its to free.
            prefill_inflight.release()
            self._metrics.retry_rounds.observe(attempt.rounds)
            return Placement(
                response=response, prefill_id=prefill_id, decode_id=decode_id, leases=leases
            )
        except BaseException:
            for lease in leases:
                lease.release()
            if kv_params is not None:
                # Shielded: a cancelled (disconnected) request must still free the prefill slot.
                await _shielded(self._upstream.release_kv(kv_params, request_id=request_id))
            raise

    async def _prefill(
        self,
        info: RequestInfo,
        forward: dict[str, Any],
        request_id: str,
        deadline: float,
        leases: list[Lease],
        attempt: _Attempt,
    ) -> tuple[str, dict[str, Any], Lease]:
        body = {k: v for k, v in forward.items() if k != "stream_options"}
        body.update(max_tokens=1, stream=False, kv_transfer_params=prefill_kv_request())

        async def call(inst: InstanceLoad, remaining: float) -> dict[str, Any]:
            return await self._upstream.prefill(
                inst.url, body, request_id=request_id, timeout_s=remaining
            )

        inst, reply, inflight = await self._try_until_deadline(
            Role.PREFILL,
            self._prefill_policy,
            info,
            call,
            deadline,
            leases,
            attempt,
            self._metrics.prefill_attempts,
        )
        return inst.id, reply, inflight

    async def _decode(
        self,
        info: RequestInfo,
        body: dict[str, Any],
        request_id: str,
        deadline: float,
        leases: list[Lease],
        attempt: _Attempt,
    ) -> tuple[str, aiohttp.ClientResponse]:
        async def call(inst: InstanceLoad, remaining: float) -> aiohttp.ClientResponse:
            return await self._upstream.open_decode(
                inst.url, body, request_id=request_id, connect_timeout_s=remaining
            )

        inst, response, _inflight = await self._try_until_deadline(
            Role.DECODE,
            self._decode_policy,
            info,
            call,
            deadline,
            leases,
            attempt,
            self._metrics.decode_attempts,
        )
        # A decode's in-flight count lasts as long as its stream: keep the lease with the rest.
        return inst.id, response

    async def _try_until_deadline(
        self,
        role: Role,
        policy: PrefillPolicy | DecodePolicy,
        info: RequestInfo,
        call: Callable[[InstanceLoad, float], Awaitable[T]],
        deadline: float,
        leases: list[Lease],
        attempt: _Attempt,
        counter: Any,
    ) -> tuple[InstanceLoad, T, Lease]:
        round_no = 0
        while True:
            ranked = policy.rank(info, self._tracker.loads(role, info.model))[
                : self._max_candidates
            ]
            for inst in ranked:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                stream = self._tracker.open_stream(inst.id)
                inflight = self._tracker.begin(inst.id)
                try:
                    result = await call(inst, remaining)
                except UpstreamRejected:
                    stream.release()
                    inflight.release()
                    self._tracker.rejected(inst.id)
                    counter.labels("rejected").inc()
                    attempt.rejections += 1
                    continue
                except UpstreamStatus as exc:
                    stream.release()
                    inflight.release()
                    if exc.is_client_error:
                        counter.labels("client_error").inc()
                        raise _client_error(exc) from exc
                    self._failed(inst, exc, attempt, counter)
                    continue
                except UpstreamError as exc:
                    stream.release()
                    inflight.release()
                    self._failed(inst, exc, attempt, counter)
                    continue
                except BaseException:
                    stream.release()
                    inflight.release()
                    raise
                counter.labels("accepted").inc()
                leases += [stream, inflight]
                return inst, result, inflight
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._deadline_error(role, ranked, attempt)
            # Every candidate was busy: sleep until one of our requests frees a slot somewhere
            # (the likeliest moment a prefill accepts again) or the back-off passes.
            await self._tracker.wait_freed(min(self._backoff.delay(round_no), remaining))
            round_no += 1
            attempt.rounds += 1

    def _failed(self, inst: InstanceLoad, exc: Exception, attempt: _Attempt, counter: Any) -> None:
        self._tracker.failed(inst.id)
        counter.labels("failed").inc()
        attempt.failures += 1
        attempt.last_error = str(exc)
        log.warning("instance %s failed: %s", inst.id, exc)

    def _deadline_error(
        self, role: Role, ranked: list[InstanceLoad], attempt: _Attempt
    ) -> GatewayError:
        if not ranked and attempt.rejections == 0 and attempt.failures == 0:
            msg = f"no {role.value} instance is available"
        elif attempt.failures and not attempt.rejections:
            return BadGateway(
                f"every {role.value} instance failed; last error: {attempt.last_error}"
            )
        else:
            msg = f"no {role.value} instance accepted the request before its TTFT deadline"
        return DeadlineExceeded(msg, retry_after=self._retry_after_s)


def _client_error(exc: UpstreamStatus) -> GatewayError:
    message = upstream_error_message(exc)
    if exc.status == 413:
        return PayloadTooLarge(message)
    return BadRequest(message)


async def _shielded(coro: Awaitable[None]) -> None:
    task = asyncio.ensure_future(coro)
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.shield(task)
