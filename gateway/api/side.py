"""The side endpoints: requests sent whole to one instance of their model, never in two legs.

``POST /v1/embeddings``, ``/pooling``, ``/score``, ``/v1/score``, ``/rerank``, ``/v1/rerank``
and ``/v2/rerank`` (computed by a pooling model), ``/tokenize`` and ``/detokenize``
(answered by an engine's API server). Their admission is chat's (gateway/api/completions.py):
the client's key and its rate limit before a byte of the body is read, the body read within
``max_body_bytes`` and ``body_timeout_s``, counted against ``max_pending`` with the chat
requests, the key's group and tenant, the request's ``x-request-id`` (sent upstream and back)
and its trace span. The body is vLLM's, passed on as it came (its ``model`` filled in when
omitted and the gateway serves one model).

* A pooling request waits for a slot on an aggregated instance of its model that declares
  the endpoint, in its own queue (`Dispatcher.side_slot`: deadline order, ranking, fleet
  slot leases, drain admission, as an aggregated request), until its TTFT deadline; then it
  is sent, and answered within ``side_timeout_s``. A 429 queues it again; a failure (5xx,
  no answer, a 4xx about the instance rather than the request) counts against the instance
  and the retry budget and queues it again for another, until the deadline.
* ``/tokenize`` and ``/detokenize`` take no slot: the least loaded ready instance of the model
  that declares the path, of any role, is asked, and the next one when it cannot be reached
  or fails (gateway/instances/endpoints.py).

The answer is the instance's, status and JSON body as it gave them (a 400, 413 or 422 says the
request is bad: the client hears it). The gateway's own errors are OpenAI error bodies: 400
for a body that is not a JSON object, 404 ``model_not_found`` for a model nobody serves, 404
``endpoint_not_served`` naming the model when none of its instances answers that endpoint,
503 with Retry-After when no instance took the request before its deadline, 502 when they
failed and the retry budget is spent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from typing import Any

from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from pdgate.config.aio import run_unless, wait_disconnect
from pdgate.config.openai_api import ClientGone, OpenAIError, load_object
from pdgate.config.settings import GatewaySettings
from pdgate.config.tracing import Span, Tracing
from pdgate.config.wire import (
    POOLING_ENDPOINTS,
    REQUEST_ID_HEADER,
    SIDE_ENDPOINTS,
    TOKEN_ENDPOINTS,
    Role,
    valid_request_id,
)
from pdgate.gateway.admission.auth import PRIORITIES, KeyRing
from pdgate.gateway.admission.groups import GROUP_HEADER, GroupResolver
from pdgate.gateway.admission.tenancy import resolve_tenancy
from pdgate.gateway.api.completions import CompletionsEndpoint, error_outcome, header_map
from pdgate.gateway.errors import (
    BadGateway,
    BadRequest,
    DeadlineExceeded,
    GatewayError,
    UpstreamError,
    from_openai_error,
    is_client_fault,
)
from pdgate.gateway.instances.endpoints import Answer, call_first, serving
from pdgate.gateway.instances.tracker import InstanceTracker
from pdgate.gateway.observe.metrics import ANY_GROUP, GatewayMetrics
from pdgate.gateway.placement.dispatch import Dispatcher
from pdgate.gateway.upstream.base import Upstream
from pdgate.policies.base import RequestInfo

__all__ = ["SIDE_PATHS", "EndpointNotServed", "SideEndpoint"]

log = logging.getLogger("pdgate.side")

SIDE_PATHS = frozenset(SIDE_ENDPOINTS)
# Instances asked for one /tokenize or /detokenize at most, one after another.
_TOKEN_TRIES = 4
_JSON = [(b"content-type", b"application/json")]


class EndpointNotServed(GatewayError):
    """404: the model is served, but none of its instances answers this endpoint."""

    status = 404
    type = "invalid_request_error"
    code = "endpoint_not_served"


class SideEndpoint:
    """One ASGI callable for every side path (see the module docstring). It shares the
    completions endpoint's admission counts (`pending`, `uploading`) and its stop."""

    def __init__(
        self,
        settings: GatewaySettings,
        admission: CompletionsEndpoint,
        dispatcher: Dispatcher,
        tracker: InstanceTracker,
        upstream: Upstream,
        metrics: GatewayMetrics,
        keys: KeyRing,
        *,
        groups: GroupResolver,
        tracing: Tracing | None = None,
    ) -> None:
        self._settings = settings
        self._admission = admission
        self._dispatcher = dispatcher
        self._tracker = tracker
        self._upstream = upstream
        self._metrics = metrics
        self._keys = keys
        self._groups = groups
        self._tracing = tracing or Tracing.off()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrived = time.monotonic()
        path: str = scope["path"]
        headers = header_map(scope)
        given = headers.get(REQUEST_ID_HEADER, "")
        request_id = given if valid_request_id(given) else f"side-{secrets.token_hex(16)}"
        admission, settings = self._admission, self._settings
        try:
            key = self._keys.client(headers.get("authorization"))
            self._keys.admit(key, admission.retry_after)
            body = await admission.read(Request(scope, receive))
        except GatewayError as exc:
            self._count(path, error_outcome(exc), ANY_GROUP)
            await exc.response()(scope, receive, send)
            return
        except ClientGone:
            self._count(path, "client_gone", ANY_GROUP)
            return
        error = admission.refusal()
        if error is not None:
            self._count(path, error_outcome(error), ANY_GROUP)
            await error.response()(scope, receive, send)
            return
        admission.pending += 1
        span = self._tracing.serve("pdgate.request", headers)
        watcher: asyncio.Task[None] | None = None
        outcome, group = "ok", ANY_GROUP
        try:
            forward = _parse(body)
            model = self._model(forward)
            group_name = self._groups.resolve(model, key, headers.get(GROUP_HEADER), len(body))
            group = group_name or ANY_GROUP
            if span.is_recording():
                span.set_attribute("pdgate.request_id", request_id)
                span.set_attribute("pdgate.api", path)
                span.set_attribute("pdgate.model", model)
                span.set_attribute("pdgate.group", group_name or "")
            watcher = asyncio.ensure_future(wait_disconnect(receive))
            if path in TOKEN_ENDPOINTS:
                work = self._tokens(path, model, group_name, forward, request_id, span)
            else:
                who = resolve_tenancy(
                    key,
                    headers,
                    group_priority=self._groups.priority(group_name),
                    keyless_max_priority=PRIORITIES[settings.keyless_max_priority],
                )
                ttft_s = self._groups.ttft_timeout_s(group_name)
                info = RequestInfo(
                    model=model,
                    group=group_name,
                    prompt="",
                    prompt_chars=len(body),
                    max_tokens=1,
                    tenant=who.tenant,
                    priority=who.priority,
                    weight=who.weight,
                    ttft_s=ttft_s,
                )
                work = self._pooled(path, info, forward, request_id, arrived + ttft_s, span)
            answer = await run_unless(work, watcher, lost=ClientGone())
            if answer.status != 200:
                outcome = "client_error"
            if span.is_recording():
                span.set_attribute("pdgate.instance", answer.instance.id)
                span.set_attribute("http.response.status_code", answer.status)
            await _relay(send, answer, request_id)
        except GatewayError as exc:
            outcome = error_outcome(exc)
            await exc.response()(scope, receive, send)
        except ClientGone:
            outcome = "client_gone"
        except Exception:
            log.exception("unhandled error on side request %s", request_id)
            outcome = "internal_error"
            await GatewayError("internal gateway error").response()(scope, receive, send)
        finally:
            if watcher is not None:
                watcher.cancel()
            admission.finished()
            self._count(path, outcome, group)
            if span.is_recording():
                span.set_attribute("pdgate.outcome", outcome)
            span.end()

    def _count(self, path: str, outcome: str, group: str) -> None:
        self._metrics.side_requests.labels(path, outcome, group).inc()

    def _model(self, forward: dict[str, Any]) -> str:
        """The request's model (filled in when omitted and one is served)."""
        requested = forward.get("model")
        if requested is not None and not isinstance(requested, str):
            raise BadRequest("model must be a string", param="model")
        forward["model"] = model = self._groups.model(requested)
        return model

    async def _tokens(
        self,
        path: str,
        model: str,
        group: str | None,
        forward: dict[str, Any],
        request_id: str,
        span: Span,
    ) -> Answer:
        """``/tokenize`` or ``/detokenize``: the least loaded instance that answers."""
        candidates = serving(self._tracker, model, path, group=group)
        if not candidates:
            raise _not_served(model, path)
        failed: list[str] = []
        headers: dict[str, str] = {}
        self._tracing.inject(span, headers)
        answer = await call_first(
            self._upstream,
            candidates,
            path,
            forward,
            request_id=request_id,
            deadline=time.monotonic() + self._settings.side_timeout_s,
            tries=_TOKEN_TRIES,
            failed=failed,
            headers=headers,
            tracker=self._tracker,
        )
        if answer is None:
            log.warning("%s for %s failed on every instance tried: %s", path, model, failed[-1:])
            raise BadGateway(f"every instance serving {path} for {model!r} failed")
        return answer

    async def _pooled(
        self,
        path: str,
        info: RequestInfo,
        forward: dict[str, Any],
        request_id: str,
        deadline: float,
        span: Span,
    ) -> Answer:
        """A pooling request: a slot in the endpoint's queue, then the call, again after a
        429 or a failure, until `deadline`."""
        model = info.model
        if not serving(self._tracker, model, path, (Role.AGGREGATED,), info.group):
            raise _not_served(model, path)
        dispatcher, tracker = self._dispatcher, self._tracker
        dispatcher.budget.deposit()
        while True:
            grant = await dispatcher.side_slot(
                info, path, request_id=request_id, deadline=deadline, span=span
            )
            grant.take()  # its two leases are this call's now
            inst = grant.instance
            headers: dict[str, str] = {}
            self._tracing.inject(span, headers)
            slot_freed = False
            try:
                status, raw = await self._upstream.post(
                    inst.url,
                    path,
                    forward,
                    request_id=request_id,
                    timeout_s=self._settings.side_timeout_s,
                    headers=headers,
                )
                slot_freed = status != 429
            except UpstreamError as exc:  # unreachable, timed out, an answer too large
                failure = str(exc)
            else:
                if status == 200 or is_client_fault(status):
                    dispatcher.ejector.success(inst.id)
                    return Answer(inst, status, raw)
                if status == 429:
                    tracker.rejected(inst.id)
                    continue  # its slot is taken: back in the queue, the others first
                failure = f"{inst.url}{path} answered HTTP {status}"
            finally:
                grant.stream.release(slot_freed=slot_freed)
                grant.inflight.release(slot_freed=slot_freed)
            log.warning("side request %s failed on %s: %s", request_id, inst.id, failure)
            tracker.failed(inst.id)
            dispatcher.ejector.failure(inst.id, "aggregated")
            if time.monotonic() >= deadline:
                # It failed on instances (a busy one would have answered 429 and the queue
                # told it at its deadline): the membership's next read may bring others.
                raise DeadlineExceeded(
                    f"no instance answered {path} before the request's deadline",
                    retry_after=self._admission.retry_after.membership(),
                )
            if not dispatcher.budget.withdraw():
                self._metrics.retry_budget_exhausted.inc()
                raise BadGateway(f"the instances serving {path} are failing; not retried")


def _parse(body: bytes) -> dict[str, Any]:
    try:
        return load_object(body)
    except OpenAIError as exc:
        raise from_openai_error(exc) from exc


def _not_served(model: str, path: str) -> EndpointNotServed:
    kind = "" if path not in POOLING_ENDPOINTS else " aggregated"
    return EndpointNotServed(
        f"the model {model!r} is not served at {path}: none of its{kind} instances answers it",
        param="model",
    )


async def _relay(send: Send, answer: Answer, request_id: str) -> None:
    """The instance's answer as it gave it (a body that is not JSON is the instance's fault)."""
    body = answer.body
    if body[:1] not in (b"{", b"["):
        raise BadGateway(f"the instance answered HTTP {answer.status} without a JSON body")
    headers = [
        *_JSON,
        (b"content-length", str(len(body)).encode()),
        (b"x-request-id", request_id.encode("latin-1")),
        (b"x-pdgate-instance", answer.instance.id.encode("latin-1", "replace")),
    ]
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    with contextlib.suppress(OSError):
        await send({"type": "http.response.body", "body": body, "more_body": False})
