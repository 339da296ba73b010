"""Placing one request: a prefill that accepts, then a decode that accepts.

`Dispatcher` is the placement stage's entry, and it holds the parts that place each leg,
built by the composition root (gateway/app.py, `build_dispatcher`):

- the prefill leg, ``dispatch = "queue"`` (P/D-Serve on-demand forwarding): the request joins
  its (model, group) queue (queues.py) and the queue's `PrefillForwarder` sends it to an
  idle prefill, retrying on 429s until the request's TTFT deadline (forwarder.py), once its
  admission took it (admission.py). ``dispatch = "direct"`` is the paper's baseline gateway:
  one try at the top-ranked prefill, no retries (direct.py);
- the decode leg: the prefill's ``kv_transfer_params`` go to a decode chosen by the decode
  policy, in rounds until the deadline, with failover to another decode while the KV is
  still at the prefill (decode_leg.py). It always streams, whatever the client asked: a
  non-streaming answer is assembled from the stream (gateway/stream/assemble.py);
- both legs at once where one instance does them: a decode that prefills a short prompt
  itself (conditional disaggregation, local_prefill.py), or an instance of an aggregated or
  partial group, which takes the whole request from the same kind of queue (aggregated.py).

A stock vLLM server's legs are what its KV connector takes (handoff.py); where its prefills
push the KV into the decode's blocks, the decode is reserved before the prefill leg and may
be sent with it (push.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Collection, Sequence
from typing import Any

from pdgate.config.openai_api import Api
from pdgate.config.settings import DispatchMode, GatewaySettings
from pdgate.config.tracing import Span
from pdgate.config.wire import Role, prefill_kv_request
from pdgate.gateway.errors import DecodeLost, GatewayError, UpstreamStatus
from pdgate.gateway.instances.tracker import Lease
from pdgate.gateway.placement.aggregated import WholeRequests
from pdgate.gateway.placement.decode_attempt import client_error
from pdgate.gateway.placement.decode_leg import DecodeLegs, declaring
from pdgate.gateway.placement.direct import DirectPrefill
from pdgate.gateway.placement.handoff import OnSend
from pdgate.gateway.placement.local_prefill import LocalPlan, LocalPrefill
from pdgate.gateway.placement.placed import (
    DecodeLeg,
    LegRequest,
    Placement,
    PrefillGrant,
    as_stream,
)
from pdgate.gateway.placement.push import PushDecode, PushDecodes
from pdgate.gateway.placement.queue import Waiter
from pdgate.gateway.placement.queues import Queues
from pdgate.gateway.placement.shared import Shared
from pdgate.gateway.upstream.base import DecodeStream
from pdgate.policies.base import InstanceLoad, RequestInfo

__all__ = ["Dispatcher", "Prefilled"]

_NOT_FOR_PREFILL = ("stream_options", "return_token_ids")


class Prefilled:
    """A request whose prefill leg is done: either `grant` (a prefill computed it and holds
    its KV; `Dispatcher.decode` places the decode leg) or `placement` (one instance did both
    legs). Whoever holds it and gives up calls `close()`."""

    __slots__ = ("avoid", "grant", "local", "placement", "push", "request")

    def __init__(
        self,
        request: LegRequest,
        avoid: Collection[str],
        *,
        grant: PrefillGrant | None = None,
        placement: Placement | None = None,
        local: LocalPlan | None = None,
        push: PushDecode | None = None,
    ) -> None:
        self.request = request
        self.avoid = avoid
        self.grant = grant
        self.placement = placement
        self.local = local
        self.push = push  # the decode reserved before the prefill leg (push.py)

    def close(self) -> None:
        """Give up before the decode leg: the KV is released at the prefill, then the counts."""
        if self.push is not None:
            self.push.release()
        if self.grant is not None:
            self.grant.close()
        if self.placement is not None:
            self.placement.close()


class Dispatcher:
    """Places requests: a prefill that computed the request, then a decode that took its KV.

    Receives its parts built (gateway/app.py, `build_dispatcher`): the queues and the parts
    they share, the direct prefill, the aggregated groups' placement, the decode legs and
    the local-prefill planner."""

    def __init__(
        self,
        settings: GatewaySettings,
        shared: Shared,
        *,
        queues: Queues,
        direct: DirectPrefill,
        whole: WholeRequests,
        decode_legs: DecodeLegs,
        local: LocalPrefill,
        push: PushDecodes | None = None,
    ) -> None:
        """`push`: reserves decodes for groups whose prefills push (None: none does)."""
        self._direct_mode = settings.dispatch is DispatchMode.DIRECT
        self._shared = shared
        self._tracker = shared.tracker
        self._metrics = shared.metrics
        self._queues = queues
        self._direct = direct
        self._whole = whole
        self._decode_legs = decode_legs
        self._local = local
        self._push = push
        self.ejector = shared.ejector
        self.budget = shared.budget
        self.advisor = shared.advisor
        self.decode_capacity = shared.decode_capacity

    async def close(self) -> None:
        await self._queues.close()
        # KV releases and batch calls outlive the requests that started them: waited for
        # here, before the upstream session closes.
        await self._shared.background.aclose()

    def shed(self, error: GatewayError) -> None:
        """Every queue's waiting requests, and those that would queue from now on, fail with
        `error` (the gateway stops: `QueueAdmission.shed`)."""
        self._queues.shed(error)

    def heads(self) -> dict[str, float | None]:
        """Per queue, ms to its most urgent request's deadline (the fleet's deadline order)."""
        return self._queues.heads()

    def outgoing(self) -> dict[str, str]:
        """Per queue, this gateway's new prefill-time samples (`FleetEstimates`); the
        decodes' hold times (`DecodeCapacity`) go with any one queue's."""
        return self._queues.outgoing()

    def incoming(self, queue: str, packed: Sequence[str], *, fresh: bool = True) -> None:
        """The other gateways' samples for `queue` (`FleetEstimates`, `Queues.incoming`)."""
        self._queues.incoming(queue, packed, fresh=fresh)

    def describe_queues(self) -> list[dict[str, object]]:
        """Rows for ``GET /admin/queues``; a partial group's with its macro instances."""
        return self._queues.describe()

    def queued(self) -> int:
        """Requests waiting at the gateway for a prefill (queued or being tried)."""
        return self._queues.queued()

    def decode_waiting(self) -> int:
        """Prefilled requests waiting for a decode slot."""
        return self._shared.decode_waits.total()

    async def prefill(
        self,
        info: RequestInfo,
        forward: dict[str, Any],
        *,
        request_id: str,
        deadline: float,
        span: Span | None = None,
        api: Api = Api.COMPLETIONS,
        avoid: Collection[str] = (),
        retry: bool = False,
        token_ids: bool = False,
    ) -> Prefilled:
        """The request's prefill leg: a prefill that computed it (or, for a request its decode
        can prefill itself, both legs at once). `span` is the request's trace span (the legs'
        spans are its children). Decodes in `avoid` (one that just broke this request's
        stream) are tried last. A `retry` (failover, migration) places a request already
        counted: it adds nothing to the retry budget. `token_ids`: keep the prefill's token
        ids in its reply (the first token early reads them)."""
        if not retry:
            self.budget.deposit()
        req = LegRequest(info, request_id, deadline, span, retry)
        if self._tracker.aggregated(info.model, info.group):
            return Prefilled(req, avoid, placement=await self._whole.place(req, forward, api.path))
        local = self._local.plan(info, avoid)
        if local is not None and (
            placed := await local.place(
                forward, request_id=request_id, deadline=deadline, span=span, path=api.path
            )
        ):
            return Prefilled(req, avoid, placement=placed)
        # The prefill's token ids are read only to send the first token early; otherwise they
        # would be a prompt-long list parsed and dropped per request (the decode's first
        # event carries them too), and the gateway's RSS grew with the peaks of such lists
        # (docs/results/soak/README.md).
        drop = ("stream_options",) if token_ids else _NOT_FOR_PREFILL
        body = {k: v for k, v in forward.items() if k not in drop}
        body.update(max_tokens=1, stream=False, kv_transfer_params=prefill_kv_request())
        push: PushDecode | None = None
        if self._push is not None and self._tracker.pushed(info.model, info.group):
            push = await self._push.reserve(
                info, body=forward, path=api.path, deadline=deadline, span=span, avoid=avoid
            )
        try:
            grant = await self._prefill(
                req, body, api.path, on_send=None if push is None else push.on_send
            )
        except BaseException:
            if push is not None:
                push.release()
            raise
        return Prefilled(req, avoid, grant=grant, local=local, push=push)

    async def decode(self, prefilled: Prefilled, leg: DecodeLeg) -> Placement:
        """The decode leg of a prefilled request, with `leg`'s body (``kv_transfer_params``
        are added). Closes `prefilled` if no decode takes it.

        Raises `DecodeLost` when a decode answered with an error status (its KV may be gone:
        place the request again)."""
        if prefilled.placement is not None:
            return prefilled.placement
        grant = prefilled.grant
        assert grant is not None
        stock = grant.leg
        try:
            placed = None
            if prefilled.push is not None and leg.extension is None:
                placed = await self._pushed_decode(prefilled.push, grant, leg)
            if placed is None:
                placed = await self._decode_legs.place(
                    prefilled.request
                    if stock is None
                    else dataclasses.replace(prefilled.request, request_id=stock.leg_id),
                    as_stream(_decode_body(leg.body, grant)),
                    leg.api.path,
                    extension=leg.extension,
                    avoid=prefilled.avoid,
                    connector=None if stock is None else stock.connector,
                )
            decode, stream, decode_leases = placed
        except BaseException:
            if prefilled.push is not None:
                prefilled.push.release()
            grant.close()
            raise
        self._metrics.prefill_rejections.observe(grant.rejections)
        placement = Placement(
            stream,
            grant,
            decode,
            decode_leases,
            on_first_byte=lambda: self.ejector.success(decode.id),
        )
        if prefilled.local is not None:
            prefilled.local.served_by(decode.id)
        return placement

    async def _pushed_decode(
        self, push: PushDecode, grant: PrefillGrant, leg: DecodeLeg
    ) -> tuple[InstanceLoad, DecodeStream, list[Lease]] | None:
        """The decode reserved before the prefill leg takes the request (push.py); None when
        it could not, and another decode is tried as usual."""
        try:
            return await push.take(grant.leg, grant.kv_params, leg.body, leg.api.path)
        except UpstreamStatus as exc:
            if exc.is_client_error:
                raise client_error(exc) from exc
            # It took the leg and may have registered with the prefill: place it again.
            raise DecodeLost("the decode instance failed") from exc

    def decodes_declare(self, info: RequestInfo, extension: str) -> bool:
        """Whether a ready instance that would stream `info` (a decode; an aggregated
        instance, for an aggregated group) declares `extension`."""
        aggregated = self._tracker.aggregated(info.model, info.group)
        role = Role.AGGREGATED if aggregated else Role.DECODE
        return bool(declaring(self._tracker, role, info, extension))

    async def side_slot(
        self,
        info: RequestInfo,
        endpoint: str,
        *,
        request_id: str,
        deadline: float,
        span: Span | None = None,
    ) -> PrefillGrant:
        """A slot for a side request (``/v1/embeddings``, ``/pooling``, ``/score``,
        ``/rerank``...) on an aggregated instance of its model that declares `endpoint`: it
        waits in that endpoint's queue of its model and group, until `deadline`, as an
        aggregated request does (aggregated.py: deadline order, fleet slot leases, drain
        admission). The grant's leases hold the instance's open stream and slot; the caller
        sends the request and releases them."""
        waiter = Waiter(
            info=info,
            body={},
            request_id=request_id,
            deadline=deadline,
            future=asyncio.get_running_loop().create_future(),
            span=span,
            path=endpoint,
        )
        return await self._queues.get(info, Role.AGGREGATED, endpoint=endpoint).acquire(waiter)

    def extensions(self, instance_id: str) -> tuple[str, ...]:
        """What the instance's registry record declares (nothing once it left)."""
        record = self._tracker.records().get(instance_id)
        return () if record is None else record.extensions

    async def _prefill(
        self,
        req: LegRequest,
        body: dict[str, Any],
        path: str,
        *,
        on_send: OnSend | None = None,
    ) -> PrefillGrant:
        if self._direct_mode:
            return await self._direct.prefill(req, body, path, on_send=on_send)
        waiter = Waiter(
            info=req.info,
            body=body,
            request_id=req.request_id,
            deadline=req.deadline,
            future=asyncio.get_running_loop().create_future(),
            span=req.span,
            path=path,
            admitted=req.retry,
            on_send=on_send,
        )
        return await self._queues.get(req.info).acquire(waiter)


def _decode_body(body: dict[str, Any], grant: PrefillGrant) -> dict[str, Any]:
    """The decode leg's body: `body` with the ``kv_transfer_params`` the prefill's
    connector wants there (a shim's: its answer's; a stock server's: handoff.py's, or none)."""
    if grant.leg is None:
        return {**body, "kv_transfer_params": grant.kv_params}
    params = grant.leg.decode_params(grant.kv_params)
    out = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if params is not None:
        out["kv_transfer_params"] = params
    return out
