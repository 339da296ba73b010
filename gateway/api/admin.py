"""The endpoints besides completions: ``/v1/models``, ``/health``, ``/metrics`` and the admin
JSON the dashboard reads (``/admin/instances``, ``/admin/queues``, ``/admin/series``,
``/admin/ratio``).

Each handler reads the parts it shows from the request's state, which the gateway's lifespan
fills (gateway/app.py): ``tracker``, ``membership``, ``metrics``, ``endpoint``,
``dispatcher``, ``index``, ``fleet``, ``keys``, ``settings``, ``prefill_policy``,
``decode_policy`` and ``started``. Admin endpoints need the admin token; ``/v1/models`` a
client key (when keys are configured); ``/health`` nothing.
"""

from __future__ import annotations

from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pdgate.gateway.admission.auth import KeyRing
from pdgate.gateway.api.completions import CompletionsEndpoint
from pdgate.gateway.instances.affinity import PrefixLookup
from pdgate.gateway.instances.tracker import InstanceTracker
from pdgate.gateway.observe.metrics import GatewayMetrics
from pdgate.gateway.placement.dispatch import Dispatcher
from pdgate.gateway.placement.leases import Fleet
from pdgate.registry.membership import Membership

__all__ = ["ORJSONResponse", "admin_routes"]

RATIO_NOTE = (
    "eq. 1 of P/D-Serve: n_p*b_p/T_p = n_d*b_d/T_d; desired_* are this gateway's share of the "
    "fleet's need at the target utilization (sum over gateways)"
)


class ORJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def _admin(request: Request) -> None:
    keys: KeyRing = request.state.keys
    keys.admin(request.headers.get("authorization"))


async def models(request: Request) -> Response:
    """Every model and LoRA adapter ready instances serve, in vLLM's shape (its ``ModelCard``,
    which OpenAI's clients parse): a model with its ``max_model_len`` (the smallest a ready
    instance reports; null when none does), an adapter with its ``parent`` (its context is
    its model's, null here as vLLM lists it)."""
    keys: KeyRing = request.state.keys
    keys.client(request.headers.get("authorization"))
    tracker: InstanceTracker = request.state.tracker
    created = int(request.state.started)
    data = []
    for name in tracker.models():
        parent = tracker.parent(name)
        data.append(
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "pdgate",
                "root": name,
                "parent": parent,
                "max_model_len": None if parent is not None else tracker.max_model_len(name),
                "permission": [],
            }
        )
    return ORJSONResponse({"object": "list", "data": data})


async def health(request: Request) -> Response:
    membership: Membership = request.state.membership
    index: PrefixLookup | None = request.state.index
    tracker: InstanceTracker = request.state.tracker
    endpoint: CompletionsEndpoint = request.state.endpoint
    dispatcher: Dispatcher = request.state.dispatcher
    fleet: Fleet = request.state.fleet
    streams, inflight = tracker.totals()
    return ORJSONResponse(
        {
            "status": "ok",
            "registry": "ok" if membership.healthy else "unreachable (serving last known view)",
            "instances": len(tracker.records()),
            "open_streams": streams,
            "inflight": inflight,
            "pending": endpoint.pending,
            "queued": dispatcher.queued(),
            "decode_waiting": dispatcher.decode_waiting(),
            "gateway_id": fleet.gateway_id,
            "fleet": {
                "shared": fleet.shared,
                "degraded": fleet.degraded,
                "gateways": fleet.gateways,
            },
            "prefill_policy": request.state.prefill_policy.describe(),
            "decode_policy": request.state.decode_policy.describe(),
            # null: the policy scores no prefix affinity, so no index is kept at all.
            "affinity_index": None if index is None else dict(index.stats()),
        }
    )


async def instances(request: Request) -> Response:
    _admin(request)
    tracker: InstanceTracker = request.state.tracker
    return ORJSONResponse({"instances": list(tracker.describe())})


async def queues(request: Request) -> Response:
    _admin(request)
    dispatcher: Dispatcher = request.state.dispatcher
    return ORJSONResponse({"queues": dispatcher.describe_queues()})


async def series(request: Request) -> Response:
    _admin(request)
    endpoint: CompletionsEndpoint = request.state.endpoint
    return ORJSONResponse(endpoint.series.snapshot())


async def ratio(request: Request) -> Response:
    _admin(request)
    tracker: InstanceTracker = request.state.tracker
    fleet: Fleet = request.state.fleet
    dispatcher: Dispatcher = request.state.dispatcher
    advice = [a.as_dict() for a in dispatcher.advisor.advise(tracker.records())]
    return ORJSONResponse({"gateways": fleet.gateways, "note": RATIO_NOTE, "groups": advice})


async def metrics(request: Request) -> Response:
    if request.state.settings.metrics_auth:
        _admin(request)
    m: GatewayMetrics = request.state.metrics
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)


def admin_routes() -> list[Route]:
    return [
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/admin/instances", instances, methods=["GET"]),
        Route("/admin/queues", queues, methods=["GET"]),
        Route("/admin/series", series, methods=["GET"]),
        Route("/admin/ratio", ratio, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
