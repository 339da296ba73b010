"""The gateway's Starlette application.

Shared resources (aiohttp session, registry membership, dispatcher) are created in the
lifespan and handed down; nothing lives at module level.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from pdgate.config import GatewaySettings, RegistrySettings
from pdgate.config.aio import ExponentialBackoff
from pdgate.config.openai_api import error_json
from pdgate.config.tracing import Tracing
from pdgate.gateway.affinity import PrefixIndex
from pdgate.gateway.auth import KeyRing
from pdgate.gateway.completions import CompletionsEndpoint
from pdgate.gateway.dashboard import dashboard_routes
from pdgate.gateway.dispatch import Dispatcher
from pdgate.gateway.errors import GatewayError
from pdgate.gateway.fleet import Fleet
from pdgate.gateway.http_upstream import HttpUpstream
from pdgate.gateway.instances import InstanceTracker
from pdgate.gateway.metrics import GatewayMetrics
from pdgate.gateway.upstream import Upstream
from pdgate.policies import load_policy, needs
from pdgate.policies.base import Ranker
from pdgate.registry.base import InstanceRecord, Registry
from pdgate.registry.fleet import FleetStore, LocalFleet, RedisFleet, SlotTable
from pdgate.registry.membership import Listener, Membership
from pdgate.registry.static import static_api_keys

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


# The paths of the completions endpoint (one endpoint for both APIs).
_API_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class GatewayApp:
    """The Starlette app, except that ``POST /v1/completions`` and ``POST
    /v1/chat/completions`` go straight to their endpoint.

    The endpoint is a plain ASGI callable that answers its own errors, so the hot path skips
    Starlette's middleware and router: measured (``pdgate bench profile``), their send
    wrappers cost more per relayed SSE chunk than the relay itself."""

    def __init__(self, app: Starlette, completions: _Late) -> None:
        self.app = app
        self._completions = completions

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in _API_PATHS and scope["method"] == "POST":
            await self._completions(scope, receive, send)
        else:
            await self.app(scope, receive, send)


def open_fleet_store(settings: GatewaySettings, registry_settings: RegistrySettings) -> FleetStore:
    """Shared through the registry's Redis when there is one (and `fleet` is on); otherwise
    this process's own view, and under ``--workers`` the node's slot table, shared by its
    workers through the OS (registry/_slot_table.py)."""
    if settings.fleet and registry_settings.url:
        return RedisFleet(
            registry_settings.url,
            key_prefix=registry_settings.key_prefix,
            gateway_id=settings.gateway_id,
            ttl_s=settings.fleet_ttl_s,
            window_s=settings.fleet_window_s,
            connect_timeout_s=registry_settings.connect_timeout_s,
        )
    table = (
        SlotTable(settings.worker_slots_fd, settings.worker_index)
        if settings.worker_slots_fd is not None
        else None
    )
    return LocalFleet(settings.gateway_id, table)


_RATIO_NOTE = (
    "eq. 1 of P/D-Serve: n_p*b_p/T_p = n_d*b_d/T_d; desired_* are this gateway's share of the "
    "fleet's need at the target utilization (sum over gateways)"
)


def _upstream_headers(
    settings: GatewaySettings, registry_settings: RegistrySettings
) -> dict[str, str]:
    token = settings.upstream_api_key or registry_settings.cluster_token
    return {"authorization": f"Bearer {token.get_secret_value()}"} if token else {}


def _describe(policy: Ranker) -> dict[str, object]:
    describe = getattr(policy, "describe", None)
    return describe() if callable(describe) else {"name": policy.name}


def _forget_departed(index: PrefixIndex) -> Listener:
    # Departed instances took their prefix caches with them.
    def listener(view: Mapping[str, InstanceRecord], departed: set[str]) -> None:
        index.drop_instances(departed)

    return listener


def build_gateway_app(
    settings: GatewaySettings,
    registry: Registry,
    registry_settings: RegistrySettings,
    *,
    upstream: Upstream | None = None,
    tracing: Tracing | None = None,
) -> GatewayApp:
    """The gateway's ASGI app. `upstream` replaces the HTTP client towards the instances
    (tests pass a `MockUpstream`); the app then neither creates nor closes one."""
    # Fail at start-up, not on the first request, if a policy name is wrong.
    prefill_policy = load_policy(settings.prefill_policy, settings.prefill_policy_options)
    keys = KeyRing.load(
        [k.get_secret_value() for k in settings.api_keys],
        settings.api_keys_file,
        settings.admin_token.get_secret_value() if settings.admin_token else None,
    )
    decode_policy = load_policy(settings.decode_policy, settings.decode_policy_options)
    # Static servers' own API keys (a stock server started with its own ``--api-key``), from
    # the environment: a missing one fails the start. They live only in this process, never
    # in flags, config files or registry records; KV releases are not keyed (a stock server
    # has no release endpoint).
    instance_keys = static_api_keys(settings)
    completions = _Late()
    started = time.time()
    owns_tracing = tracing is None
    traces = Tracing.from_env("pdgate-gateway") if tracing is None else tracing

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        tracker = InstanceTracker(reject_hold_s=settings.reject_hold_s)
        membership = Membership(
            registry,
            poll_interval_s=registry_settings.poll_interval_s,
            max_instances=registry_settings.max_instances,
            hold_s=registry_settings.ttl_s,
        )
        membership.add_listener(tracker.update_membership)
        owned = upstream is None
        client: Upstream = (
            HttpUpstream.connect(
                connections=settings.upstream_connections,
                connect_timeout_s=settings.upstream_connect_timeout_s,
                read_timeout_s=settings.upstream_read_timeout_s,
                headers=_upstream_headers(settings, registry_settings),
                instance_headers={
                    url: {"authorization": f"Bearer {key}"} for url, key in instance_keys.items()
                },
                header_timeout_s=settings.decode_header_timeout_s,
                stall_timeout_s=settings.decode_stall_timeout_s,
            )
            if upstream is None
            else upstream
        )
        # Late-bound: the gauge reads the endpoint built just below.
        metrics = GatewayMetrics(
            tracker.totals,
            lambda: endpoint.pending,
            tracker.describe,
            lambda: dispatcher.advisor.advise(tracker.records()),
            lambda: (dispatcher.fleet.calls, dispatcher.fleet.call_seconds),
        )
        index: PrefixIndex | None = None
        if "prefix" in needs(prefill_policy):
            # Only a policy that scores prefix affinity pays for the index.
            index = PrefixIndex(
                block_chars=settings.affinity_block_chars,
                max_blocks=settings.affinity_max_blocks,
                max_bytes=settings.affinity_max_bytes,
            )
            membership.add_listener(_forget_departed(index))
        fleet = Fleet(
            open_fleet_store(settings, registry_settings),
            tracker,
            sync_interval_s=settings.fleet_sync_interval_s,
            ttl_s=settings.fleet_ttl_s,
            window_s=settings.fleet_window_s,
        )
        dispatcher = Dispatcher(
            settings,
            tracker,
            client,
            prefill_policy,
            decode_policy,
            ExponentialBackoff(
                settings.backoff_initial_s, settings.backoff_max_s, settings.backoff_jitter
            ),
            metrics,
            index,
            fleet,
            traces,
        )
        endpoint = CompletionsEndpoint(settings, dispatcher, tracker, metrics, keys, traces)
        try:
            await membership.start()
        except BaseException:
            # Refused credentials at start-up: what was opened must not leak.
            await fleet.aclose()
            if owned:
                await client.aclose()
            raise
        tracker.update_membership(membership.instances(), set())
        await fleet.start()
        completions.target = endpoint
        try:
            yield {
                "tracker": tracker,
                "membership": membership,
                "metrics": metrics,
                "endpoint": endpoint,
                "dispatcher": dispatcher,
                "index": index,
                "fleet": fleet,
            }
        finally:
            completions.target = None
            # In this order: pending KV releases still need the upstream session, and the
            # last slot leases go back to the fleet before it closes.
            await dispatcher.close()
            await fleet.aclose()
            await membership.stop()
            if owned:
                await client.aclose()
            if owns_tracing:
                traces.shutdown()

    async def models(request: Request) -> Response:
        keys.client(request.headers.get("authorization"))
        tracker: InstanceTracker = request.state.tracker
        data = [
            {"id": m, "object": "model", "created": int(started), "owned_by": "pdgate"}
            for m in tracker.models()
        ]
        return _ORJSONResponse({"object": "list", "data": data})

    async def health(request: Request) -> Response:
        membership: Membership = request.state.membership
        index: PrefixIndex | None = request.state.index
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
                "gateway_id": request.state.fleet.gateway_id,
                "fleet": {
                    "shared": request.state.fleet.shared,
                    "degraded": request.state.fleet.degraded,
                    "gateways": request.state.fleet.gateways,
                },
                "prefill_policy": _describe(prefill_policy),
                "decode_policy": _describe(decode_policy),
                # null: the policy scores no prefix affinity, so no index is kept at all.
                "affinity_index": None if index is None else dict(index.stats()),
            }
        )

    async def instances(request: Request) -> Response:
        keys.admin(request.headers.get("authorization"))
        tracker: InstanceTracker = request.state.tracker
        return _ORJSONResponse({"instances": list(tracker.describe())})

    async def queues(request: Request) -> Response:
        keys.admin(request.headers.get("authorization"))
        return _ORJSONResponse({"queues": request.state.dispatcher.describe_queues()})

    async def series(request: Request) -> Response:
        keys.admin(request.headers.get("authorization"))
        return _ORJSONResponse(request.state.endpoint.series.snapshot())

    async def ratio(request: Request) -> Response:
        keys.admin(request.headers.get("authorization"))
        tracker: InstanceTracker = request.state.tracker
        fleet: Fleet = request.state.fleet
        advice = [a.as_dict() for a in request.state.dispatcher.advisor.advise(tracker.records())]
        return _ORJSONResponse({"gateways": fleet.gateways, "note": _RATIO_NOTE, "groups": advice})

    async def metrics(request: Request) -> Response:
        if settings.metrics_auth:
            keys.admin(request.headers.get("authorization"))
        m: GatewayMetrics = request.state.metrics
        return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return Response(
            error_json(str(exc.detail), "invalid_request_error", code=f"http_{exc.status_code}"),
            status_code=exc.status_code,
            media_type="application/json",
            headers=exc.headers,
        )

    async def gateway_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, GatewayError)
        return exc.response()

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
            Route("/v1/chat/completions", completions, methods=["POST"]),  # (this one too)
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/admin/instances", instances, methods=["GET"]),
            Route("/admin/queues", queues, methods=["GET"]),
            Route("/admin/series", series, methods=["GET"]),
            Route("/admin/ratio", ratio, methods=["GET"]),
            *dashboard_routes(keys),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        lifespan=lifespan,
        exception_handlers={
            HTTPException: http_error,
            GatewayError: gateway_error,
            Exception: internal_error,
        },
    )
    return GatewayApp(app, completions)
