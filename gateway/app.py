"""The composition root: every part of one gateway, built once and handed down.

`build_gateway_app` returns the ASGI app. Its lifespan builds the parts in order (`Gateway`
names each), each from a small named function where it takes more than a constructor
(`watch_membership`, `open_upstream`, `open_fleet`, `open_prefix_index`), starts them, and
closes them in the reverse order. `build_dispatcher` builds the placement stage the same
way: what every queue shares (`queue_parts`), then each part that places a leg, handed to
the `Dispatcher`. Nothing lives at module level. The life of a request through these parts
is in gateway/api/completions.py.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from pdgate.config import GatewaySettings, RegistrySettings
from pdgate.config.aio import Background, Backoff, ExponentialBackoff
from pdgate.config.openai_api import error_json
from pdgate.config.tracing import Tracing
from pdgate.gateway.admission.auth import KeyRing
from pdgate.gateway.admission.context import ContextLimit, EngineTokenCounter, TokenCounter
from pdgate.gateway.admission.groups import GroupResolver
from pdgate.gateway.admission.retry_after import RetryAfter
from pdgate.gateway.api.admin import admin_routes
from pdgate.gateway.api.completions import CompletionsEndpoint
from pdgate.gateway.api.dashboard import dashboard_routes
from pdgate.gateway.api.messages import messages_routes
from pdgate.gateway.api.responses import responses_routes
from pdgate.gateway.api.side import SIDE_PATHS, SideEndpoint
from pdgate.gateway.errors import GatewayError
from pdgate.gateway.instances.affinity import PrefixIndex, PrefixLookup
from pdgate.gateway.instances.health import Ejection, Ejector, RetryBudget
from pdgate.gateway.instances.kv_events import KvEventFeed
from pdgate.gateway.instances.kv_index import KvBlockIndex
from pdgate.gateway.instances.prompt_tokens import PromptTokenizers
from pdgate.gateway.instances.tracker import InstanceTracker
from pdgate.gateway.observe.loop_lag import LoopLagMonitor
from pdgate.gateway.observe.metrics import GatewayMetrics
from pdgate.gateway.observe.ratio import RatioAdvisor
from pdgate.gateway.placement.admission import AdmissionOptions
from pdgate.gateway.placement.aggregated import WholeRequests
from pdgate.gateway.placement.decode_attempt import DecodeAttempts, client_error
from pdgate.gateway.placement.decode_leg import DecodeLegs
from pdgate.gateway.placement.direct import DirectPrefill
from pdgate.gateway.placement.dispatch import Dispatcher
from pdgate.gateway.placement.drain import DecodeCapacity, DecodeWaits
from pdgate.gateway.placement.handoff import Handoffs
from pdgate.gateway.placement.leases import Fleet
from pdgate.gateway.placement.local_prefill import LocalPrefill
from pdgate.gateway.placement.push import PushDecodes
from pdgate.gateway.placement.queues import Queues
from pdgate.gateway.placement.shared import ForwardingOptions, Shared
from pdgate.gateway.translate.base import Front
from pdgate.gateway.translate.messages import MessagesFront
from pdgate.gateway.translate.responses import ResponsesFront
from pdgate.gateway.upstream.base import Upstream, UpstreamOptions
from pdgate.gateway.upstream.h1 import H1Upstream
from pdgate.gateway.upstream.http import HttpUpstream
from pdgate.gateway.upstream.stalls import StallBound
from pdgate.policies import admit_idle, load_policy
from pdgate.policies.base import Ranker
from pdgate.registry.base import InstanceRecord, Registry
from pdgate.registry.fleet import FleetStore, LocalFleet, RedisFleet, SlotTable
from pdgate.registry.membership import Listener, Membership
from pdgate.registry.responses import (
    MemoryResponseStore,
    RedisResponseStore,
    ResponseStore,
    StoreLimits,
)
from pdgate.registry.static import static_api_keys

log = logging.getLogger("pdgate.gateway")


class _Late:
    """An ASGI endpoint bound in the lifespan (routes are declared before it runs)."""

    def __init__(self) -> None:
        self.target: CompletionsEndpoint | SideEndpoint | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.target is None:
            await Response(error_json("gateway is starting", "service_unavailable"), 503)(
                scope, receive, send
            )
            return
        await self.target(scope, receive, send)


# The paths of the completions endpoint: completions and chat, and the APIs it serves as
# chat requests (gateway/translate/).
_API_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"})


class GatewayApp:
    """The Starlette app, except that ``POST`` to the completions endpoint's paths
    (``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses``, ``/v1/messages``) goes
    straight to it.

    The endpoint is a plain ASGI callable that answers its own errors, so the hot path skips
    Starlette's middleware and router: measured (``pdgate bench profile``), their send
    wrappers cost more per relayed SSE chunk than the relay itself."""

    def __init__(self, app: Starlette, completions: _Late, side: _Late | None = None) -> None:
        """`side`: the side endpoints (gateway/api/side.py), likewise outside Starlette."""
        self.app = app
        self._completions = completions
        self._side = side or _Late()

    def stop(self) -> None:
        """The process is told to stop: before its server's grace, the completions endpoint
        sheds what waits and refuses what comes (`CompletionsEndpoint.stop`; the side
        endpoints share its admission)."""
        target = self._completions.target
        if isinstance(target, CompletionsEndpoint):
            target.stop()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in _API_PATHS and scope["method"] == "POST":
            await self._completions(scope, receive, send)
        elif scope["type"] == "http" and scope["path"] in SIDE_PATHS and scope["method"] == "POST":
            await self._side(scope, receive, send)
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


def open_response_store(
    settings: GatewaySettings, registry_settings: RegistrySettings
) -> ResponseStore:
    """Stored responses in the registry's Redis when there is one (every gateway of the
    fleet reads them), else in this process."""
    limits = StoreLimits(
        ttl_s=settings.responses_ttl_s,
        max_entry_bytes=settings.responses_max_entry_bytes,
        max_per_scope=settings.responses_max_per_key,
        max_bytes=settings.responses_memory_bytes,
    )
    if registry_settings.url:
        return RedisResponseStore(
            registry_settings.url,
            key_prefix=registry_settings.key_prefix,
            limits=limits,
            connect_timeout_s=registry_settings.connect_timeout_s,
        )
    return MemoryResponseStore(limits)


def _fronts(settings: GatewaySettings, store: ResponseStore) -> dict[str, Front]:
    """The APIs the completions endpoint serves as chat requests, by path."""
    return {
        "/v1/responses": ResponsesFront(
            store,
            max_tokens_limit=settings.max_tokens_limit,
            default_max_tokens=settings.default_max_tokens,
        ),
        "/v1/messages": MessagesFront(max_tokens_limit=settings.max_tokens_limit),
    }


def _upstream_headers(
    settings: GatewaySettings, registry_settings: RegistrySettings
) -> dict[str, str]:
    token = settings.upstream_api_key or registry_settings.cluster_token
    return {"authorization": f"Bearer {token.get_secret_value()}"} if token else {}


def _forget_departed(index: PrefixLookup) -> Listener:
    # Departed instances took their prefix caches with them.
    def listener(view: Mapping[str, InstanceRecord], departed: set[str]) -> None:
        index.drop_instances(departed)

    return listener


@dataclass(frozen=True, kw_only=True)
class Gateway:
    """Every part of a running gateway, by name (the admin endpoints read them)."""

    settings: GatewaySettings
    keys: KeyRing
    prefill_policy: Ranker
    decode_policy: Ranker
    tracker: InstanceTracker
    membership: Membership
    upstream: Upstream
    metrics: GatewayMetrics
    index: PrefixLookup | None
    fleet: Fleet
    dispatcher: Dispatcher
    endpoint: CompletionsEndpoint
    responses: ResponseStore  # stored responses of the Responses API
    side: SideEndpoint
    # A prompt's tokens as the engines count them (gateway/admission/context.py).
    tokens: TokenCounter
    started: float  # wall clock, for /v1/models' `created`

    def state(self) -> dict[str, Any]:
        """The lifespan state: each part under its own name (gateway/api/admin.py)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def queue_parts(
    settings: GatewaySettings,
    *,
    tracker: InstanceTracker,
    upstream: Upstream,
    metrics: GatewayMetrics,
    index: PrefixLookup | None,
    fleet: Fleet,
    backoff: Backoff | None,
    tracing: Tracing,
    retry_after: RetryAfter,
) -> Shared:
    """What every queue of the gateway shares (gateway/placement/shared.py)."""
    return Shared(
        tracker=tracker,
        upstream=upstream,
        backoff=backoff
        or ExponentialBackoff(
            settings.backoff_initial_s, settings.backoff_max_s, settings.backoff_jitter
        ),
        metrics=metrics,
        index=index,
        options=ForwardingOptions(
            batch_forwarding=settings.batch_forwarding,
            batch_endpoint=settings.prefill_batch_endpoint,
            admit_idle=settings.prefill_admit == "idle",
            client_error=client_error,
            try_timeout_s=settings.prefill_try_timeout_s,
        ),
        background=Background("pdgate-dispatch"),
        fleet=fleet,
        ejector=Ejector(
            tracker,
            metrics,
            Ejection(settings.eject_after_failures, settings.eject_base_s, settings.eject_max_s),
        ),
        budget=RetryBudget(settings.retry_budget_ratio, settings.retry_budget_burst),
        decode_waits=DecodeWaits(tracker),
        tracing=tracing,
        advisor=RatioAdvisor(
            window_s=settings.ratio_window_s, target_utilization=settings.ratio_target_utilization
        ),
        decode_capacity=DecodeCapacity(tracker) if settings.drain_decode_bound else None,
        handoffs=Handoffs(tracker.records, tracker.loads, upstream),
        admission=AdmissionOptions(
            retry_after=retry_after,
            early_drop=settings.early_drop,
            drain_admission=settings.drain_admission,
            drain_sweep=settings.drain_sweep,
            drain_headroom=settings.drain_headroom,
            decode_backpressure=settings.decode_backpressure,
            retry_keeps_place=settings.retry_keeps_place,
            prefill_estimate_quantile=settings.prefill_estimate_quantile,
        ),
    )


