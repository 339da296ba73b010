"""``POST /v1/completions``: admission, validation, placement, relay.

Written as a plain ASGI callable so one place owns the request's whole life: a task watches
for the client's disconnect from the moment the body is read, and cancels whatever the
request is doing (waiting for a prefill, prefilling, streaming); every count is released in
one ``finally``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from config import GatewaySettings
from gateway._body import ClientGone, read_body
from gateway.dispatch import Dispatcher, Placement
from gateway.errors import BadRequest, GatewayError, ModelNotFound, Overloaded, ServiceUnavailable
from gateway.instances import InstanceTracker
from gateway.metrics import GatewayMetrics
from gateway.relay import relay_stream, relay_whole
from gateway.schemas import CompletionRequest, parse_completion
from gateway.upstream import Upstream
from policies.base import RequestInfo

log = logging.getLogger("pdgate.completions")

TTFT_HEADER = "x-pdgate-ttft-timeout-ms"
GROUP_HEADER = "x-pdgate-group"
T = TypeVar("T")


class CompletionsEndpoint:
    def __init__(
        self,
        settings: GatewaySettings,
        dispatcher: Dispatcher,
        tracker: InstanceTracker,
        upstream: Upstream,
        metrics: GatewayMetrics,
    ) -> None:
        self._settings = settings
        self._dispatcher = dispatcher
        self._tracker = tracker
        self._upstream = upstream
        self._metrics = metrics
        self.pending = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrived = time.monotonic()
        request = Request(scope, receive)
        request_id = _request_id(request)
        if self.pending >= self._settings.max_pending:
            self._metrics.requests.labels("overloaded").inc()
            err = Overloaded(
                "the gateway is at its limit of pending requests",
                retry_after=self._settings.retry_after_s,
            )
            await err.response()(scope, receive, send)
            return
        self.pending += 1
        watcher: asyncio.Task[None] | None = None
        placement: Placement | None = None
        outcome = "ok"
        relaying = False  # the relay sends the response's start: past it, no status to send
        try:
            body = await read_body(request, self._settings.max_body_bytes)
            req, forward = parse_completion(
                body,
                max_tokens_limit=self._settings.max_tokens_limit,
                default_max_tokens=self._settings.default_max_tokens,
            )
            info = self._request_info(req, forward, request.headers.get(GROUP_HEADER))
            deadline = arrived + self._ttft_timeout(request, info.group)
            watcher = asyncio.create_task(_wait_disconnect(receive))
            placement = await _unless_gone(
                self._dispatcher.place(info, forward, request_id=request_id, deadline=deadline),
                watcher,
            )
            self._metrics.placement.observe(time.monotonic() - arrived)
            relaying = True
            if req.stream:
                outcome = await _unless_gone(
                    relay_stream(
                        placement,
                        send,
                        request_id=request_id,
                        chunk_bytes=self._settings.stream_chunk_bytes,
                        metrics=self._metrics,
                        arrived=arrived,
                    ),
                    watcher,
                )
            else:
                outcome = await _unless_gone(
                    relay_whole(
                        placement,
                        send,
                        self._upstream,
                        request_id=request_id,
                        metrics=self._metrics,
                        arrived=arrived,
                    ),
                    watcher,
                )
        except GatewayError as exc:
            outcome = _outcome(exc)
            await exc.response()(scope, receive, send)
        except ClientGone:
            outcome = "client_gone"
        except Exception:
            # A bug, not the client's fault. This endpoint runs outside Starlette's error
            # middleware (gateway/app.py), so it answers with an OpenAI error body itself.
            log.exception("unhandled error on request %s", request_id)
            outcome = "internal_error"
            if not relaying:
                await GatewayError("internal gateway error").response()(scope, receive, send)
        finally:
            if placement is not None:
                placement.close()
            if watcher is not None:
                watcher.cancel()
            self.pending -= 1
            self._metrics.requests.labels(outcome).inc()

    def _request_info(
        self, req: CompletionRequest, forward: dict[str, Any], group: str | None
    ) -> RequestInfo:
        models = self._tracker.models()
        model = req.model
        if model is None:
            if len(models) != 1:
                raise BadRequest(
                    "model is required when the gateway serves several models", param="model"
                )
            model = models[0]
            forward["model"] = model
        elif model not in models:
            if not models:
                raise ServiceUnavailable(
                    "no instances are registered", retry_after=self._settings.retry_after_s
                )
            raise ModelNotFound(f"the model {model!r} does not exist", param="model")
        return RequestInfo(
            model=model,
            group=self._check_group(model, group),
            prompt=req.prompt_text,
            prompt_chars=len(req.prompt_text),
            max_tokens=int(forward["max_tokens"]),
        )

    def _check_group(self, model: str, group: str | None) -> str | None:
        """A scenario group the client names must exist (else every request to a typo would
        wait out its deadline); no header means any group of the model."""
        if group is None:
            return None
        if group not in self._tracker.groups(model):
            raise BadRequest(
                f"no instance of model {model!r} is in group {group!r}", param=GROUP_HEADER
            )
        return group

    def _ttft_timeout(self, request: Request, group: str | None) -> float:
        timeout = self._settings.group_ttft_timeout_s.get(
            group or "", self._settings.ttft_timeout_s
        )
        raw = request.headers.get(TTFT_HEADER)
        if raw is not None:
            try:
                asked = int(raw) / 1000
            except ValueError as exc:
                raise BadRequest(
                    f"{TTFT_HEADER} must be an integer number of milliseconds"
                ) from exc
            if asked <= 0:
                raise BadRequest(f"{TTFT_HEADER} must be positive")
            # A client may only shorten the deadline: the gateway's own bound protects the fleet.
            timeout = min(timeout, asked)
        return timeout


def _request_id(request: Request) -> str:
    given = request.headers.get("x-request-id", "")
    if 0 < len(given) <= 128 and given.isascii() and given.isprintable():
        return given
    return f"cmpl-{uuid.uuid4().hex}"


def _outcome(exc: GatewayError) -> str:
    if exc.status < 500:
        return "client_error"
    return exc.code or "server_error"


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_gone(work: Awaitable[T], watcher: asyncio.Task[None]) -> T:
    """Run `work`; cancel it and raise `ClientGone` if the client disconnects first."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise ClientGone
