"""A run's prefill calls: sent to the prefill the forwarder chose, and each answer settled.

The forwarder (forwarder.py) forms a run and counts each member against its prefill
(`PrefillCall`: the open stream, the slot with its fleet lease, the fleet-wide ``computing``
count and the prompt's token work). `PrefillCalls.send` makes the calls: one batch call per
API for a run to a pdgate shim that declares the batch endpoint, one call per request
otherwise (and from then on to a prefill whose batch endpoint answered 404/405).

Each answer is settled once (`_settle`): a 200 becomes the waiter's `PrefillGrant` and its
measurements (queue's `QueueTimes`, the ratio advice, the affinity index); a 429 gives the
counts back, marks the prefill busy and requeues the request at its old place; a client
error fails the request in the client's words; anything else counts against the prefill
(ejection, the retry budget) and requeues it. Every call that is abandoned (deadline, client
gone, timeout, failure) releases its KV by the id the gateway chose for it, and only then
gives back its counts: the prefill frees the slot when the release arrives, not before.
A pdgate prefill answers the release with what it did with the call (admitted, rejected, or
unseen: it never will), counted in ``pdgate_prefill_abandoned_outcomes``, so the gateway's
counts add up to the prefills' exactly (docs/observability.md).

A prefill computes a run as one batch, so every answer of a run comes when the whole run is
computed: each is timed at its share of the run's characters, what the prompt itself cost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import orjson

from pdgate.config.aio import Background
from pdgate.config.tracing import Span, Tracing
from pdgate.config.wire import DECODE_MAX_TOKENS_HEADER, EXT_BATCH_PREFILL, GATEWAY_ID_HEADER
from pdgate.gateway.errors import (
    BadGateway,
    GatewayError,
    UpstreamError,
    UpstreamRejected,
    UpstreamStatus,
    UpstreamUnreachable,
    is_client_fault,
)
from pdgate.gateway.instances.health import spends_budget
from pdgate.gateway.instances.tracker import Lease
from pdgate.gateway.observe.metrics import GatewayMetrics
from pdgate.gateway.placement.batching import BatchForming
from pdgate.gateway.placement.decode_attempt import out_of_time
from pdgate.gateway.placement.handoff import Handoffs, StockLeg
from pdgate.gateway.placement.placed import PrefillGrant, release_counts
from pdgate.gateway.placement.prefill_time import QueueTimes, cached_tokens
from pdgate.gateway.placement.queue import Waiter
from pdgate.gateway.placement.shared import Shared
from pdgate.gateway.upstream.base import Upstream
from pdgate.policies.base import InstanceLoad

__all__ = ["PrefillCall", "PrefillCalls", "release_answered", "release_unanswered"]

log = logging.getLogger("pdgate.forwarder")

_MAX_REMEMBERED = 4096


@dataclass
class PrefillCall:
    """One prefill call about to be made for one waiter, with what it holds."""

    waiter: Waiter
    stream: Lease
    inflight: Lease  # the prefill slot (with its fleet lease), until the KV has left
    computing: Lease  # the prefill computes it (fleet-wide), until it answers
    work: Lease  # the prompt tokens being computed, until the prefill answers
    kv_id: str  # our name for the KV handle, to release it without the answer
    span: Span
    started: float = 0.0  # monotonic, when the call was sent
    # The prompt characters sent to the prefill in the same run, this one's included: the
    # prefill computes the run as one batch, so each answer comes after the whole batch, and
    # the time the prompt itself cost is about its share of it (prefill is compute bound).
    run_chars: int = 0
    # Prompt tokens the KV-event index expects the prefill to find cached (None: unknown).
    expected_cached: int | None = None
    # A stock server's legs (gateway/placement/handoff.py); None: a pdgate shim's wire.
    leg: StockLeg | None = None
    # Told when the call ends (True: answered 200), if its waiter asked (`Waiter.on_send`).
    ended: Callable[[bool], None] | None = None

    @property
    def share(self) -> float:
        chars = self.waiter.info.prompt_chars
        return chars / self.run_chars if self.run_chars > chars else 1.0

    def headers(self, tracing: Tracing, gateway: str | None = None) -> dict[str, str]:
        """The call's headers: the decode leg's max_tokens and `gateway`, this gateway's id
        in a shared fleet (a shim's: it lets go of the KV it holds for a gateway that left
        the fleet), its connector's (a stock server's), and the trace context."""
        if self.leg is None:
            headers = {DECODE_MAX_TOKENS_HEADER: str(self.waiter.info.max_tokens)}
            if gateway is not None:
                headers[GATEWAY_ID_HEADER] = gateway
        else:
            headers = self.leg.prefill_headers()
        tracing.inject(self.span, headers)
        return headers

    def end(self, answered: bool) -> None:
        """Tell whoever asked (`Waiter.on_send`) that the call ended, once."""
        ended, self.ended = self.ended, None
        if ended is not None:
            ended(answered)

    @property
    def leases(self) -> tuple[Lease, Lease, Lease, Lease]:
        return (self.work, self.computing, self.stream, self.inflight)

    def release(self, *, slot_freed: bool) -> None:
        self.work.release()
        self.computing.release(slot_freed=slot_freed)
        self.stream.release(slot_freed=slot_freed)
        self.inflight.release(slot_freed=slot_freed)


class PrefillCalls:
    """The calls of one queue's forwarder (model and group): sent, settled, released.

    `times` are the queue's measurements (each 200 adds to them; the try timeout reads
    them), `forming` the forwarder's batch forming (the prompts' blocks for the affinity
    index), `retry` puts a waiter back in the queue (after a 429 or a failure) and `expire`
    fails one whose deadline passed."""

    def __init__(
        self,
        model: str,
        group: str | None,
        shared: Shared,
        times: QueueTimes,
        forming: BatchForming,
        *,
        retry: Callable[[Waiter], None],
        expire: Callable[[Waiter], None],
    ) -> None:
        self._model = model
        self._group = group
        self._shared = shared
        self._tracker = shared.tracker
        self._index = shared.index
        self._options = shared.options
        self._times = times
        self._forming = forming
        self._retry = retry
        self._expire = expire
        # This gateway in a fleet that shares Redis (the prefills watch it there); else None.
        self._gateway = shared.fleet.gateway_id if shared.fleet.shared else None
        # Prefill URL + API path pairs whose batch endpoint answered 404/405 (LRU-bounded).
        self._no_batch_endpoint: OrderedDict[str, None] = OrderedDict()

    def send(self, run: list[PrefillCall], inst: InstanceLoad) -> None:
        """Start the calls of `run` to `inst`; each settles its own waiter."""
        run_chars = sum(c.waiter.info.prompt_chars for c in run)
        for call in run:
            call.run_chars = run_chars
        # Each API has its own batch endpoint: one batch call per API in the run.
        by_path: dict[str, list[PrefillCall]] = {}
        for call in run:
            by_path.setdefault(call.waiter.path, []).append(call)
        for path, calls in by_path.items():
            if (
                self._options.batch_endpoint
                and len(calls) > 1
                and self._speaks_batch(inst)
                and inst.url + path not in self._no_batch_endpoint
            ):
                self._shared.background.spawn(
                    self._attempt_batch(calls, inst),
                    dropped=partial(self._start_attempts, calls, inst),
                )
            else:
                self._start_attempts(calls, inst)

    def _start_attempts(self, calls: Sequence[PrefillCall], inst: InstanceLoad) -> None:
        for call in calls:
            self._start_attempt(call, inst)

    def _start_attempt(self, call: PrefillCall, inst: InstanceLoad) -> None:
        """`_attempt` in a task of its own, which the waiter cancels when it gives up."""
        task = asyncio.create_task(self._attempt(call, inst))
        call.waiter.attempt_task = task
        task.add_done_callback(lambda done: _never_started(done, call))

    async def _attempt(self, call: PrefillCall, inst: InstanceLoad) -> None:
        waiter = call.waiter
        call.started = time.monotonic()  # before any await: `_never_started` reads it
        leg = call.leg
        if leg is not None and waiter.on_send is not None:
            call.ended = waiter.on_send(inst, leg)
        try:
            remaining = max(waiter.deadline - time.monotonic(), 0.001)
            reply = await self._shared.upstream.prefill(
                inst.url,
                waiter.body if leg is None else leg.prefill_body(waiter.body),
                request_id=waiter.request_id if leg is None else leg.leg_id,
                timeout_s=min(remaining, self._try_timeout_s(call, inst)),
                kv_id=call.kv_id if leg is None else None,
                headers=call.headers(self._shared.tracing, self._gateway),
                path=waiter.path,
            )
        except UpstreamRejected:
            self._settle(call, inst, 429, None)
        except UpstreamStatus as exc:
            self._settle(call, inst, exc.status, exc)
        except UpstreamError as exc:
            if out_of_time(waiter.deadline):
                self._out_of_time(call, inst)
            else:
                self._settle(call, inst, 502, exc)
        except Exception:
            self._broke(call, inst)
        except asyncio.CancelledError:
            # Abandoned mid-call (deadline, client gone): the prefill may have finished just
            # now and hold KV for an answer nobody reads. Release it by the id we chose.
            # Not a freed slot: a prefill drops an abandoned prompt only at its next step
            # (pdgate shims hold the slot until then), so this is no moment to send it more.
            self._release_unanswered(call, inst, "abandoned")
            self._shared.metrics.prefill_attempts.labels("abandoned").inc()
            _end(call.span, "abandoned")
            raise
        else:
            self._settle(call, inst, 200, reply)

    async def _attempt_batch(self, calls: list[PrefillCall], inst: InstanceLoad) -> None:
        """One batch call for a run of waiters; each line settles its own waiter. The call is
        shared, so a waiter that leaves does not cancel it: its KV is released when its line
        comes back."""
        pending = dict(enumerate(calls))
        started = time.monotonic()
        for c in calls:
            c.started = started
        last_deadline = max(c.waiter.deadline for c in calls)
        try_timeout = max(self._try_timeout_s(c, inst) for c in calls)
        path = calls[0].waiter.path  # one API per batch call
        try:
            async for index, status, body in self._shared.upstream.prefill_batch(
                inst.url,
                [c.waiter.body for c in calls],
                kv_ids=[c.kv_id for c in calls],
                request_id=calls[0].waiter.request_id,
                timeout_s=min(max(last_deadline - time.monotonic(), 0.001), try_timeout),
                headers=calls[0].headers(self._shared.tracing, self._gateway),
                path=path,
                decode_max_tokens=[c.waiter.info.max_tokens for c in calls],
            ):
                call = pending.pop(index, None)
                if call is not None:
                    self._settle(call, inst, status, body)
        except UpstreamRejected:
            for call in pending.values():
                self._settle(call, inst, 429, None)
        except UpstreamStatus as exc:
            if exc.status in (404, 405) and len(pending) == len(calls):
                # Not a pdgate shim (e.g. plain vLLM): one call per request to it from now on.
                self._remember_no_batch(inst.url + path)
                for call in calls:
                    self._start_attempt(call, inst)
                return
            for call in pending.values():
                self._settle(call, inst, 502, exc)
        except UpstreamError as exc:
            for call in pending.values():
                if out_of_time(call.waiter.deadline):
                    self._out_of_time(call, inst)
                else:
                    self._settle(call, inst, 502, exc)
        except Exception:
            for call in pending.values():
                self._broke(call, inst)
        except asyncio.CancelledError:  # gateway shutdown
            for call in pending.values():
                self._release_unanswered(call, inst, "abandoned")
                self._shared.metrics.prefill_attempts.labels("abandoned").inc()
                _end(call.span, "abandoned")
            raise
        else:
            for call in pending.values():  # the prefill never answered for these
                self._settle(call, inst, 502, UpstreamError(inst.url, "missing from batch answer"))

    def _out_of_time(self, call: PrefillCall, inst: InstanceLoad) -> None:
        """The call's time was its request's: the prefill did not answer before the request's
        deadline. The request is shed (503), and the prefill, which may still be computing
        a prompt nobody waits for, is not counted as failed (a burst of short deadlines
        would eject healthy prefills); whatever it holds for the call is released."""
        self._release_unanswered(call, inst, "deadline")
        self._shared.metrics.prefill_attempts.labels("deadline").inc()
        _end(call.span, "deadline")
        self._expire(call.waiter)

    def _broke(self, call: PrefillCall, inst: InstanceLoad) -> None:
        """The call failed on this side (a bug, not the prefill's doing): whatever the prefill
        may hold for it is released, its counts given back, and its request fails with a 500
        rather than being tried again elsewhere (it would break there too)."""
        log.exception("prefill call to %s failed in the gateway", inst.id)
        self._release_unanswered(call, inst, "failed")
        _end(call.span, "failed")
        if not call.waiter.future.done():
            call.waiter.future.set_exception(GatewayError("internal gateway error"))

    def _try_timeout_s(self, call: PrefillCall, inst: InstanceLoad) -> float:
        """How long one prefill call may take: the setting, or four times the slowest recent
        prefills of its run's length (at least 2 s): its answer comes when the prefill has
        computed the whole run. Past it the call counts as failed and the request moves on,
        instead of waiting on a prefill that hangs until its deadline."""
        if self._options.try_timeout_s is not None:
            return self._options.try_timeout_s
        slow = self._times.prefill_times.upper_bound_s(
            max(call.run_chars, call.waiter.info.prompt_chars),
            hardware=self._tracker.hardware(inst.id),
        )
        return float("inf") if slow is None else max(2.0, 4 * slow)

    def hand_out(self, run: list[PrefillCall], inst: InstanceLoad) -> None:
        """Aggregated instances' slots for the run's waiters, no call made: each caller sends
        the whole request (dispatch.py). A grant holds the open stream and the slot (its
        fleet lease with it) until the caller's stream ends."""
        for call in run:
            call.work.release()
            call.computing.release(slot_freed=False)
            _end(call.span, "granted")
            waiter = call.waiter
            if waiter.future.done():
                call.release(slot_freed=True)
                continue
            self._remember_prefix(waiter, inst)
            waiter.future.set_result(
                PrefillGrant(
                    inst,
                    {},
                    call.stream,
                    call.inflight,
                    release_counts,
                    waiter.attempts,
                    waiter.rejections,
                )
            )

    def _compare_cached(self, expected: int, usage: object) -> None:
        """The KV-event index's prediction against the engine's own count, where it gives
        one (vLLM: with ``--enable-prompt-tokens-details``)."""
        reported = cached_tokens(usage)
        if reported is None:
            return
        metrics = self._shared.metrics
        metrics.prefix_cached_tokens.labels("predicted").inc(expected)
        metrics.prefix_cached_tokens.labels("reported").inc(reported)
        outcome = "exact" if expected == reported else "over" if expected > reported else "under"
        metrics.prefix_predictions.labels(outcome).inc()

    def _remember_prefix(self, waiter: Waiter, inst: InstanceLoad) -> None:
        """`inst` computes the waiter's prompt: the affinity index learns it holds it."""
        blocks = self._forming.blocks(waiter)
        if self._index is not None and blocks is not None:
            self._index.record(blocks, inst.id)

    def _speaks_batch(self, inst: InstanceLoad) -> bool:
        """Whether `inst` registered the batch endpoint (pdgate shims do; stock servers get
        exactly vLLM's handshake). A 404/405 from one that claims it is remembered below."""
        record = self._tracker.records().get(inst.id)
        return record is not None and EXT_BATCH_PREFILL in record.extensions

    def _remember_no_batch(self, url: str) -> None:
        log.info("prefill %s has no batch endpoint; sending it one request per call", url)
        self._no_batch_endpoint[url] = None
        while len(self._no_batch_endpoint) > _MAX_REMEMBERED:
            self._no_batch_endpoint.popitem(last=False)

    def _release_unanswered(self, call: PrefillCall, inst: InstanceLoad, result: str) -> None:
        """A call that ended unanswered (`result`, as ``pdgate_prefill_attempts`` counts
        it): `release_unanswered`, in the background."""
        call.end(False)
        pending = release_unanswered(
            self._shared.upstream,
            self._shared.metrics,
            result,
            call.leases,
            url=inst.url,
            kv_id=call.kv_id if call.leg is None else None,
            request_id=call.waiter.request_id,
        )
        if pending is not None:
            self._shared.background.spawn(
                pending, dropped=partial(_give_back, call.leases, slot_freed=False)
            )

    def _release_answered(self, call: PrefillCall, kv_params: dict[str, Any]) -> None:
        """A call answered after its waiter left: `release_answered`."""
        call.end(False)
        shared = self._shared
        release_answered(
            shared.upstream,
            shared.handoffs,
            shared.background,
            kv_params,
            call.leases,
            request_id=call.waiter.request_id,
            leg=call.leg,
        )

    def _settle(self, call: PrefillCall, inst: InstanceLoad, status: int, answer: Any) -> None:
        """One prefill call's outcome, whichever way it was made."""
        waiter, counter = call.waiter, self._shared.metrics.prefill_attempts
        call.end(status == 200)
        call.work.release()  # the prefill is no longer computing it, whatever the outcome
        call.computing.release(slot_freed=status == 200)
        _end(
            call.span,
            {200: "accepted", 429: "rejected"}.get(
                status, "client_error" if is_client_fault(status) else "failed"
            ),
            status,
        )
        if status == 200:
            params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
            if not isinstance(params, dict):
                self._settle(call, inst, 502, UpstreamError(inst.url, "no kv_transfer_params"))
                return
            counter.labels("accepted").inc()  # the prefill took it, whoever still waits
            if waiter.future.done():
                # The waiter left while the prefill computed: free the KV held for it.
                self._release_answered(call, params)
                return
            self._shared.ejector.success(inst.id)
            took = time.monotonic() - call.started
            # What this prompt cost, not the batch it rode in: the estimates are of a prompt
            # sent alone (a run is then the sum of its members', `RunBudget`).
            own = took * call.share
            hardware = self._tracker.hardware(inst.id)
            usage = answer.get("usage")
            times = self._times
            times.record(waiter.info.prompt_chars, own, usage, hardware)
            if call.expected_cached is not None:
                self._compare_cached(call.expected_cached, usage)
            if hardware:
                self._tracker.set_speeds(self._model, self._group, times.compute_times.speeds())
            self._shared.advisor.prefill(inst.group, own, hardware)
            self._remember_prefix(waiter, inst)
            request_id, leg = waiter.request_id, call.leg
            shared = self._shared
            upstream, handoffs, background = shared.upstream, shared.handoffs, shared.background
            if leg is not None and handoffs is not None:
                handoffs.learn(leg, params)
            waiter.future.set_result(
                PrefillGrant(
                    inst,
                    answer,
                    call.stream,
                    call.inflight,
                    # Not the call or the waiter: the grant is the waiter's future's result,
                    # and a reference back would make each request a cycle for the GC.
                    lambda leases: release_answered(
                        upstream,
                        handoffs,
                        background,
                        params,
                        leases,
                        request_id=request_id,
                        leg=leg,
                    ),
                    waiter.attempts,
                    waiter.rejections,
                    on_handover=times.prefill_times.record_handover,
                    leg=leg,
                )
            )
        elif status == 429:
            call.release(slot_freed=False)
            self._tracker.rejected(inst.id)
            counter.labels("rejected").inc()
            waiter.rejections += 1
            self._retry(waiter)
        elif is_client_fault(status):
            call.release(slot_freed=True)
            counter.labels("client_error").inc()
            if not waiter.future.done():
                if not isinstance(answer, UpstreamStatus):
                    answer = UpstreamStatus(inst.url, status, orjson.dumps(answer))
                waiter.future.set_exception(self._options.client_error(answer))
        else:
            # 5xx, timeout, connection lost, a bad answer: the prefill may have stored KV
            # before failing (or before our timeout fired). Nobody will fetch it.
            self._release_unanswered(call, inst, "failed")
            self._tracker.failed(inst.id)
            gone = isinstance(answer, UpstreamUnreachable) and answer.refused
            if gone:
                self._shared.ejector.dead(inst.id, "prefill")
            else:
                self._shared.ejector.failure(inst.id, "prefill")
            counter.labels("failed").inc()
            log.warning("prefill %s failed: %s", inst.id, answer)
            free = isinstance(answer, UpstreamError) and not spends_budget(
                self._tracker, inst.id, answer
            )
            if not free and not self._shared.budget.withdraw():
                # A fleet-wide failure must not multiply the load on what is left.
                self._shared.metrics.retry_budget_exhausted.inc()
                if not waiter.future.done():
                    waiter.future.set_exception(
                        BadGateway("the prefill instances are failing; not retried")
                    )
                return
            self._retry(waiter)


def release_unanswered(
    upstream: Upstream,
    metrics: GatewayMetrics,
    result: str,
    held: Sequence[Lease],
    *,
    url: str,
    kv_id: str | None,
    request_id: str,
) -> Coroutine[Any, Any, None] | None:
    """Release a prefill call that ended unanswered (`result`: how, as
    ``pdgate_prefill_attempts`` counts it), count what the prefill did with it in
    ``pdgate_prefill_abandoned_outcomes``, then give back `held`, once.

    `kv_id`: the id the call named its KV by, for a pdgate prefill; its answer to the release
    says whether it admitted the call, rejected it or never saw it (and never will). None:
    a stock server's call, which named none: vLLM aborted the request when the call closed
    and does not say (outcome unknown), so it is counted and its leases go back now, and
    this returns None. Otherwise it returns the release still to run (awaited or spawned),
    which gives the leases back when it ends, whatever happens: the prefill frees the slot
    only when the release arrives, so counting it free earlier invites a 429. Not a freed
    slot either way: a prefill drops an abandoned prompt only at its next step."""
    if kv_id is None:
        metrics.abandoned_outcome(result, None)
        _give_back(held, slot_freed=False)
        return None
    held = tuple(held)

    async def release() -> None:
        try:
            admission = await upstream.release_kv_id(url, kv_id, request_id=request_id)
            # Before the leases: once they are back, every release has ended.
            metrics.abandoned_outcome(result, admission)
        finally:
            _give_back(held, slot_freed=False)

    return release()


def release_answered(
    upstream: Upstream,
    handoffs: Handoffs | None,
    background: Background,
    params: dict[str, Any],
    held: Sequence[Lease],
    *,
    request_id: str,
    leg: StockLeg | None,
) -> None:
    """Free the KV of a prefill call that answered but that no decode will take (its waiter
    left, or its grant was closed), then give back `held`, once, as a freed slot: the
    prefill is done with the prompt. A pdgate prefill's by the answer's params (`leg` None),
    in the background: it frees the slot only when the release arrives, so counting it free
    earlier invites a 429. A stock prefill's by a release leg where its connector has one
    (handoff.py), else its counts go back now."""
    held = tuple(held)
    send: Callable[[], Awaitable[object]]
    if leg is None:
        send = partial(upstream.release_kv, params, request_id=request_id)
    elif handoffs is not None and leg.release_params(params) is not None:
        send = partial(handoffs.release, leg, params)
    else:
        _give_back(held, slot_freed=True)
        return

    async def run() -> None:
        try:
            await send()
        finally:
            _give_back(held, slot_freed=True)

    background.spawn(run(), dropped=partial(_give_back, held, slot_freed=True))


def _give_back(held: Sequence[Lease], *, slot_freed: bool) -> None:
    for lease in held:
        lease.release(slot_freed=slot_freed)


def _never_started(task: asyncio.Task[None], call: PrefillCall) -> None:
    """A task cancelled before its first step runs no line of its coroutine, so none of
    `_attempt`'s clean-up: nothing was sent, and the counts taken for it go back here."""
    if task.cancelled() and not call.started:
        call.release(slot_freed=True)
        _end(call.span, "abandoned")


def _end(span: Span, outcome: str, status: int | None = None) -> None:
    if span.is_recording():
        span.set_attribute("pdgate.outcome", outcome)
        if status is not None:
            span.set_attribute("http.response.status_code", status)
    span.end()