def retry_after_of(
    settings: GatewaySettings, registry_settings: RegistrySettings | None = None
) -> RetryAfter:
    """What the gateway's refusals tell clients to wait (gateway/admission/retry_after.py)."""
    floor_s, ceiling_s = settings.retry_after_s, settings.retry_after_max_s
    if registry_settings is None:
        return RetryAfter(floor_s=floor_s, ceiling_s=ceiling_s)
    poll_s = registry_settings.poll_interval_s
    return RetryAfter(floor_s=floor_s, ceiling_s=ceiling_s, poll_s=poll_s)


def build_dispatcher(
    settings: GatewaySettings,
    *,
    tracker: InstanceTracker,
    upstream: Upstream,
    metrics: GatewayMetrics,
    prefill_policy: Ranker,
    decode_policy: Ranker,
    index: PrefixLookup | None = None,
    fleet: Fleet | None = None,
    groups: GroupResolver | None = None,
    backoff: Backoff | None = None,
    tracing: Tracing | None = None,
) -> Dispatcher:
    """The placement stage: the parts that place each leg, built in order and handed to the
    dispatcher (gateway/placement/dispatch.py)."""
    fleet = fleet or Fleet(LocalFleet(settings.gateway_id), tracker)
    groups = groups or GroupResolver(settings, tracker, retry_after_of(settings))
    shared = queue_parts(
        settings,
        tracker=tracker,
        upstream=upstream,
        metrics=metrics,
        index=index,
        fleet=fleet,
        backoff=backoff,
        tracing=tracing or Tracing.off(),
        retry_after=groups.retry_after,
    )
    ejector, budget, handoffs = shared.ejector, shared.budget, shared.handoffs
    decodes = DecodeAttempts(tracker, upstream, metrics.decode_attempts, ejector, shared.tracing)
    # An aggregated group's instances always compute: never the `idle` filter for them.
    ranking = admit_idle(prefill_policy) if settings.prefill_admit == "idle" else prefill_policy
    queues = Queues(
        settings,
        shared,
        groups,
        prefill_policy=ranking,
        aggregated_policy=prefill_policy,
    )
    dispatcher = Dispatcher(
        settings,
        shared,
        queues=queues,
        direct=DirectPrefill(
            groups.retry_after,
            tracker,
            ranking,
            upstream,
            metrics,
            shared.background,
            index,
            handoffs,
        ),
        whole=WholeRequests(
            tracker,
            queues,
            decodes,
            ejector=ejector,
            budget=budget,
            metrics=metrics,
            retry_after=groups.retry_after,
        ),
        decode_legs=DecodeLegs(
            settings,
            tracker,
            decodes,
            decode_policy,
            waits=shared.decode_waits,
            backoff=shared.backoff,
            budget=budget,
            metrics=metrics,
            handoffs=handoffs,
            retry_after=groups.retry_after,
            capacity=shared.decode_capacity,
        ),
        # Conditional disaggregation (gateway/placement/local_prefill.py).
        local=LocalPrefill(settings, tracker, decodes, decode_policy, metrics, ejector),
        # NixlPushConnector's decodes, chosen before the prefill leg (push.py).
        push=None
        if handoffs is None
        else PushDecodes(
            tracker,
            decodes,
            handoffs,
            decode_policy,
            shared.backoff,
            retry_after=groups.retry_after,
            waits=shared.decode_waits,
            capacity=shared.decode_capacity,
        ),
    )
    fleet.serve_queues(dispatcher.heads, dispatcher)
    return dispatcher


