"""Placing one request: a prefill that accepts, then a decode that accepts.

Prefill leg, ``dispatch = "queue"`` (P/D-Serve on-demand forwarding): the request joins its
(model, group) queue and a `PrefillForwarder` sends it to an idle prefill, retrying on 429s
until the request's TTFT deadline. ``dispatch = "direct"`` is the paper's baseline gateway:
one try at the top-ranked prefill (which may queue locally), no retries.

Decode leg: the prefill's ``kv_transfer_params`` go to a decode chosen by the decode policy;
a 429 tries the next one, then waits for a freed slot or a back-off, until the deadline. The
decode leg always streams, whatever the client asked: its first event is the moment the KV
has left the prefill (the decode pulls it before it generates), which is when the prefill's
slot frees, and a non-streaming answer is assembled from the stream (gateway/_assemble.py).

Failover of the decode leg: a decode that was never reached (refused, reset, timed out) is
replaced by the next one with the same ``kv_transfer_params`` (the KV is still at the
prefill); one that answered with an error status may have consumed the KV, so `place` raises
`DecodeLost` and the caller places the request again, prefill included (gateway/relay.py).
Either counts against the retry budget, as prefill failovers do.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from pdgate.config.aio import Background, Backoff, shielded
from pdgate.config.openai_api import Api
from pdgate.config.settings import DispatchMode, GatewaySettings
from pdgate.config.tracing import Span, Tracing
from pdgate.config.wire import DECODE_MAX_TOKENS_HEADER, Role, prefill_kv_request
from pdgate.gateway._decode_attempt import DecodeAttempts, release_after
from pdgate.gateway._local_prefill import LocalPrefill
from pdgate.gateway.affinity import PrefixIndex
from pdgate.gateway.errors import (
    BadGateway,
    BadRequest,
    DeadlineExceeded,
    DecodeLost,
    GatewayError,
    PayloadTooLarge,
    UpstreamError,
    UpstreamRejected,
    UpstreamStatus,
)
from pdgate.gateway.fleet import Fleet
from pdgate.gateway.forwarder import ForwardingOptions, PrefillForwarder, PrefillGrant, Shared
from pdgate.gateway.groups import GroupResolver
from pdgate.gateway.health import Ejection, Ejector, RetryBudget
from pdgate.gateway.instances import InstanceTracker, Lease
from pdgate.gateway.metrics import GatewayMetrics
from pdgate.gateway.queue import Waiter, WaitQueue
from pdgate.gateway.ratio import RatioAdvisor
from pdgate.gateway.upstream import (
    DecodeStream,
    Upstream,
    upstream_error_message,
    upstream_error_param,
)
from pdgate.policies import admit_idle
from pdgate.policies.base import InstanceLoad, Ranker, RequestInfo
from pdgate.registry.fleet import LocalFleet

# Queues exist only for (model, group) pairs the registry knows, so this bound is a backstop.
_MAX_QUEUES = 1024
# Packed sample entries kept per queue this gateway has not served yet (each entry: one
# gateway's samples of one sync).
_EARLY_SAMPLES = 64


_NOT_FOR_PREFILL = ("stream_options", "return_token_ids")


class Placement:
    """A request placed on a prefill and a decode; the decode's stream is open.

    Owns every count of the request: the open-stream leases of both instances (whole life),
    the decode's slot, and the prefill's slot until `first_byte` says the KV has left the
    prefill. `close()` releases whatever is still held, exactly once."""

    def __init__(
        self,
        stream: DecodeStream,
        grant: PrefillGrant,
        decode: InstanceLoad,
        decode_leases: list[Lease],
        on_first_byte: Callable[[], None] = lambda: None,
    ) -> None:
        grant.take()
        self._on_first_byte = on_first_byte
        self.stream = stream
        self.prefill_id = grant.instance.id
        self.decode_id = decode.id
        self.prefill_attempts = grant.attempts
        self.prefill_rejections = grant.rejections
        self.prefill_group = grant.instance.group
        self.decode_group = decode.group
        # What the relay saw, for the P/D ratio advice (gateway/ratio.py).
        self.opened_at = time.monotonic()  # the decode accepted
        self.first_token_at: float | None = None
        self.tokens = 0  # events that carried output
        self.gaps_s = 0.0  # sum of the gaps between them
        self._grant = grant
        self._leases = [grant.stream, *decode_leases]
        self._kv_taken = False
        self._closed = False

    def first_byte(self) -> None:
        """The decode sent its first event: it holds the KV, the prefill's slot is free."""
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        if not self._kv_taken:
            self._kv_taken = True
            self._grant.inflight.release()
            self._on_first_byte()
            self._grant.handed_over()

    def close(self) -> None:
        """Release every count and the upstream connection; safe to call more than once.

        Closing (not releasing) the decode connection mid-stream is what tells the decode
        the client is gone, so it frees the slot at once. A decode that never sent a byte may
        not have pulled the KV: it is released at the prefill before that slot counts free."""
        if self._closed:
            return
        self._closed = True
        self.stream.close()
        for lease in self._leases:
            lease.release()
        if not self._kv_taken:
            self._kv_taken = True
            self._grant.release_kv_then([self._grant.inflight])


