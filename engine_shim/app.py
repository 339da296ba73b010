"""The shim application: one prefill shim or decode worker, its engine, its registration.

`build_shim_app` returns a Starlette app whose lifespan starts the engine, creates the
aiohttp session (decode: KV pulls), registers the instance with a `Heartbeat`, and on
shutdown advertises DRAINING, deregisters and stops everything. ``app.state.shim`` is the
`ShimRuntime`; its `drain()` lets an owner stop new work and wait for in-flight work before
stopping the server (by the time the lifespan shuts down, the server has stopped accepting
connections, so held KV could no longer be fetched).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator
from importlib import metadata

import aiohttp
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from config import RegistrySettings, Role, ShimSettings
from engine_shim._http import ApiError, json_response
from engine_shim._metrics import metrics_registry
from engine_shim.backend import DecodeBackend, PrefillBackend
from engine_shim.decode import DecodeWorker
from engine_shim.prefill import PrefillShim
from engine_shim.sim_engine import SimDecodeEngine, SimPrefillEngine
from engine_shim.sim_profile import get_profile
from engine_shim.wire import HEALTH_PATH, LOAD_PATH
from registry.base import InstanceRecord, InstanceState, Registry
from registry.heartbeat import Heartbeat

__all__ = ["MAX_BODY_BYTES", "ShimRuntime", "build_shim_app", "instance_record"]

log = logging.getLogger("pdgate.shim")

MAX_BODY_BYTES = 8 * 1024 * 1024
ENGINES = ("sim", "vllm")  # more plug in behind engine_shim.backend


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
    if settings.host in ("0.0.0.0", "::", ""):
        raise ValueError(
            f"shim host {settings.host!r} is not reachable by others; set advertise_url"
        )
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    return f"http://{host}:{settings.port}"


def instance_record(settings: ShimSettings) -> InstanceRecord:
    """What this shim registers: id, role, URL, model, group and capacity from `settings`."""
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
    )


def make_backend(settings: ShimSettings) -> PrefillBackend | DecodeBackend:
    if settings.engine not in ENGINES:
        raise ValueError(f"unknown engine {settings.engine!r}; available: {', '.join(ENGINES)}")
    if settings.engine == "vllm":
        try:
            # Imported here: vLLM is an optional extra (`make vllm`) and slow to import.
            from engine_shim.vllm_engine import make_vllm_backend
        except ImportError as exc:
            raise ValueError(f"engine vllm needs vLLM installed (make vllm): {exc}") from None
        return make_vllm_backend(settings)
    profile = get_profile(settings.sim_profile)
    if settings.role == Role.PREFILL:
        return SimPrefillEngine(
            profile, max_batch=settings.capacity, kv_wire_fraction=settings.sim_kv_wire_fraction
        )
    return SimDecodeEngine(profile, max_batch=settings.capacity)


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
    ) -> None:
        self.settings = settings
        self.service = service
        self.backend = backend
        self.record = record
        self._heartbeat = Heartbeat(
            registry,
            record,
            interval_s=registry_settings.heartbeat_interval_s,
            ttl_s=registry_settings.ttl_s,
        )
        self._session: aiohttp.ClientSession | None = None

    async def startup(self) -> None:
        await self.backend.start()
        if isinstance(self.service, DecodeWorker):
            # Few connections: the retrieval workers, plus DELETEs of abandoned KV.
            connector = aiohttp.TCPConnector(limit=2 * self.settings.kv_retrieval_workers + 4)
            self._session = aiohttp.ClientSession(connector=connector)
            self.service.start(self._session)
        await self._heartbeat.start()
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
            await self.service.aclose()
            await self.backend.aclose()
            if self._session is not None:
                await self._session.close()

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
) -> Starlette:
    """The ASGI app of one shim. `backend` replaces the engine named by ``settings.engine``."""
    record = instance_record(settings)
    if backend is None:
        backend = make_backend(settings)
    service: PrefillShim | DecodeWorker
    if settings.role == Role.PREFILL:
        if not isinstance(backend, PrefillBackend):
            raise TypeError("a prefill shim needs a PrefillBackend")
        service = PrefillShim(
            settings, backend, instance_id=record.id, url=record.url, max_body_bytes=max_body_bytes
        )
    else:
        if not isinstance(backend, DecodeBackend):
            raise TypeError("a decode worker needs a DecodeBackend")
        service = DecodeWorker(
            settings, backend, instance_id=record.id, max_body_bytes=max_body_bytes
        )
    runtime = ShimRuntime(settings, service, backend, registry, registry_settings, record)
    metrics = metrics_registry(service.load)

    async def health(request: Request) -> Response:
        if service.draining:
            return json_response({"status": "draining"}, status=503)
        return json_response({"status": "ok"})

    async def load(request: Request) -> Response:
        return json_response(service.load())

    async def prometheus(request: Request) -> Response:
        return Response(generate_latest(metrics), media_type=CONTENT_TYPE_LATEST)

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
            *service.routes(),
        ],
        lifespan=lifespan,
    )
    app.state.shim = runtime
    return app