def watch_membership(
    registry: Registry, registry_settings: RegistrySettings, tracker: InstanceTracker
) -> Membership:
    """The registry's view of the fleet, which the tracker follows (started by the lifespan)."""
    membership = Membership(
        registry,
        poll_interval_s=registry_settings.poll_interval_s,
        max_instances=registry_settings.max_instances,
        hold_s=registry_settings.ttl_s,
    )
    membership.add_listener(tracker.update_membership)
    return membership


def open_upstream(
    settings: GatewaySettings,
    registry_settings: RegistrySettings,
    instance_keys: Mapping[str, str],
) -> Upstream:
    """The HTTP client towards the instances (``upstream_client``): the cluster's token for
    every instance, a static server's own key for it (`static_api_keys`)."""
    transport = H1Upstream if settings.upstream_client == "h1" else HttpUpstream
    options = UpstreamOptions(
        connections=settings.upstream_connections,
        connect_timeout_s=settings.upstream_connect_timeout_s,
        read_timeout_s=settings.upstream_read_timeout_s,
        headers=_upstream_headers(settings, registry_settings),
        instance_headers={
            url: {"authorization": f"Bearer {key}"} for url, key in instance_keys.items()
        },
        header_timeout_s=settings.decode_header_timeout_s,
        stall_bound=None
        if settings.decode_stall_timeout_s is None
        else StallBound(
            floor_s=min(settings.decode_stall_floor_s, settings.decode_stall_timeout_s),
            ceiling_s=settings.decode_stall_timeout_s,
            factor=settings.decode_stall_factor,
        ),
    )
    return transport.connect(options)


