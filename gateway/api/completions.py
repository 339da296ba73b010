"""``POST /v1/completions`` and ``POST /v1/chat/completions``: where a request's life starts
and ends.

The life of a request, each step with the module that does it (docs/architecture.md):

1. admission, here: the client's key (admission/auth.py), the body read within its bounds and
   parsed (config/openai_api.py), counted against ``max_pending``; a prompt that cannot fit
   in its model's context gets its 400 now (admission/context.py), before it queues;
2. its group, tenant and TTFT deadline (admission/groups.py, admission/tenancy.py);
3. the relay takes it (stream/relay.py, `Relay.run`) and asks the dispatcher for its legs;
4. the prefill leg (placement/dispatch.py, `Dispatcher.prefill`): its queue's admission
   takes it (placement/admission.py) and it waits in the queue (placement/queue.py) until
   its forwarder (placement/forwarder.py) takes a slot through the fleet's leases
   (placement/leases.py), forms a run (placement/batching.py) and posts it to a prefill
   (placement/prefill_call.py, upstream/h1.py); the grant holds the KV
   (placement/placed.py); the first token may go to the client now;
5. the decode leg (`Dispatcher.decode`, placement/decode_leg.py): a decode takes the
   request with the prefill's ``kv_transfer_params`` and streams;
6. the relay sends the decode's events on (or assembles the answer, stream/assemble.py);
   a decode that breaks is replaced and the stream goes on from the tokens sent
   (stream/continuation.py);
7. release, here: every count and lease once, in one ``finally``; metrics and the span.

One endpoint serves both APIs (`Api`, from the request's path): they differ only in the
schema that parses the body, the path both legs go to, the answer's id prefix and the text
the prefix-affinity index hashes (a chat's rendered conversation, see
`ChatCompletionRequest.prompt_key`); the queue, the deadline, the counts and the relay are
the same, and so are the limits (one ``max_pending`` for both).

Written as a plain ASGI callable so one place owns the request's whole life: a task watches
for the client's disconnect from the moment the body is read, and cancels whatever the
request is doing (waiting for a prefill, prefilling, streaming); every count is released in
one ``finally``.

Admission counts a request only once its body is whole: uploads are bounded separately
(`max_uploads`) and must finish within `body_timeout_s`, so clients that send headers and
stall cannot lock everybody else out of `max_pending`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Mapping
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from pdgate.config.aio import run_unless, wait_disconnect
from pdgate.config.openai_api import (
    Api,
    ApiRequest,
    ClientGone,
    OpenAIError,
    parse_api,
    read_body,
)
from pdgate.config.settings import GatewaySettings
from pdgate.config.tracing import Tracing
from pdgate.config.wire import REQUEST_ID_HEADER, TPOT_SLO_HEADER, valid_request_id
from pdgate.gateway.admission.auth import PRIORITIES, ApiKey, KeyRing
from pdgate.gateway.admission.context import ContextLimit
from pdgate.gateway.admission.groups import GROUP_HEADER, GroupResolver
from pdgate.gateway.admission.retry_after import Departures
from pdgate.gateway.admission.tenancy import resolve_tenancy
from pdgate.gateway.errors import (
    BadRequest,
    GatewayError,
    Overloaded,
    ShuttingDown,
    from_openai_error,
)
from pdgate.gateway.instances.tracker import InstanceTracker
from pdgate.gateway.observe.metrics import ANY_GROUP, GatewayMetrics
from pdgate.gateway.observe.series import Series
from pdgate.gateway.placement.dispatch import Dispatcher
from pdgate.gateway.placement.placed import Placement
from pdgate.gateway.stream.relay import Relay, RelayOptions, RelayRequest
from pdgate.gateway.translate.base import Front
from pdgate.policies.base import RequestInfo

log = logging.getLogger("pdgate.completions")

TTFT_HEADER = "x-pdgate-ttft-timeout-ms"
# Set by the gateway on the prefill leg; a client that sends them would steer the handshake.
_GATEWAY_ONLY = {"kv_transfer_params": "kv_transfer_params is set by the gateway, not by clients"}


class CompletionsEndpoint:
    def __init__(
        self,
        settings: GatewaySettings,
        dispatcher: Dispatcher,
        tracker: InstanceTracker,
        metrics: GatewayMetrics,
        keys: KeyRing,
        *,
        groups: GroupResolver,
        tracing: Tracing | None = None,
        fronts: Mapping[str, Front] | None = None,
        context: ContextLimit | None = None,
    ) -> None:
        """`fronts`: the other APIs served as chat requests, by path (gateway/translate/);
        `context`: the context-length check (None: none)."""
        self._settings = settings
        self._fronts = dict(fronts or {})
        self._context = context
        self._keys = keys
        self._groups = groups  # the dispatcher's too: one view of the scenario groups
        self.retry_after = groups.retry_after
        self.series = Series()
        self._tracing = tracing or Tracing.off()
        self._dispatcher = dispatcher
        self._tracker = tracker
        self._metrics = metrics
        self.pending = 0  # admitted: body whole, not finished (`finished`)
        self.uploading = 0  # connections whose body is still arriving
        # How fast each count frees a place: what a request refused at its limit is told.
        self._finishing = Departures()
        self._uploaded = Departures()
        self.stopping = False  # `stop`: no new request, and none left without an answer

    def shutting_down(self) -> ShuttingDown:
        """What a request is told while the gateway stops: another gateway serves it now."""
        return ShuttingDown(
            "the gateway is shutting down; retry on another",
            retry_after=self.retry_after.elsewhere(),
        )

    def stop(self) -> None:
        """The gateway stops (SIGTERM): requests waiting for a prefill, and new ones, get 503
        at once, so that their clients can go to another gateway; those placed go on until
        the server's grace ends, when each still running is answered (503, or an in-band
        error once it streams) rather than cut."""
        self.stopping = True
        self._dispatcher.shed(self.shutting_down())

    def refusal(self) -> GatewayError | None:
        """Why no new request is taken now: the gateway is stopping, or at `max_pending` (the
        side endpoints' requests count too); None: one is."""
        if self.stopping:
            return self.shutting_down()
        if self.pending >= self._settings.max_pending:
            return Overloaded(
                "the gateway is at its limit of pending requests",
                retry_after=self._until_room(
                    self.pending, self._settings.max_pending, self._finishing
                ),
            )
        return None

    def finished(self) -> None:
        """An admitted request (of any endpoint counted in `pending`) has ended."""
        self.pending -= 1
        self._finishing.left(time.monotonic())

    def _until_room(self, count: int, limit: int, departures: Departures) -> float:
        """Until enough of `count` have left for one more to fit under `limit`, at the rate
        they have been leaving (none measured yet: the floor)."""
        return self.retry_after.drain(count - limit + 1, departures.per_s(time.monotonic()))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrived = time.monotonic()
        request = Request(scope, receive)
        headers = header_map(scope)
        front = self._fronts.get(scope["path"]) if self._fronts else None
        api = Api.CHAT if front is not None or scope["path"] == Api.CHAT.path else Api.COMPLETIONS
        request_id = _request_id(headers, api)
        reply = _reply if front is None else front.error
        try:
            # Before reading a byte of the body: a caller without a key costs nothing.
            credentials = (
                headers.get("authorization") if front is None else front.credentials(headers)
            )
            key = self._keys.client(credentials)
            self._keys.admit(key, self.retry_after)
            body = await self.read(request)
        except GatewayError as exc:
            self._metrics.requests.labels(error_outcome(exc), ANY_GROUP).inc()
            await reply(exc)(scope, receive, send)
            return
        except ClientGone:
            self._metrics.requests.labels("client_gone", ANY_GROUP).inc()
            return
        refused = self.refusal()
        if refused is not None:
            # `overloaded`: max_pending reached (a full group queue is `gateway_overloaded`).
            label = "overloaded" if isinstance(refused, Overloaded) else error_outcome(refused)
            self._metrics.requests.labels(label, ANY_GROUP).inc()
            await reply(refused)(scope, receive, send)
            return
        self.pending += 1
        span = self._tracing.serve("pdgate.request", headers)
        watcher: asyncio.Task[None] | None = None
        placement: Placement | None = None
        info: RequestInfo | None = None
        outcome = "ok"
        group = ANY_GROUP
        relaying = False  # the relay sent the response's start: past it, no status to send
        relay: Relay | None = None
        try:
            out = None
            prompt_bytes = len(body)
            if front is None:
                req, forward = self._parse(body, api)
            else:
                translated = await front.translate(body, key)
                req, forward = translated.req, translated.forward
                if not valid_request_id(headers.get(REQUEST_ID_HEADER, "")):
                    request_id = translated.request_id  # one id: the answer's, both legs'
                out = translated.out(send, request_id)
                prompt_bytes = translated.prompt_bytes
            info = self._request_info(req, forward, key, headers)
            group = info.group or ANY_GROUP
            if self._context is not None and self._context.may_exceed(
                info.model, prompt_bytes, req, info.max_tokens
            ):
                await self._context.check(info.model, req, forward, info.max_tokens)
            deadline = arrived + (info.ttft_s or self._settings.ttft_timeout_s)
            watcher = asyncio.ensure_future(wait_disconnect(receive))
            if span.is_recording():
                span.set_attribute("pdgate.request_id", request_id)
                span.set_attribute("pdgate.api", api.value if front is None else front.name)
                span.set_attribute("pdgate.model", info.model)
                span.set_attribute("pdgate.group", info.group or "")
                span.set_attribute("pdgate.stream", req.stream)
                span.set_attribute("pdgate.prompt_chars", info.prompt_chars)
            settings = self._settings
            relay = Relay(
                self._dispatcher,
                send,
                RelayRequest(
                    info, req, forward, api, request_id, deadline, arrived, group=group, span=span
                ),
                RelayOptions(
                    chunk_bytes=settings.stream_chunk_bytes,
                    max_response_bytes=settings.max_response_bytes,
                    max_migrations=settings.max_migrations,
                    first_token_early=settings.first_token_early,
                    ttft_timeout_s=self._groups.ttft_timeout_s(info.group),
                ),
                self._metrics,
                self._tracing,
                out,
            )
            try:
                outcome = await run_unless(relay.run(), watcher, lost=ClientGone())
            finally:
                placement = relay.first
                relaying = relay.started
        except GatewayError as exc:
            outcome = error_outcome(exc)
            if not relaying:
                await reply(exc)(scope, receive, send)
        except ClientGone:
            outcome = "client_gone"
        except asyncio.CancelledError:
            if not self.stopping:
                raise
            # The server's grace ended (`stop`): an answer, not a cut connection and a 500.
            stopped = self.shutting_down()
            outcome = error_outcome(stopped)
            with contextlib.suppress(OSError):
                if relaying and relay is not None:
                    await relay.out.error(stopped)
                else:
                    await reply(stopped)(scope, receive, send)
        except Exception:
            # A bug, not the client's fault. This endpoint runs outside Starlette's error
            # middleware (gateway/app.py), so it answers with an OpenAI error body itself.
            log.exception("unhandled error on request %s", request_id)
            outcome = "internal_error"
            if not relaying:
                await reply(GatewayError("internal gateway error"))(scope, receive, send)
        finally:
            if placement is not None:
                placement.close()
            if watcher is not None:
                watcher.cancel()
            self.finished()
            self._metrics.requests.labels(outcome, group).inc()
            self._observe(outcome, info, placement, arrived)
            if span.is_recording():
                span.set_attribute("pdgate.outcome", outcome)
            span.end()

    def _observe(
        self, outcome: str, info: RequestInfo | None, placement: Placement | None, arrived: float
    ) -> None:
        """The operator's history and the P/D ratio advice's inputs."""
        first = placement.first_token_at if placement is not None else None
        self.series.record(
            outcome,
            None if first is None else first - arrived,
            placement.prefill_rejections if placement is not None else 0,
        )
        advisor = self._dispatcher.advisor
        if placement is not None:
            if (capacity := self._dispatcher.decode_capacity) is not None:
                capacity.held(placement.decode_id, time.monotonic() - placement.opened_at)
            advisor.arrival(placement.prefill_group)
            if outcome == "ok" and first is not None and placement.tokens > 0:
                rec = self._tracker.records().get(placement.decode_id)
                advisor.decode(
                    placement.decode_group,
                    first - placement.opened_at,
                    placement.tokens,
                    placement.gaps_s / max(placement.tokens - 1, 1),
                    rec.hardware if rec else "",
                )
        elif info is not None:
            # Demand that found no room counts too: it is what the ratio must serve.
            groups = [info.group] if info.group else sorted(self._tracker.groups(info.model))
            if len(groups) == 1:
                advisor.arrival(groups[0])

    async def read(self, request: Request) -> bytes:
        """The request's body within the gateway's bounds, counted against ``max_uploads``
        while it arrives (the side endpoints read theirs here too)."""
        settings = self._settings
        if self.uploading >= settings.max_uploads:
            raise Overloaded(
                "the gateway is at its limit of requests being uploaded",
                retry_after=self._until_room(self.uploading, settings.max_uploads, self._uploaded),
            )
        self.uploading += 1
        try:
            body = await read_body(request, settings.max_body_bytes, settings.body_timeout_s)
        except OpenAIError as exc:
            raise from_openai_error(exc) from exc
        finally:
            self.uploading -= 1
            self._uploaded.left(time.monotonic())
        if not body:
            raise BadRequest("request body is empty; expected a JSON object")
        return body

    def _parse(self, body: bytes, api: Api) -> tuple[ApiRequest, dict[str, Any]]:
        try:
            req, forward = parse_api(
                api,
                body,
                max_tokens_limit=self._settings.max_tokens_limit,
                default_max_tokens=self._settings.default_max_tokens,
            )
        except OpenAIError as exc:
            raise from_openai_error(exc) from exc
        for key, why in _GATEWAY_ONLY.items():
            if forward.get(key) is not None:
                raise BadRequest(why, param=key)
        return req, forward

    def _request_info(
        self,
        req: ApiRequest,
        forward: dict[str, Any],
        key: ApiKey | None,
        headers: Mapping[str, str],
    ) -> RequestInfo:
        """What the policies and the queue know of the request: its model, group, prompt,
        tenant, priority class and share weight (gateway/admission/tenancy.py), and its TTFT
        budget."""
        model = self._groups.model(req.model)
        if req.model is None:
            forward["model"] = model
        prompt = req.prompt_key
        group = self._groups.resolve(model, key, headers.get(GROUP_HEADER), len(prompt))
        who = resolve_tenancy(
            key,
            headers,
            group_priority=self._groups.priority(group),
            keyless_max_priority=PRIORITIES[self._settings.keyless_max_priority],
        )
        return RequestInfo(
            model=model,
            group=group,
            prompt=prompt,
            prompt_chars=len(prompt),
            max_tokens=int(forward["max_tokens"]),
            tenant=who.tenant,
            priority=who.priority,
            weight=who.weight,
            ttft_s=_tighter(self._groups.ttft_timeout_s(group), headers, TTFT_HEADER),
            tpot_s=_tighter(self._groups.tpot_slo_s(group), headers, TPOT_SLO_HEADER),
            prompt_ids=req.prompt_ids,
        )


def _reply(error: OpenAIError) -> ASGIApp:
    return error.response()


def _tighter(bound: float, headers: Mapping[str, str], name: str) -> float:
    """The group's `bound` (seconds), or less where header `name` asks (milliseconds)."""
    raw = headers.get(name)
    if raw is None:
        return bound
    try:
        asked_ms = int(raw)
    except ValueError as exc:
        raise BadRequest(f"{name} must be an integer number of milliseconds") from exc
    if asked_ms <= 0:
        raise BadRequest(f"{name} must be positive")
    try:
        asked = asked_ms / 1000
    except OverflowError:
        return bound  # beyond any float: no tighter than the bound
    # A client may only tighten it: the gateway's own bound protects the fleet.
    return min(bound, asked)


def header_map(scope: Scope) -> dict[str, str]:
    """The request's headers by name, built once: Starlette's `Headers` scans the list on
    every lookup, and a request looks up eight. ASGI servers give the names in lower case;
    a repeated header's first value counts, as with `Headers.get`."""
    out: dict[str, str] = {}
    for name, value in scope["headers"]:
        key = name.decode("latin-1")
        if key not in out:
            out[key] = value.decode("latin-1")
    return out


def _request_id(headers: Mapping[str, str], api: Api = Api.COMPLETIONS) -> str:
    """The client's ``x-request-id`` if it is usable, else a new one (``cmpl-``, or
    ``chatcmpl-`` for chat, as OpenAI's ids). It is sent upstream on both legs, and pdgate's
    shims use it as the answer's ``id``: one id everywhere."""
    given = headers.get(REQUEST_ID_HEADER, "")
    if valid_request_id(given):
        return given
    return f"{api.id_prefix}-{secrets.token_hex(16)}"


def error_outcome(exc: GatewayError) -> str:
    """The metrics' outcome of a request that ended in `exc`: any 4xx is the client's."""
    if exc.status < 500:
        return "client_error"
    return exc.code or "server_error"
