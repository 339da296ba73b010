"""The prefill leg with ``dispatch = "direct"``: the paper's baseline gateway.

One try at the top-ranked prefill, which may queue the request locally, and no retries: no
gateway queue, no 429 handling, no early drop. Its ranking sees every ready prefill (the
baseline does not know which one has room). It exists to be measured against
(`pdgate bench scheduling`, mode ``baseline``).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

from pdgate.config.aio import Background, shielded
from pdgate.config.wire import DECODE_MAX_TOKENS_HEADER, Role
from pdgate.gateway.admission.retry_after import Departures, RetryAfter
from pdgate.gateway.errors import DeadlineExceeded, UpstreamError, UpstreamRejected, UpstreamStatus
from pdgate.gateway.instances.affinity import PrefixLookup
from pdgate.gateway.instances.tracker import InstanceTracker
from pdgate.gateway.observe.metrics import GatewayMetrics
from pdgate.gateway.placement.decode_attempt import client_error, release_after
from pdgate.gateway.placement.handoff import Handoffs, OnSend
from pdgate.gateway.placement.placed import LegRequest, PrefillGrant
from pdgate.gateway.placement.prefill_call import release_answered, release_unanswered
from pdgate.gateway.upstream.base import Upstream
from pdgate.policies.base import Ranker

__all__ = ["DirectPrefill"]


class DirectPrefill:
    def __init__(
        self,
        retry_after: RetryAfter,
        tracker: InstanceTracker,
        policy: Ranker,
        upstream: Upstream,
        metrics: GatewayMetrics,
        background: Background,
        index: PrefixLookup | None = None,
        handoffs: Handoffs | None = None,
    ) -> None:
        """`retry_after`: what a refused request is told; `background`: where the KV
        releases of its grants run (they outlive requests); `handoffs`: stock servers' legs
        (handoff.py)."""
        self._retry_after = retry_after
        # Prefill calls answered, fleet-wide: a busy prefill's next free slot comes at the
        # pace calls end (there is no gateway queue here to count ahead).
        self._answered = Departures()
        self._tracker = tracker
        self._policy = policy
        self._upstream = upstream
        self._metrics = metrics
        self._background = background
        self._index = index
        self._handoffs = handoffs

    async def prefill(
        self,
        req: LegRequest,
        body: dict[str, Any],
        path: str,
        *,
        on_send: OnSend | None = None,
    ) -> PrefillGrant:
        """The top-ranked prefill's grant for `req`, or 503. `on_send`: as
        `Waiter.on_send`."""
        info, request_id = req.info, req.request_id
        loads = self._tracker.loads(Role.PREFILL, info.model, info.group)
        ranked = self._policy.rank(info, [c for c in loads if not c.ejected]) or loads
        if not ranked:
            raise DeadlineExceeded(
                "no prefill instance is available", retry_after=self._retry_after.membership()
            )
        inst = ranked[0]
        blocks = None
        if self._index is not None:
            blocks = self._index.blocks(info)
            self._index.routed(blocks, inst.id)
        stream, inflight = self._tracker.open_stream(inst.id), self._tracker.begin(inst.id)
        counter = self._metrics.prefill_attempts
        upstream = self._upstream
        handoffs = self._handoffs
        stock = None if handoffs is None else handoffs.stock_leg(inst.id, request_id)
        # The id the call names its KV by, to release it unanswered (a stock server's: none).
        kv_id = secrets.token_hex(16) if stock is None else None

        async def release_unanswered_call(result: str) -> None:
            pending = release_unanswered(
                upstream,
                self._metrics,
                result,
                (stream, inflight),
                url=inst.url,
                kv_id=kv_id,
                request_id=request_id,
            )
            if pending is not None:
                await shielded(pending)

        ended = None if stock is None or on_send is None else on_send(inst, stock)
        computing = self._tracker.computing(inst.id)  # for the `idle` filter's view
        try:
            remaining = max(req.deadline - time.monotonic(), 0.001)
            try:
                reply = await upstream.prefill(
                    inst.url,
                    body if stock is None else stock.prefill_body(body),
                    request_id=request_id if stock is None else stock.leg_id,
                    timeout_s=remaining,
                    kv_id=kv_id,
                    path=path,
                    headers={DECODE_MAX_TOKENS_HEADER: str(info.max_tokens)}
                    if stock is None
                    else stock.prefill_headers(),
                )
            except BaseException:
                if ended is not None:
                    ended(False)
                raise
            finally:
                computing.release(slot_freed=False)
            if ended is not None:
                ended(True)
        except UpstreamRejected as exc:
            release_after(exc, stream, inflight)
            self._tracker.rejected(inst.id)
            counter.labels("rejected").inc()
            raise DeadlineExceeded(
                "the prefill instance is busy", retry_after=self._busy()
            ) from exc
        except UpstreamError as exc:
            if isinstance(exc, UpstreamStatus):
                if exc.is_client_error:
                    release_after(exc, stream, inflight)
                    raise client_error(exc) from exc
                what = "failed"  # it answered, with an error of its own
                told = self._retry_after.membership()  # another may show, this one ejected
            else:
                what = "did not answer"
                told = self._busy()  # slow or swamped: as busy
            # Failed, timed out or lost: the prefill may hold KV for an answer nobody reads.
            await release_unanswered_call("failed")
            counter.labels("failed").inc()
            raise DeadlineExceeded(
                f"the prefill {what} before the TTFT deadline", retry_after=told
            ) from exc
        except BaseException as exc:
            # Cut off unanswered (its client left), or a bug here (as the forwarder's).
            abandoned = isinstance(exc, asyncio.CancelledError)
            if abandoned:
                counter.labels("abandoned").inc()
            await release_unanswered_call("abandoned" if abandoned else "failed")
            raise
        counter.labels("accepted").inc()
        self._answered.left(time.monotonic())
        if self._index is not None and blocks is not None:
            self._index.record(blocks, inst.id)
        params: dict[str, Any] = reply["kv_transfer_params"]
        if stock is not None and handoffs is not None:
            handoffs.learn(stock, params)
        background = self._background
        return PrefillGrant(
            inst,
            reply,
            stream,
            inflight,
            lambda leases: release_answered(
                upstream, handoffs, background, params, leases, request_id=request_id, leg=stock
            ),
            attempts=1,
            rejections=0,
            leg=stock,
        )

    def _busy(self) -> float:
        """Until the next prefill call ends, at the pace they have been ending."""
        now = time.monotonic()
        return self._retry_after.drain(1, self._answered.per_s(now))