def open_fleet(
    settings: GatewaySettings, registry_settings: RegistrySettings, tracker: InstanceTracker
) -> Fleet:
    """The fleet's slot leases and syncs (gateway/placement/leases.py; started by the
    lifespan)."""
    return Fleet(
        open_fleet_store(settings, registry_settings),
        tracker,
        sync_interval_s=settings.fleet_sync_interval_s,
        ttl_s=settings.fleet_ttl_s,
        window_s=settings.fleet_window_s,
    )


def open_prefix_index(
    settings: GatewaySettings,
    policy: Ranker,
    membership: Membership,
    metrics: GatewayMetrics,
    tokenizers: PromptTokenizers,
) -> tuple[PrefixLookup | None, KvEventFeed | None]:
    """The prefix index, for a policy that scores prefix affinity only (None otherwise): the
    prompts' character history, and with ``kv_prefix`` the engines' KV events over it (the
    feed, which the lifespan closes, follows the membership). Departed instances took their
    prefix caches with them: the index forgets them."""
    if "kv_prefix" not in policy.needs and "prefix" not in policy.needs:
        return None, None
    chars = PrefixIndex(
        block_chars=settings.affinity_block_chars,
        max_blocks=settings.affinity_max_blocks,
        max_bytes=settings.affinity_max_bytes,
    )
    index: PrefixLookup = chars
    kv_feed: KvEventFeed | None = None
    if "kv_prefix" in policy.needs:
        # The engines' KV events, with the character history for those without.
        kv_index = KvBlockIndex(
            tokenizers,
            chars,
            max_blocks=settings.kv_index_max_blocks,
            pending_s=settings.kv_index_pending_s,
        )
        kv_feed = KvEventFeed(kv_index, tokenizers, metrics.registry)
        membership.add_listener(kv_feed.on_change)
        index = kv_index
    membership.add_listener(_forget_departed(index))
    return index, kv_feed


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
    side = _Late()
    started = time.time()
    owns_tracing = tracing is None
    traces = Tracing.from_env("pdgate-gateway") if tracing is None else tracing

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        # The parts in order, each handed those it needs; started below, stopped in reverse.
        tracker = InstanceTracker(reject_hold_s=settings.reject_hold_s)
        membership = watch_membership(registry, registry_settings, tracker)
        owned = upstream is None
        client = (
            upstream
            if upstream is not None
            else open_upstream(settings, registry_settings, instance_keys)
        )
        fleet = open_fleet(settings, registry_settings, tracker)
        # Late-bound: the gauges read the dispatcher and the endpoint built just below.
        metrics = GatewayMetrics(
            tracker.totals,
            lambda: endpoint.pending,
            tracker.describe,
            lambda: dispatcher.advisor.advise(tracker.records()),
            lambda: (fleet.calls, fleet.call_seconds),
            lambda: dispatcher.describe_queues(),
            lambda: dispatcher.decode_waiting(),
        )
        # The served models' tokenizers, loaded on first use (prefix matching, token counts).
        tokenizers = PromptTokenizers(settings.tokenizers)
        index, kv_feed = open_prefix_index(
            settings, prefill_policy, membership, metrics, tokenizers
        )
        groups = GroupResolver(settings, tracker, retry_after_of(settings, registry_settings))
        dispatcher = build_dispatcher(
            settings,
            groups=groups,
            tracker=tracker,
            upstream=client,
            metrics=metrics,
            prefill_policy=prefill_policy,
            decode_policy=decode_policy,
            index=index,
            fleet=fleet,
            tracing=traces,
        )
        responses = open_response_store(settings, registry_settings)
        counter = EngineTokenCounter(
            tracker,
            client,
            tokenizers,
            timeout_s=settings.token_count_timeout_s,
            tries=settings.token_count_tries,
        )
        context = ContextLimit(
            tracker,
            counter,
            template_tokens=settings.context_template_tokens,
            message_tokens=settings.context_message_tokens,
        )
        endpoint = CompletionsEndpoint(
            settings,
            dispatcher,
            tracker,
            metrics,
            keys,
            groups=groups,
            tracing=traces,
            fronts=_fronts(settings, responses),
            context=context,
        )
        side_endpoint = SideEndpoint(
            settings,
            endpoint,
            dispatcher,
            tracker,
            client,
            metrics,
            keys,
            groups=groups,
            tracing=traces,
        )
        gateway = Gateway(
            settings=settings,
            keys=keys,
            prefill_policy=prefill_policy,
            decode_policy=decode_policy,
            tracker=tracker,
            membership=membership,
            upstream=client,
            metrics=metrics,
            index=index,
            fleet=fleet,
            dispatcher=dispatcher,
            endpoint=endpoint,
            responses=responses,
            side=side_endpoint,
            tokens=counter,
            started=started,
        )
        try:
            await membership.start()
        except BaseException:
            # Refused credentials at start-up: what was opened must not leak.
            if kv_feed is not None:
                await kv_feed.aclose()
            await responses.aclose()
            await fleet.aclose()
            if owned:
                await client.aclose()
            raise
        tracker.update_membership(membership.instances(), set())
        await fleet.start()
        loop_lag = None
        if settings.loop_lag_interval_s > 0:
            loop_lag = LoopLagMonitor(metrics.loop_lag.observe, settings.loop_lag_interval_s)
            loop_lag.start()
        completions.target = endpoint
        side.target = side_endpoint
        try:
            yield gateway.state()
        finally:
            completions.target = None
            side.target = None
            if loop_lag is not None:
                await loop_lag.stop()
            # In this order: pending KV releases still need the upstream session, and the
            # last slot leases go back to the fleet before it closes.
            await dispatcher.close()
            await responses.aclose()
            await fleet.aclose()
            await membership.stop()
            if kv_feed is not None:
                await kv_feed.aclose()
            if owned:
                await client.aclose()
            if owns_tracing:
                traces.shutdown()

    app = Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),  # GatewayApp takes POSTs
            Route("/v1/chat/completions", completions, methods=["POST"]),  # (this one too)
            Route("/v1/responses", completions, methods=["POST"]),  # (and these)
            Route("/v1/messages", completions, methods=["POST"]),
            *responses_routes(),
            *messages_routes(),
            *(Route(path, side, methods=["POST"]) for path in sorted(SIDE_PATHS)),
            *admin_routes(),
            *dashboard_routes(keys),
        ],
        lifespan=lifespan,
        exception_handlers={
            HTTPException: _http_error,
            GatewayError: _gateway_error,
            Exception: _internal_error,
        },
    )
    return GatewayApp(app, completions, side)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return Response(
        error_json(str(exc.detail), "invalid_request_error", code=f"http_{exc.status_code}"),
        status_code=exc.status_code,
        media_type="application/json",
        headers=exc.headers,
    )


async def _gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    return exc.response()


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return Response(
        error_json("internal gateway error", "internal_error"),
        500,
        media_type="application/json",
    )
