"""The shim application: one prefill shim or decode worker, its engine, its registration.

`build_shim_app` returns a Starlette app whose lifespan starts the engine, creates the
aiohttp session and follows the registry's prefills (decode: KV pulls, from registered
prefills only), registers the instance with a `Heartbeat`, and on shutdown advertises
DRAINING, deregisters and stops everything.

What the engine serves (`ReportsModel`: its context length, its LoRA adapters) is read
once it has started, into the registry record and ``GET /v1/models`` (vLLM's shape: the
model, then each adapter with ``parent`` = the model); a backend with `Tokenization` serves
``/tokenize`` and ``/detokenize`` (engine_shim/_tokenize.py) and its record declares them.

With the registry's ``cluster_token`` set, the request paths (completions, chat, batch,
``/tokenize``, ``/detokenize``, ``/v1/kv/{id}``) need it as a bearer token; ``/health``,
``/load`` and ``/metrics`` stay open (probes and scrapers; they carry counts, never request
content). Without it, a shim refuses to listen beyond loopback unless
``allow_unauthenticated`` (`check_exposure`).

``app.state.shim`` is the `ShimRuntime`; its `drain()` lets an owner stop new work and wait
for in-flight work before stopping the server (by the time the lifespan shuts down, the
server has stopped accepting connections, so held KV could no longer be fetched).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import replace
from importlib import metadata
from urllib.parse import urlsplit

import aiohttp
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pdgate.config import PrefillAdmission, RegistrySettings, Role, ShimSettings
from pdgate.config.server import bind_socket, bound_port, is_loopback, is_wildcard
from pdgate.config.tracing import Tracing
from pdgate.config.wire import (
    EXT_BATCH_PREFILL,
    EXT_CONTINUATION,
    EXT_LOCAL_PREFILL,
    EXT_PHASES,
    EXT_QUEUELESS,
    EXT_SIM_TOKENIZER,
    HEALTH_PATH,
    LOAD_PATH,
    MODELS_PATH,
    TOKEN_ENDPOINTS,
    KvConnector,
)
from pdgate.engine_shim._gateway_watch import GatewayWatch
from pdgate.engine_shim._http import ApiError, ClusterAuth, json_response
from pdgate.engine_shim._kv_sources import KvSources
from pdgate.engine_shim._metrics import metrics_registry
from pdgate.engine_shim._tokenize import TokenizeEndpoints
from pdgate.engine_shim.backend import DecodeBackend, PrefillBackend, ReportsModel, Tokenization
from pdgate.engine_shim.decode import AggregatedWorker, DecodeWorker, local_prefill
from pdgate.engine_shim.prefill import PrefillShim
from pdgate.registry.base import InstanceRecord, InstanceState, Registry
from pdgate.registry.fleet import FleetMembers
from pdgate.registry.heartbeat import Heartbeat

__all__ = [
    "ENGINES",
    "MAX_BODY_BYTES",
    "ShimRuntime",
    "build_shim_app",
    "check_exposure",
    "instance_record",
    "make_backend",
]

log = logging.getLogger("pdgate.shim")

MAX_BODY_BYTES = 8 * 1024 * 1024

# Engine backends by name, each ``"module:factory"``; a factory takes the `ShimSettings` and
# returns the backend of ``settings.role``. Imported only when named: vLLM is an optional
# extra and slow to import. An engine outside pdgate is named by its own "module:factory".
ENGINES: Mapping[str, str] = {
    "sim": "pdgate.engine_shim.sim_engine:make_backend",
    "vllm": "pdgate.engine_shim.vllm_engine:make_vllm_backend",
}
_EXTRAS = {"vllm": "make vllm"}  # how to install what an engine needs


def _version() -> str:
    try:
        return metadata.version("pdgate")
    except metadata.PackageNotFoundError:
        return ""


def _base_url(settings: ShimSettings) -> str:
    if settings.advertise_url:
        return settings.advertise_url.rstrip("/")
    if settings.port == 0:
        raise ValueError(
            "shim port 0: bind the socket first and pass its port, or set advertise_url"
        )
    if is_wildcard(settings.host):
        raise ValueError(
            f"shim host {settings.host!r} is not reachable by others; set advertise_url"
        )
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    return f"http://{host}:{settings.port}"


def _extensions(settings: ShimSettings, backend: PrefillBackend | DecodeBackend) -> tuple[str, ...]:
    if settings.role is Role.PREFILL:
        sim = (EXT_SIM_TOKENIZER,) if settings.engine == "sim" else ()
        if settings.admission is PrefillAdmission.REJECT:
            return (EXT_BATCH_PREFILL, EXT_QUEUELESS, *sim)
        return (EXT_BATCH_PREFILL, *sim)
    if isinstance(backend, DecodeBackend) and local_prefill(settings, backend) is not None:
        if settings.role is Role.AGGREGATED:
            # It answers 429 itself when its slots are full: a lone gateway may count them.
            phases = (EXT_PHASES,) if settings.phases else ()
            return (EXT_CONTINUATION, EXT_LOCAL_PREFILL, EXT_QUEUELESS, *phases)
        return (EXT_CONTINUATION, EXT_LOCAL_PREFILL, EXT_QUEUELESS)
    return (EXT_CONTINUATION, EXT_QUEUELESS)


def instance_record(
    settings: ShimSettings, backend: PrefillBackend | DecodeBackend
) -> InstanceRecord:
    """What this shim registers: id, role, URL, model, group and capacity from `settings`,
    and the extensions it speaks (a decode's local prefill only if `backend` can)."""
    instance_id = settings.instance_id or (
        f"{settings.role.value}-{settings.host}-{settings.port}-{secrets.token_hex(3)}"
    )
    return InstanceRecord(
        id=instance_id,
        role=settings.role,
        url=_base_url(settings),
        model=settings.model,
        group=settings.group,
        capacity=settings.capacity,
        version=_version(),
        extensions=_extensions(settings, backend),
        hardware=settings.hardware or _sim_hardware(settings),
        kv_events=_kv_events(settings),
        max_model_len=settings.max_model_len,
        endpoints=TOKEN_ENDPOINTS if isinstance(backend, Tokenization) else (),
        # Its KV goes by pdgate's own wire, whatever the engine (an aggregated one hands none).
        connector="" if settings.role is Role.AGGREGATED else KvConnector.PDGATE.value,
    )


def served_record(
    record: InstanceRecord, backend: PrefillBackend | DecodeBackend
) -> InstanceRecord:
    """`record` with what the started engine reports of its model (`ReportsModel`)."""
    if not isinstance(backend, ReportsModel):
        return record
    served = backend.served_model()
    return replace(
        record,
        max_model_len=served.max_model_len or record.max_model_len,
        adapters=served.adapters,
    )


def model_list(record: InstanceRecord, root: str) -> dict[str, object]:
    """``GET /v1/models`` as vLLM answers it (vllm/entrypoints/openai/models/serving.py,
    `show_available_models`): the model with its ``max_model_len``, then each LoRA adapter
    with ``parent`` = the model (an adapter's card has no ``max_model_len``: the model's
    holds). `root`: what the model was loaded from."""
    created = int(time.time())
    permission = {
        "id": f"modelperm-{uuid.uuid4().hex}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    card = {"object": "model", "created": created, "owned_by": "vllm", "permission": [permission]}
    data = [
        {**card, "id": record.model, "root": root, "parent": None,
         "max_model_len": record.max_model_len or None},
        *(
            {**card, "id": name, "root": name, "parent": record.model, "max_model_len": None}
            for name in record.adapters
        ),
    ]  # fmt: skip
    return {"object": "list", "data": data}


def _free_port(host: str) -> int:
    """A port free on `host` now, for the KV events (the engine binds it soon after)."""
    with bind_socket(host, 0) as sock:
        return bound_port(sock)


def _kv_events(settings: ShimSettings) -> str:
    """Where a prefill's KV events are reached: its advertised host, the events port."""
    if settings.role is not Role.PREFILL or settings.kv_events_port is None:
        return ""
    host = urlsplit(_base_url(settings)).hostname or settings.host
    host = f"[{host}]" if ":" in host else host
    return f"tcp://{host}:{settings.kv_events_port}"


def _sim_hardware(settings: ShimSettings) -> str:
    """The sim's hardware, where its profile names one (``MODEL@GPU[/tpN]``)."""
    if settings.engine != "sim":
        return ""
    return settings.sim_profile.partition("@")[2]


def check_exposure(settings: ShimSettings, registry_settings: RegistrySettings) -> str | None:
    """Refuse (ValueError) to serve a non-loopback address without the cluster token unless
    that was asked for explicitly (a warning to log then), as the gateway does without keys:
    whoever reached the port could run prompts and read or drop other requests' KV."""
    if registry_settings.cluster_token is not None or is_loopback(settings.host):
        return None
    if not settings.allow_unauthenticated:
        raise ValueError(
            f"refusing to listen on {settings.host} without a cluster token: anyone who can "
            "reach it could run prompts and read other requests' KV. Set the registry's "
            "cluster_token (PDGATE_REGISTRY_CLUSTER_TOKEN) on every gateway and shim, or "
            "allow_unauthenticated = true if the network is closed to others."
        )
    return f"listening on {settings.host} WITHOUT a cluster token (allow_unauthenticated = true)"


def make_backend(settings: ShimSettings) -> PrefillBackend | DecodeBackend:
    """The engine backend named by ``settings.engine`` for ``settings.role``."""
    name = settings.engine
    target = ENGINES.get(name, name)
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        known = ", ".join(sorted(ENGINES))
        raise ValueError(f"unknown engine {name!r}; built-in: {known}, or 'module:factory'")
    try:
        factory: Callable[[ShimSettings], PrefillBackend | DecodeBackend] = getattr(
            importlib.import_module(module_name), attr
        )
    except ImportError as exc:
        hint = f" ({_EXTRAS[name]})" if name in _EXTRAS else ""
        raise ValueError(f"engine {name!r} cannot be imported{hint}: {exc}") from None
    except AttributeError:
        raise ValueError(f"engine {name!r}: module {module_name} has no {attr}") from None
    return factory(settings)


class ShimRuntime:
    """The running parts of one shim, started and stopped by the app lifespan."""

    def __init__(
        self,
        settings: ShimSettings,
        service: PrefillShim | DecodeWorker,
        backend: PrefillBackend | DecodeBackend,
        registry: Registry,
        registry_settings: RegistrySettings,
        record: InstanceRecord,
        sources: KvSources | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.settings = settings
        self.service = service
        self.backend = backend
        self.record = record
        self._sources = sources
        self._tracing = tracing
        self._heartbeat = Heartbeat(
            registry,
            record,
            interval_s=registry_settings.heartbeat_interval_s,
            ttl_s=registry_settings.ttl_s,
        )
        self._session: aiohttp.ClientSession | None = None
        # The KV held for gateways that left the fleet is let go (a fleet is in Redis only).
        self._gateways: GatewayWatch | None = None
        if isinstance(service, PrefillShim) and registry_settings.url is not None:
            members = FleetMembers(
                registry_settings.url,
                key_prefix=registry_settings.key_prefix,
                connect_timeout_s=registry_settings.connect_timeout_s,
            )
            self._gateways = service.watch_gateways(
                members, interval_s=registry_settings.heartbeat_interval_s
            )

    async def startup(self) -> None:
        await self.backend.start()
        self.record = served_record(self.record, self.backend)
        await self._heartbeat.update(self.record)  # not started yet: the record it registers
        if self._sources is not None:
            await self._sources.start()
        if isinstance(self.service, DecodeWorker):
            # Few connections: the retrieval workers, plus DELETEs of abandoned KV.
            connector = aiohttp.TCPConnector(limit=2 * self.settings.kv_retrieval_workers + 4)
            self._session = aiohttp.ClientSession(connector=connector)
            self.service.start(self._session)
        await self._heartbeat.start()
        if self._gateways is not None:
            self._gateways.start()
        log.info("%s %s serving at %s", self.record.role.value, self.record.id, self.record.url)

    async def drain(self, timeout_s: float = 30.0) -> bool:
        """Refuse new requests (503, /health 503, registry DRAINING) and wait until every slot
        is free or `timeout_s` passed; True when idle."""
        if not self.service.draining:
            self.service.draining = True
            await self._heartbeat.set_state(InstanceState.DRAINING)
        if timeout_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.service.slots.wait_idle(), timeout_s)
        return self.service.slots.used == 0

    async def shutdown(self) -> None:
        try:
            await self.drain(timeout_s=0)
            await self._heartbeat.stop()
        finally:
            if self._gateways is not None:
                await self._gateways.stop()
            await self.service.aclose()
            await self.backend.aclose()
            if self._sources is not None:
                await self._sources.aclose()
            if self._session is not None:
                await self._session.close()
            if self._tracing is not None:
                self._tracing.shutdown()

    def load(self) -> dict[str, object]:
        return self.service.load()


async def drain_shim(app: Starlette, timeout_s: float) -> bool:
    """Graceful stop, first half: refuse new work, wait for held KV and streams to end.

    Call it before stopping the server: once the listening socket closes, a decode can no
    longer pull the KV this prefill holds. True when the shim went idle in time.
    """
    runtime: ShimRuntime = app.state.shim
    return await runtime.drain(timeout_s)


def build_shim_app(
    settings: ShimSettings,
    registry: Registry,
    registry_settings: RegistrySettings,
    *,
    backend: PrefillBackend | DecodeBackend | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    tracing: Tracing | None = None,
) -> Starlette:
    """The ASGI app of one shim. `backend` replaces the engine named by ``settings.engine``;
    `tracing` the one the ``OTEL_*`` variables describe (the app then does not shut it down).
    Raises ValueError for a non-loopback address without a cluster token (`check_exposure`)."""
    warning = check_exposure(settings, registry_settings)
    if warning:
        log.warning("%s", warning)
    if settings.kv_events_port == 0:
        settings = settings.model_copy(update={"kv_events_port": _free_port(settings.host)})
    if backend is None:
        backend = make_backend(settings)
    record = instance_record(settings, backend)
    owned_tracing = tracing is None
    traces = Tracing.from_env("pdgate-shim") if tracing is None else tracing
    token = registry_settings.cluster_token
    auth = ClusterAuth(token.get_secret_value() if token else None)
    service: PrefillShim | DecodeWorker
    sources: KvSources | None = None
    if settings.role == Role.PREFILL:
        if not isinstance(backend, PrefillBackend):
            raise TypeError("a prefill shim needs a PrefillBackend")
        service = PrefillShim(
            settings,
            backend,
            instance_id=record.id,
            url=record.url,
            max_body_bytes=max_body_bytes,
            auth=auth,
            tracing=traces,
        )
    else:
        if not isinstance(backend, DecodeBackend):
            raise TypeError("a decode worker needs a DecodeBackend")
        # The decode pulls KV only from prefills in the registry it registers in.
        sources = KvSources(
            registry,
            poll_interval_s=registry_settings.poll_interval_s,
            max_instances=registry_settings.max_instances,
            hold_s=registry_settings.ttl_s,
        )
        worker = AggregatedWorker if settings.role is Role.AGGREGATED else DecodeWorker
        service = worker(
            settings,
            backend,
            instance_id=record.id,
            max_body_bytes=max_body_bytes,
            sources=sources,
            auth=auth,
            tracing=traces,
        )
    runtime = ShimRuntime(
        settings,
        service,
        backend,
        registry,
        registry_settings,
        record,
        sources,
        traces if owned_tracing else None,
    )
    metrics = metrics_registry(service.load, service.histograms)

    async def health(request: Request) -> Response:
        if service.draining:
            return json_response({"status": "draining"}, status=503)
        return json_response({"status": "ok"})

    async def load(request: Request) -> Response:
        return json_response(service.load())

    async def prometheus(request: Request) -> Response:
        return Response(generate_latest(metrics), media_type=CONTENT_TYPE_LATEST)

    # What vLLM's OpenAI server answers, so that routers which identify a vLLM backend by
    # these (SMG, vllm-router) can front the shims as they front vLLM.
    root = (settings.vllm_model if settings.engine == "vllm" else None) or settings.model

    async def models(request: Request) -> Response:
        return json_response(model_list(runtime.record, root))

    async def version(request: Request) -> Response:
        return json_response({"version": record.version or "0"})

    tokenize_routes = (
        TokenizeEndpoints(
            backend,
            settings.model,
            lambda: runtime.record.adapters,
            lambda: runtime.record.max_model_len,
            auth=auth,
            max_body_bytes=max_body_bytes,
            body_timeout_s=settings.body_timeout_s,
        ).routes()
        if isinstance(backend, Tokenization)
        else []
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await runtime.startup()
        try:
            yield
        finally:
            await runtime.shutdown()

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return ApiError(exc.status_code, exc.detail, code=f"http_{exc.status_code}").response()

    async def internal_error(request: Request, exc: Exception) -> Response:
        # Logged by Starlette's ServerErrorMiddleware; the client gets an OpenAI body.
        return ApiError(500, "internal error", type_="internal_error").response()

    app = Starlette(
        exception_handlers={HTTPException: http_error, Exception: internal_error},
        routes=[
            Route(HEALTH_PATH, health, methods=["GET"]),
            Route(LOAD_PATH, load, methods=["GET"]),
            Route("/metrics", prometheus, methods=["GET"]),
            Route(MODELS_PATH, models, methods=["GET"]),
            Route("/version", version, methods=["GET"]),
            *service.routes(),
            *tokenize_routes,
        ],
        lifespan=lifespan,
    )
    app.state.shim = runtime
    return app
