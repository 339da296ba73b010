"""Placing one request: a prefill that accepts, then a decode that accepts.

Prefill leg, ``dispatch = "queue"`` (P/D-Serve on-demand forwarding): the request joins its
(model, group) queue and a `PrefillForwarder` sends it to an idle prefill, retrying on 429s
until the request's TTFT deadline. ``dispatch = "direct"`` is the paper's baseline gateway:
one try at the top-ranked prefill (which may queue locally), no retries.

Decode leg: the prefill's ``kv_transfer_params`` go to a decode chosen by the decode policy;
a 429 tries the next one, then waits for a freed slot or a back-off, until the deadline. The
decode leg always streams, whatever the client asked: its first event is the moment the KV
has left the prefill (the decode pulls it before it generates), which is when the prefill's
slot frees, and a non-streaming answer is assembled from the stream (gateway/stream/assemble.py).

Failover of the decode leg: a decode that was never reached (refused, reset, timed out) is
replaced by the next one with the same ``kv_transfer_params`` (the KV is still at the
prefill); one that answered with an error status may have consumed the KV, so `decode` raises
`DecodeLost` and the caller places the request again, prefill included (gateway/stream/relay.py).
Either counts against the retry budget, as prefill failovers do.

An aggregated group (its instances compute prompts and decode them: docs/strategies.md) has
one leg: the request waits in the same kind of queue for a slot on one instance (`_whole`),
ranked by the prefill policy, or by rolling activation for a partial group (partial.py),
and that instance streams the whole answer.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from pdgate.config.aio import shielded
from pdgate.config.openai_api import Api
from pdgate.config.settings import DispatchMode, GatewaySettings
from pdgate.config.tracing import Span
from pdgate.config.wire import (
    DECODE_MAX_TOKENS_HEADER,
    TPOT_SLO_HEADER,
    TTFT_LEFT_HEADER,
    UNKNOWN_KV_SOURCE,
    Role,
    prefill_kv_request,
)
from pdgate.gateway.admission.groups import GroupResolver
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
from pdgate.gateway.instances.tracker import Lease
from pdgate.gateway.placement.decode_attempt import DecodeAttempts, out_of_time, release_after
from pdgate.gateway.placement.forwarder import PrefillForwarder
from pdgate.gateway.placement.local_prefill import LocalPlan, LocalPrefill
from pdgate.gateway.placement.partial import Mitosis, PhaseView, RollingActivation
from pdgate.gateway.placement.placed import (
    DecodeLeg,
    Placement,
    PrefillGrant,
    as_stream,
    whole,
)
from pdgate.gateway.placement.queue import Waiter, WaitQueue
from pdgate.gateway.placement.shared import Shared
from pdgate.gateway.upstream.base import (
    DecodeStream,
    upstream_error_code,
    upstream_error_message,
    upstream_error_param,
)
from pdgate.policies.base import InstanceLoad, Ranker, RequestInfo

# Queues exist only for (model, group) pairs the registry knows, so this bound is a backstop.
_MAX_QUEUES = 1024
# Samples kept per queue this gateway has not served yet, counted one by one: a sync's entry
# may carry a single sample, and a type's pace is known only from `min_samples` of its own.
# Twice a forwarder's window, since prefill and compute times come in pairs.
_EARLY_SAMPLES = 512
# Queues heard of but not served yet whose samples are kept (the least recently heard go).
_EARLY_QUEUES = 256


_NOT_FOR_PREFILL = ("stream_options", "return_token_ids")


@dataclass(frozen=True, slots=True)
class _Request:
    """One client request as both of its legs see it."""

    info: RequestInfo
    request_id: str
    deadline: float  # time.monotonic() by which the first byte is due
    span: Span | None  # the request's trace span: the legs' spans are its children
    retry: bool = False  # a failover or a continuation: admitted before (`Waiter.admitted`)


class Prefilled:
    """A request whose prefill leg is done: either `grant` (a prefill computed it and holds
    its KV; `Dispatcher.decode` places the decode leg) or `placement` (one instance did both
    legs). Whoever holds it and gives up calls `close()`."""

    __slots__ = ("avoid", "grant", "local", "placement", "request")

    def __init__(
        self,
        request: _Request,
        avoid: Collection[str],
        *,
        grant: PrefillGrant | None = None,
        placement: Placement | None = None,
        local: LocalPlan | None = None,
    ) -> None:
        self.request = request
        self.avoid = avoid
        self.grant = grant
        self.placement = placement
        self.local = local

    def close(self) -> None:
        """Give up before the decode leg: the KV is released at the prefill, then the counts."""
        if self.grant is not None:
            self.grant.close()
        if self.placement is not None:
            self.placement.close()


class Dispatcher:
    """Places requests: a prefill that computed the request, then a decode that took its KV.

    Receives its parts built (gateway/app.py, `build_dispatcher`): the forwarders' `shared`
    parts, the decode attempts, the local-prefill planner and the group resolver."""

    def __init__(
        self,
        settings: GatewaySettings,
        shared: Shared,
        *,
        prefill_policy: Ranker,
        decode_policy: Ranker,
        groups: GroupResolver,
        decodes: DecodeAttempts,
        local: LocalPrefill,
        aggregated_policy: Ranker | None = None,
    ) -> None:
        """`aggregated_policy` ranks an aggregated group's instances (default: the prefill
        policy; never with the `idle` filter: they always compute)."""
        self._settings = settings
        self._aggregated_policy = aggregated_policy or prefill_policy
        self._shared = shared
        self._tracing = shared.tracing
        self._tracker = shared.tracker
        self._upstream = shared.upstream
        self._backoff = shared.backoff
        self._metrics = shared.metrics
        self._index = shared.index
        self._options = shared.options
        self._prefill_policy = prefill_policy
        self._decode_policy = decode_policy
        self._groups = groups
        self._decodes = decodes
        self._local = local
        self._forwarders: dict[tuple[str, str | None, str], PrefillForwarder] = {}
        self._shed: GatewayError | None = None  # the gateway stops: `shed`
        self._phase_views: dict[tuple[str, str | None], PhaseView] = {}
        # Queue -> the fleet's recent samples for a queue with no forwarder here yet.
        self._early_samples: dict[str, deque[str]] = {}
        # KV releases and batch calls outlive the requests that started them; `close` waits
        # for them before the upstream session closes.
        self.background = shared.background
        self.fleet = shared.fleet
        self.ejector = shared.ejector
        self.budget = shared.budget
        self.advisor = shared.advisor
        self.decode_capacity = shared.decode_capacity

    async def close(self) -> None:
        for fwd in self._forwarders.values():
            await fwd.close()
        self._forwarders.clear()
        await self.background.aclose()

    def shed(self, error: GatewayError) -> None:
        """Every queue's waiting requests, and those that would queue from now on, fail with
        `error` (the gateway stops: `QueueAdmission.shed`)."""
        for fwd in self._forwarders.values():
            fwd.shed(error)
        self._shed = error

    def heads(self) -> dict[str, float | None]:
        """Per queue, ms to its most urgent request's deadline (the fleet's deadline order)."""
        return {f.key: f.head_in_ms() for f in self._forwarders.values()}

    def outgoing(self) -> dict[str, str]:
        """Per queue, this gateway's new prefill-time samples (`FleetEstimates`); the
        decodes' hold times (`DecodeCapacity`) go with any one queue's."""
        out: dict[str, str] = {}
        for f in self._forwarders.values():
            packed = f.samples_out()
            if packed:
                out[f.key] = packed
        if self.decode_capacity is not None and self._forwarders:
            held = self.decode_capacity.samples_out()
            if held:
                key = next(iter(self._forwarders.values())).key
                out[key] = ";".join([out[key], *held] if key in out else held)
        return out

    def incoming(self, queue: str, packed: Sequence[str], *, fresh: bool = True) -> None:
        """The other gateways' samples for `queue` (`FleetEstimates`); kept for a queue this
        gateway has not served yet, so its first request is judged on the fleet's figures.
        The decodes' hold times among them count at once, whatever the queue."""
        if self.decode_capacity is not None:
            packed = [rest for e in packed if (rest := self.decode_capacity.samples_in(e))]
            if not packed:
                return
        model, _, group = queue.partition("|")
        fwd = self._forwarders.get((model, group or None, Role.PREFILL.value))
        if fwd is None or fwd.key != queue:  # a model name with "|" in it
            fwd = next((f for f in self._forwarders.values() if f.key == queue), None)
        if fwd is not None:
            fwd.samples_in(packed, fresh=fresh)
            return
        kept = self._early_samples.pop(queue, None) or deque(maxlen=_EARLY_SAMPLES)
        kept.extend(item for entry in packed for item in entry.split(";") if item)
        self._early_samples[queue] = kept  # the most recently heard queues last
        while len(self._early_samples) > _EARLY_QUEUES:
            del self._early_samples[next(iter(self._early_samples))]

    def describe_queues(self) -> list[dict[str, object]]:
        """Rows for ``GET /admin/queues``; a partial group's with its macro instances."""
        rows: list[dict[str, object]] = []
        for f in self._forwarders.values():
            pace, arrivals, headroom = f.admission.drain_view()
            row: dict[str, object] = {
                "model": f.model,
                "group": f.group,
                "role": f.role.value,
                "policy": f.policy_name,
                "queued": len(f.queue),
                "waiting": f.waiting,
                "head_ms": f.head_in_ms(),
                "drain_pace_per_s": pace,
                "arrivals_per_s": arrivals,
                "headroom": headroom,
            }
            view = self._phase_views.get((f.model, f.group))
            if f.role is Role.AGGREGATED and view is not None:
                members = self._tracker.members(Role.AGGREGATED, f.model, f.group)
                row["macro_instances"] = [list(m) for m in view.arrange(members)]
            rows.append(row)
        return rows

    def queued(self) -> int:
        """Requests waiting at the gateway for a prefill (queued or being tried)."""
        return sum(f.waiting for f in self._forwarders.values())

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
        req = _Request(info, request_id, deadline, span, retry)
        if self._tracker.aggregated(info.model, info.group):
            return Prefilled(req, avoid, placement=await self._whole(req, forward, api.path))
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
        grant = await self._prefill(req, body, api.path)
        return Prefilled(req, avoid, grant=grant, local=local)

    async def decode(self, prefilled: Prefilled, leg: DecodeLeg) -> Placement:
        """The decode leg of a prefilled request, with `leg`'s body (``kv_transfer_params``
        are added). Closes `prefilled` if no decode takes it.

        Raises `DecodeLost` when a decode answered with an error status (its KV may be gone:
        place the request again)."""
        if prefilled.placement is not None:
            return prefilled.placement
        grant = prefilled.grant
        assert grant is not None
        try:
            decode, stream, decode_leases = await self._decode(
                prefilled.request,
                as_stream({**leg.body, "kv_transfer_params": grant.kv_params}),
                leg.api.path,
                extension=leg.extension,
                avoid=prefilled.avoid,
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
        if prefilled.local is not None:
            prefilled.local.served_by(decode.id)
        return placement

    def decodes_declare(self, info: RequestInfo, extension: str) -> bool:
        """Whether a ready instance that would stream `info` (a decode; an aggregated
        instance, for an aggregated group) declares `extension`."""
        if self._tracker.aggregated(info.model, info.group):
            return bool(self._declaring(Role.AGGREGATED, info, extension))
        return bool(self._decode_candidates(info, extension))

    def extensions(self, instance_id: str) -> tuple[str, ...]:
        """What the instance's registry record declares (nothing once it left)."""
        record = self._tracker.records().get(instance_id)
        return () if record is None else record.extensions

    async def _whole(self, req: _Request, forward: dict[str, Any], path: str) -> Placement:
        """Aggregated serving: an instance that computes the prompt and decodes it takes the
        whole request. The request waits in the gateway's queue for a slot there, as for a
        prefill (deadline order, fleet slot leases, drain admission); a 429 or a failure
        gives the slot back and it queues again, until its deadline."""
        info = req.info
        body = as_stream(forward)  # as the decode leg of a disaggregated request
        view: PhaseView | None = None
        if self._tracker.partial(info.model, info.group):
            view = self._phase_view(info)
        fwd = self._forwarder(info, Role.AGGREGATED, view)
        while True:
            waiter = Waiter(
                info=info,
                body={},
                request_id=req.request_id,
                deadline=req.deadline,
                future=asyncio.get_running_loop().create_future(),
                span=req.span,
                path=path,
            )
            slot = await fwd.acquire(waiter)
            inst = slot.instance
            slot.take()  # its two leases are the stream's now
            try:
                response, stream, inflight = await self._decodes.open(
                    inst,
                    body,
                    path,
                    request_id=req.request_id,
                    deadline=req.deadline,
                    parent=req.span,
                    local=True,
                    held=(slot.stream, slot.inflight),
                    headers=_whole_headers(req),
                )
            except UpstreamRejected:
                continue  # marked busy: the queue tries the others first
            except UpstreamStatus as exc:
                if exc.is_client_error:
                    raise client_error(exc) from exc
                self._retry_or_fail(exc, "the aggregated instances are failing")
                continue
            except UpstreamError as exc:
                if out_of_time(req.deadline):
                    raise DeadlineExceeded(
                        "no instance answered before the TTFT deadline",
                        retry_after=self._settings.retry_after_s,
                    ) from exc
                self._retry_or_fail(exc, "the aggregated instances are failing")
                continue
            # The prompt's work on the instance, until the first byte says it is computed.
            tokens = info.prompt_chars // 4 + 1
            on_first_byte = partial(self.ejector.success, inst.id)
            if view is not None:
                on_first_byte = partial(_prefilled, view, tokens, slot.answered_at, on_first_byte)
            placement = whole(
                response,
                inst,
                stream,
                inflight,
                self._tracker.work(inst.id, tokens),
                on_first_byte=on_first_byte,
                attempts=slot.attempts,
                rejections=slot.rejections,
            )
            if view is not None:
                view.routed(inst.id, placement, info.tpot_s)
            return placement

    def _policy_for(self, info: RequestInfo, role: Role, phases: PhaseView | None) -> Ranker:
        if phases is not None:
            return RollingActivation(
                phases,
                ttft_slo_s=self._groups.ttft_timeout_s(info.group),
                members=partial(self._tracker.members, Role.AGGREGATED, info.model, info.group),
            )
        return self._prefill_policy if role is Role.PREFILL else self._aggregated_policy

    def _phase_view(self, info: RequestInfo) -> PhaseView:
        key = (info.model, info.group)
        view = self._phase_views.get(key)
        if view is None:
            if len(self._phase_views) >= _MAX_QUEUES:
                del self._phase_views[next(iter(self._phase_views))]
            settings = self._settings
            view = self._phase_views[key] = PhaseView(
                tpot_slo_s=self._groups.tpot_slo_s(info.group),
                mitosis=Mitosis(settings.macro_min_instances, settings.macro_max_instances),
            )
        return view

    def _retry_or_fail(self, exc: UpstreamError, what: str) -> None:
        """Another try after a failed one, if the retry budget allows."""
        if not self.budget.withdraw():
            # A fleet-wide failure must not multiply the load on what is left.
            self._metrics.retry_budget_exhausted.inc()
            raise BadGateway(f"{what}; not retried") from exc

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
            admitted=req.retry,
        )
        return await self._forwarder(req.info).acquire(waiter)

    def _forwarder(
        self, info: RequestInfo, role: Role = Role.PREFILL, phases: PhaseView | None = None
    ) -> PrefillForwarder:
        """The queue of `info`'s model and group towards instances of `role`; with `phases`,
        a partial group's, ranked by rolling activation."""
        key = (info.model, info.group, role.value + ("+phases" if phases else ""))
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
                self._policy_for(info, role, phases),
                self._shared,
                role=role,
            )
            if self._shed is not None:
                fwd.shed(self._shed)
            # What the fleet measured for this queue before we had one (a warm start).
            fwd.samples_in(self._early_samples.pop(fwd.key, ()), fresh=False)
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
        blocks = None
        if self._index is not None:
            blocks = self._index.blocks(info)
            self._index.routed(blocks, inst.id)
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
        if self._index is not None and blocks is not None:
            self._index.record(blocks, inst.id)
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
        waits = self._shared.decode_waits
        waiting = False  # counted in `waits`: the queue holds its prefills meanwhile
        try:
            while True:
                candidates = self._decode_candidates(info, extension)
                ranked = self._decode_policy.rank(info, candidates)
                if avoid:
                    ranked = [c for c in ranked if c.id not in avoid] + [
                        c for c in ranked if c.id in avoid
                    ]
                placed = await self._try_decodes(req, body, path, ranked, failures)
                if placed is not None:
                    return placed
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if failures and not ranked:
                        last = failures[-1]
                        raise BadGateway(f"every decode instance failed; last error: {last}")
                    what = (
                        "no decode instance is available"
                        if not ranked
                        else "no decode instance accepted the request before its TTFT deadline"
                    )
                    raise DeadlineExceeded(what, retry_after=self._settings.retry_after_s)
                if not waiting and candidates:
                    # Decodes there are, all full: wait, and hold the queue's prefills.
                    waiting = True
                    waits.enter(info.model, info.group)
                await self._tracker.wait_freed(min(self._backoff.delay(round_no), remaining))
                round_no += 1
        finally:
            if waiting:
                waits.leave(info.model, info.group)

    async def _try_decodes(
        self,
        req: _Request,
        body: dict[str, Any],
        path: str,
        ranked: list[InstanceLoad],
        failures: list[str],
    ) -> tuple[InstanceLoad, DecodeStream, list[Lease]] | None:
        """One round: the first of `ranked` (up to `decode_candidates`) that accepts the
        decode leg; None when none did (full, or failing: each failure added to `failures`)."""
        deadline = req.deadline
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
                if upstream_error_code(exc) == UNKNOWN_KV_SOURCE:
                    # The decode does not know this prefill yet: its view of the
                    # registry lags ours (as across a Redis failover). It pulled
                    # nothing, so another decode, or this one after a back-off, may.
                    failures.append(str(exc))
                    continue
                if exc.is_client_error:
                    raise client_error(exc) from exc
                # It answered: its KV pull may have consumed the prefill's copy, so
                # another decode cannot be given the same kv_transfer_params.
                raise DecodeLost("the decode instance failed") from exc
            except UpstreamError as exc:
                if out_of_time(deadline):
                    # The request's own time ran out while the decode was answering
                    # (a busy decode, past capacity): shed it as the queue does, not as
                    # a broken decode.
                    raise DeadlineExceeded(
                        "no decode instance answered before the TTFT deadline",
                        retry_after=self._settings.retry_after_s,
                    ) from exc
                failures.append(str(exc))
                self._retry_or_fail(exc, "the decode instances are failing")
                continue  # never reached it: the KV is still at the prefill
            return inst, response, [stream, inflight]
        return None

    def _decode_candidates(self, info: RequestInfo, extension: str | None) -> list[InstanceLoad]:
        return self._declaring(Role.DECODE, info, extension)

    def _declaring(
        self, role: Role, info: RequestInfo, extension: str | None
    ) -> list[InstanceLoad]:
        loads = self._tracker.loads(role, info.model, info.group)
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


def _prefilled(view: PhaseView, tokens: int, granted_at: float, then: Callable[[], None]) -> None:
    """A partial group's first byte: the view learns how long the prompt took."""
    view.prefilled(time.monotonic() - granted_at, tokens)
    then()


def _whole_headers(req: _Request) -> dict[str, str]:
    """What an aggregated instance is told of a request's SLOs (its phases hold to them)."""
    headers = {TTFT_LEFT_HEADER: _ms_left(req.deadline)}
    if req.info.tpot_s is not None:
        headers[TPOT_SLO_HEADER] = str(max(1, round(1000 * req.info.tpot_s)))
    return headers


def _ms_left(deadline: float) -> str:
    return str(max(1, round(1000 * (deadline - time.monotonic()))))
