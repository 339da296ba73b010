"""The gateway's Starlette application.

Shared resources (aiohttp session, registry membership, dispatcher) are created in the
lifespan and handed down; nothing lives at module level.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from config import GatewaySettings, RegistrySettings
from engine_shim.wire import error_json
from gateway.affinity import PrefixIndex
from gateway.completions import CompletionsEndpoint
from gateway.dispatch import Dispatcher
from gateway.instances import InstanceTracker
from gateway.metrics import GatewayMetrics
from gateway.upstream import Upstream
from policies import ExponentialBackoff, load_decode_policy, load_prefill_policy
from registry.base import Registry
from registry.membership import Membership

log = logging.getLogger("pdgate.gateway")


class _ORJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


class _Late:
    """An ASGI endpoint bound in the lifespan (routes are declared before it runs)."""

    def __init__(self) -> None:
        self.target: CompletionsEndpoint | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.target is None:
            await Response(error_json("gateway is starting", "service_unavailable"), 503)(
                scope, receive, send
            )
            return
        await self.target(scope, receive, send)


class GatewayApp:
    """The Starlette app, except that ``POST /v1/completions`` goes straight to its endpoint.

    The endpoint is a plain ASGI callable that answers its own errors, so the hot path skips
    Starlette's middleware and router: measured (``pdgate bench profile``), their send
    wrappers cost more per relayed SSE chunk than the relay itself."""

    def __init__(self, app: Starlette, completions: _Late) -> None:
        self.app = app
        self._completions = completions

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["path"] == "/v1/completions"
            and scope["method"] == "POST"
        ):
            await self._completions(scope, receive, send)
        else:
            await self.app(scope, receive, send)


def build_gateway_app(
    settings: GatewaySettings, registry: Registry, registry_settings: RegistrySettings
) -> GatewayApp:
    # Fail at start-up, not on the first request, if a policy name is wrong.
    prefill_policy = load_prefill_policy(settings.prefill_policy, settings.prefill_policy_options)
    decode_policy = load_decode_policy(settings.decode_policy)
    completions = _Late()
    started = time.time()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        tracker = InstanceTracker(busy_hold_s=settings.backoff_max_s)
        membership = Membership(
            registry,
            poll_interval_s=registry_settings.poll_interval_s,
            max_instances=registry_settings.max_instances,
        )
        membership.add_listener(tracker.update_membership)
        connector = aiohttp.TCPConnector(
            limit=settings.upstream_connections,
            limit_per_host=0,
            keepalive_timeout=30,
            ttl_dns_cache=60,
        )
        # No cookie jar: cookies one upstream sets must never ride along on other clients'
        # requests (and the jar's bookkeeping is per-call work on the hot path).
        session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar()
        )
        upstream = Upstream(
            session,
            connect_timeout_s=settings.upstream_connect_timeout_s,
            read_timeout_s=settings.upstream_read_timeout_s,
        )
        # Late-bound: the gauge reads the endpoint built just below.
        metrics = GatewayMetrics(tracker.totals, lambda: endpoint.pending)
        index = PrefixIndex(
            block_chars=settings.affinity_block_chars,
            max_blocks=settings.affinity_max_blocks,
            max_entries=settings.affinity_max_entries,
        )
        # Departed instances took their prefix caches with them.
        membership.add_listener(lambda _view, departed: index.drop_instances(departed))
        dispatcher = Dispatcher(
            settings,
            tracker,
            upstream,
            prefill_policy,
            decode_policy,
            ExponentialBackoff(
                settings.backoff_initial_s, settings.backoff_max_s, settings.backoff_jitter
            ),
            metrics,
            index,
        )
        endpoint = CompletionsEndpoint(settings, dispatcher, tracker, upstream, metrics)
        await membership.start()
        tracker.update_membership(membership.instances(), set())
        completions.target = endpoint
        try:
            yield {
                "tracker": tracker,
                "membership": membership,
                "metrics": metrics,
                "endpoint": endpoint,
                "dispatcher": dispatcher,
            }
        finally:
            completions.target = None
            await dispatcher.close()
            await membership.stop()
            await session.close()

    async def models(request: Request) -> Response:
        tracker: InstanceTracker = request.state.tracker
        data = [
            {"id": m, "object": "model", "created": int(started), "owned_by": "pdgate"}
            for m in tracker.models()
        ]
        return _ORJSONResponse({"object": "list", "data": data})

    async def health(request: Request) -> Response:
        membership: Membership = request.state.membership
        tracker: InstanceTracker = request.state.tracker
        streams, inflight = tracker.totals()
        return _ORJSONResponse(
            {
                "status": "ok",
                "registry": "ok" if membership.healthy else "unreachable (serving last known view)",
                "instances": len(tracker.records()),
                "open_streams": streams,
                "inflight": inflight,
                "pending": request.state.endpoint.pending,
                "queued": request.state.dispatcher.queued(),
            }
        )

    async def instances(request: Request) -> Response:
        tracker: InstanceTracker = request.state.tracker
        return _ORJSONResponse({"instances": list(tracker.describe())})

    async def metrics(request: Request) -> Response:
        m: GatewayMetrics = request.state.metrics
        return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return Response(
            error_json(str(exc.detail), "invalid_request_error", code=exc.status_code),
            status_code=exc.status_code,
            media_type="application/json",
            headers=exc.headers,
        )

    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return Response(
            error_json("internal gateway error", "internal_error"),
            500,
            media_type="application/json",
        )

    app = Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),  # GatewayApp takes POSTs
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/admin/instances", instances, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        lifespan=lifespan,
        exception_handlers={HTTPException: http_error, Exception: internal_error},
    )
    return GatewayApp(app, completions)