@dataclass(frozen=True, slots=True)
class DecodeLeg:
    """What the decode leg gets: its body (``kv_transfer_params`` are added), the API it
    goes to, and a pdgate extension every candidate decode must declare (None: any)."""

    body: dict[str, Any]
    api: Api
    extension: str | None = None


@dataclass(frozen=True, slots=True)
class _Request:
    """One client request as both of its legs see it."""

    info: RequestInfo
    request_id: str
    deadline: float  # time.monotonic() by which the first byte is due
    span: Span | None  # the request's trace span: the legs' spans are its children


# Called with the prefill's grant before the decode leg is placed; returns that leg (None:
# the request's own body). The first token early sends the client its first chunk here.
AfterPrefill = Callable[[PrefillGrant], Awaitable[DecodeLeg | None]]


class Dispatcher:
    def __init__(
        self,
        settings: GatewaySettings,
        tracker: InstanceTracker,
        upstream: Upstream,
        prefill_policy: Ranker,
        decode_policy: Ranker,
        backoff: Backoff,
        metrics: GatewayMetrics,
        index: PrefixIndex | None,
        fleet: Fleet | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self._tracing = tracing or Tracing.off()
        self._settings = settings
        self._tracker = tracker
        self._upstream = upstream
        self._prefill_policy = (
            admit_idle(prefill_policy) if settings.prefill_admit == "idle" else prefill_policy
        )
        self._decode_policy = decode_policy
        self._backoff = backoff
        self._metrics = metrics
        self._index = index
        self._forwarders: dict[tuple[str, str | None], PrefillForwarder] = {}
        # Queue -> the fleet's recent samples for a queue with no forwarder here yet.
        self._early_samples: dict[str, deque[str]] = {}
        self._groups = GroupResolver(settings, tracker)
        # KV releases and batch calls outlive the requests that started them; shutdown waits
        # for them before the upstream session closes.
        self.background = Background("pdgate-dispatch")
        self.fleet = fleet or Fleet(LocalFleet(settings.gateway_id), tracker)
        self.fleet.serve_queues(self.heads, self)
        ejection = Ejection(
            settings.eject_after_failures, settings.eject_base_s, settings.eject_max_s
        )
        self.ejector = Ejector(tracker, metrics, ejection)
        self.budget = RetryBudget(settings.retry_budget_ratio, settings.retry_budget_burst)
        self.advisor = RatioAdvisor(
            window_s=settings.ratio_window_s, target_utilization=settings.ratio_target_utilization
        )
        self._decodes = DecodeAttempts(
            tracker, upstream, metrics.decode_attempts, self.ejector, self._tracing
        )
        # Conditional disaggregation (gateway/_local_prefill.py).
        self._local = LocalPrefill(
            settings, tracker, self._decodes, decode_policy, metrics, self.ejector, Placement
        )
        self._options = ForwardingOptions(
            batch_forwarding=settings.batch_forwarding,
            batch_endpoint=settings.prefill_batch_endpoint,
            admit_idle=settings.prefill_admit == "idle",
            retry_after_s=settings.retry_after_s,
            client_error=client_error,
            early_drop=settings.early_drop,
            prefill_estimate_quantile=settings.prefill_estimate_quantile,
            try_timeout_s=settings.prefill_try_timeout_s,
        )
        self._shared = Shared(
            tracker,
            upstream,
            backoff,
            metrics,
            index,
            self._options,
            self.background,
            self.fleet,
            self.ejector,
            self.budget,
            self._tracing,
            self.advisor,
        )

    async def close(self) -> None:
        for fwd in self._forwarders.values():
            await fwd.close()
        self._forwarders.clear()
        await self.background.aclose()

    def heads(self) -> dict[str, float | None]:
        """Per queue, ms to its most urgent request's deadline (the fleet's deadline order)."""
        return {f.key: f.head_in_ms() for f in self._forwarders.values()}

    def outgoing(self) -> dict[str, str]:
        """Per queue, this gateway's new prefill-time samples (`FleetEstimates`)."""
        out: dict[str, str] = {}
        for f in self._forwarders.values():
            packed = f.samples_out()
            if packed:
                out[f.key] = packed
        return out

    def incoming(self, queue: str, packed: Sequence[str]) -> None:
        """The other gateways' samples for `queue` (`FleetEstimates`); kept for a queue this
        gateway has not served yet, so its first request is judged on the fleet's figures."""
        model, _, group = queue.partition("|")
        fwd = self._forwarders.get((model, group or None))
        if fwd is None or fwd.key != queue:  # a model name with "|" in it
            fwd = next((f for f in self._forwarders.values() if f.key == queue), None)
        if fwd is not None:
            fwd.samples_in(packed)
            return
        kept = self._early_samples.pop(queue, None) or deque(maxlen=_EARLY_SAMPLES)
        kept.extend(packed)
        self._early_samples[queue] = kept  # the most recently heard queues last
        while len(self._early_samples) > _MAX_QUEUES:
            del self._early_samples[next(iter(self._early_samples))]

    def describe_queues(self) -> list[dict[str, object]]:
        """Rows for ``GET /admin/queues``."""
        return [
            {
                "model": f.model,
                "group": f.group,
                "queued": len(f.queue),
                "waiting": f.waiting,
                "head_ms": f.head_in_ms(),
            }
            for f in self._forwarders.values()
        ]

    def queued(self) -> int:
        """Requests waiting at the gateway for a prefill (queued or being tried)."""
        return sum(f.waiting for f in self._forwarders.values())

    async def place(
        self,
        info: RequestInfo,
        forward: dict[str, Any],
        *,
        request_id: str,
        deadline: float,
        span: Span | None = None,
        api: Api = Api.COMPLETIONS,
        after_prefill: AfterPrefill | None = None,
        avoid: Collection[str] = (),
        retry: bool = False,
    ) -> Placement:
        """A prefill that computed the request and a decode that took its KV. `span` is the
        request's trace span (the legs' spans are its children). Both legs go to `api`'s
        path (chat: the client's messages on both, ``max_tokens`` already its only limit),
        unless `after_prefill` gives the decode leg another body. Decodes in `avoid` (one
        that just broke this request's stream) are tried last. A `retry` (failover,
        migration) places a request already counted: it adds nothing to the retry budget.

        Raises `DecodeLost` when a decode answered with an error status (its KV may be gone:
        place the request again)."""
        if not retry:
            self.budget.deposit()
        local = self._local.plan(info, avoid)
        if local is not None and (
            placed := await local.place(
                forward, request_id=request_id, deadline=deadline, span=span, path=api.path
            )
        ):
            return placed
        # The prefill's token ids are read only to send the first token early (`after_prefill`);
        # otherwise they would be a prompt-long list parsed and dropped per request (the decode's
        # first event carries them too): 8,000 ints for a long prompt, and the gateway's RSS grew
        # with the peaks of such lists (docs/soak.md).
        drop = ("stream_options",) if after_prefill is not None else _NOT_FOR_PREFILL
        body = {k: v for k, v in forward.items() if k not in drop}
        body.update(max_tokens=1, stream=False, kv_transfer_params=prefill_kv_request())
        req = _Request(info, request_id, deadline, span)
        grant = await self._prefill(req, body, api.path)
        try:
            leg = await after_prefill(grant) if after_prefill is not None else None
            if leg is None:
                leg = DecodeLeg(forward, api)
            decode_body = {**leg.body, "kv_transfer_params": grant.kv_params, "stream": True}
            if not leg.body.get("stream"):
                decode_body["stream_options"] = {"include_usage": True}
            decode, stream, decode_leases = await self._decode(
                req, decode_body, leg.api.path, extension=leg.extension, avoid=avoid
            )
        except BaseException:
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
        if local is not None:
            local.served_by(decode.id)
        return placement

    def decodes_declare(self, info: RequestInfo, extension: str) -> bool:
        """Whether a ready decode for `info` declares `extension`."""
        return bool(self._decode_candidates(info, extension))

    def extensions(self, instance_id: str) -> tuple[str, ...]:
        """What the instance's registry record declares (nothing once it left)."""
        record = self._tracker.records().get(instance_id)
        return () if record is None else record.extensions

    async def _prefill(self, req: _Request, body: dict[str, Any], path: str) -> PrefillGrant:
        if self._settings.dispatch is DispatchMode.DIRECT:
            return await self._prefill_direct(req, body, path)
        waiter = Waiter(
            info=req.info,
            body=body,
            request_id=req.request_id,
            deadline=req.deadline,
            future=asyncio.get_running_loop().create_future(),
            span=req.span,
            path=path,
        )
        return await self._forwarder(req.info).acquire(waiter)

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
                WaitQueue(
                    self._groups.queue_size(info.group),
                    self._settings.queue_order,
                    guard_s=self._settings.queue_guard_s,
                ),
                self._prefill_policy,
                self._shared,
            )
            # What the fleet measured for this queue before we had one (a warm start).
            fwd.samples_in(self._early_samples.pop(fwd.key, ()))
        return fwd

    async def _prefill_direct(self, req: _Request, body: dict[str, Any], path: str) -> PrefillGrant:
        """The paper's original gateway: the top-ranked prefill or nothing. Its ranking sees
        every ready prefill (the baseline does not know which one has room)."""
        info, request_id = req.info, req.request_id
        loads = self._tracker.loads(Role.PREFILL, info.model, info.group)
        ranked = self._prefill_policy.rank(info, [c for c in loads if not c.ejected]) or loads
        if not ranked:
            raise DeadlineExceeded(
                "no prefill instance is available", retry_after=self._settings.retry_after_s
            )
        inst = ranked[0]
        stream, inflight = self._tracker.open_stream(inst.id), self._tracker.begin(inst.id)
        counter = self._metrics.prefill_attempts
        kv_id = secrets.token_hex(16)
        upstream = self._upstream

        async def release(
            params: dict[str, Any] | None,
            *,
            slot_freed: bool,
            leases: Sequence[Lease] = (stream, inflight),
        ) -> None:
            try:
                if params is None:
                    await upstream.release_kv_id(inst.url, kv_id, request_id=request_id)
                else:
                    await upstream.release_kv(params, request_id=request_id)
            finally:
                for lease in leases:
                    lease.release(slot_freed=slot_freed)

        computing = self._tracker.computing(inst.id)  # for the `idle` filter's view
        try:
            remaining = max(req.deadline - time.monotonic(), 0.001)
            try:
                reply = await upstream.prefill(
                    inst.url,
                    body,
                    request_id=request_id,
                    timeout_s=remaining,
                    kv_id=kv_id,
                    path=path,
                    headers={DECODE_MAX_TOKENS_HEADER: str(info.max_tokens)},
                )
            finally:
                computing.release(slot_freed=False)
        except UpstreamRejected as exc:
            release_after(exc, stream, inflight)
            self._tracker.rejected(inst.id)
            counter.labels("rejected").inc()
            raise DeadlineExceeded(
                "the prefill instance is busy", retry_after=self._settings.retry_after_s
            ) from exc
        except UpstreamStatus as exc:
            if exc.is_client_error:
                release_after(exc, stream, inflight)
                raise client_error(exc) from exc
            await shielded(release(None, slot_freed=False))
            counter.labels("failed").inc()
            raise DeadlineExceeded(
                "the prefill failed before the TTFT deadline",
                retry_after=self._settings.retry_after_s,
            ) from exc
        except UpstreamError as exc:
            # Timed out or lost: the prefill may hold KV for an answer we will never read.
            await shielded(release(None, slot_freed=False))
            counter.labels("failed").inc()
            raise DeadlineExceeded(
                "the prefill did not answer before the TTFT deadline",
                retry_after=self._settings.retry_after_s,
            ) from exc
        except BaseException:
            await shielded(release(None, slot_freed=False))
            raise
        counter.labels("accepted").inc()
        if self._index is not None:
            self._index.record(self._index.hashes(info.prompt), inst.id)
        params: dict[str, Any] = reply["kv_transfer_params"]
        return PrefillGrant(
            inst,
            reply,
            stream,
            inflight,
            lambda leases: self.background.spawn(release(params, slot_freed=True, leases=leases)),
            attempts=1,
            rejections=0,
        )

    async def _decode(
        self,
        req: _Request,
        body: dict[str, Any],
        path: str,
        *,
        extension: str | None = None,
        avoid: Collection[str] = (),
    ) -> tuple[InstanceLoad, DecodeStream, list[Lease]]:
        info, deadline = req.info, req.deadline
        round_no = 0
        failures: list[str] = []
        while True:
            ranked = self._decode_policy.rank(info, self._decode_candidates(info, extension))
            if avoid:
                ranked = [c for c in ranked if c.id not in avoid] + [
                    c for c in ranked if c.id in avoid
                ]
            for inst in ranked[: self._settings.decode_candidates]:
                if time.monotonic() >= deadline:
                    break
                try:
                    response, stream, inflight = await self._decodes.open(
                        inst,
                        body,
                        path,
                        request_id=req.request_id,
                        deadline=deadline,
                        parent=req.span,
                    )
                except UpstreamRejected:
                    continue
                except UpstreamStatus as exc:
                    if exc.is_client_error:
                        raise client_error(exc) from exc
                    # It answered: its KV pull may have consumed the prefill's copy, so
                    # another decode cannot be given the same kv_transfer_params.
                    raise DecodeLost("the decode instance failed") from exc
                except UpstreamError as exc:
                    failures.append(str(exc))
                    if not self.budget.withdraw():
                        # A fleet-wide failure must not multiply the load on what is left.
                        self._metrics.retry_budget_exhausted.inc()
                        raise BadGateway("the decode instances are failing; not retried") from exc
                    continue  # never reached it: the KV is still at the prefill
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

    def _decode_candidates(self, info: RequestInfo, extension: str | None) -> list[InstanceLoad]:
        loads = self._tracker.loads(Role.DECODE, info.model, info.group)
        if extension is None:
            return loads
        records = self._tracker.records()
        return [
            c
            for c in loads
            if (rec := records.get(c.id)) is not None and extension in rec.extensions
        ]


def client_error(exc: UpstreamStatus) -> GatewayError:
    """An instance said the request itself is bad: tell the client in its words."""
    message = upstream_error_message(exc)
    if exc.status == 413:
        return PayloadTooLarge(message)
    return BadRequest(message, param=upstream_error_param(exc))
