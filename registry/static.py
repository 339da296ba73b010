"""Instances given by URL instead of registering themselves: ``pdgate gateway --prefill URL
--decode URL`` (settings ``static_prefills``/``static_decodes``), e.g. stock ``vllm serve``,
and ``--aggregated URL`` (``static_aggregated``) for servers that serve whole requests.

`StaticRegistry` is a read-only `Registry` over those servers. A background task probes each
one every ``probe_interval_s`` (``GET /health`` and ``GET /v1/models``) with a
``probe_timeout_s`` bound; a server is listed once it has answered,
READY while it answers and DRAINING (no new requests, its open streams still counted) after
``down_after`` failed probes in a row, until it answers again. `MergedRegistry` shows it
together with the configured registry (Redis or in-memory), so `Membership` and the rest of
the gateway see one membership and need no change.

What the server serves is read from it: the model (the first ``GET /v1/models`` lists without
a ``parent``, unless the declaration names one), its ``max_model_len`` and the LoRA adapters
listed with it as ``parent`` (vLLM's shape), re-read at every probe so that adapters loaded
or unloaded at run time (vLLM's ``/v1/load_lora_adapter``) follow within a probe interval;
and the side endpoints it answers, from the paths of its ``GET /openapi.json`` (vLLM registers
the pooling routes only for a pooling model), read once per (re)connection. A Mooncake
prefill (``connector=mooncake``) is listed once its bootstrap server names its engines
(``GET {bootstrap}/query``, as vLLM's Mooncake proxy reads it), re-read at each
(re)connection: a decode is told the engine to pull from.

Ids are derived from role and URL (`static_instance_id`), so every gateway of a fleet names
a server alike and shares its slot leases, and a server that `pdgate announce` also registers
under its default id is counted once (the static declaration wins).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

import aiohttp
import orjson

from pdgate.config.aio import cancel_and_wait
from pdgate.config.settings import (
    STATIC_DECODE_CAPACITY,
    STATIC_PREFILL_CAPACITY,
    GatewaySettings,
    StaticInstance,
)
from pdgate.config.wire import (
    HEALTH_PATH,
    MAX_ADAPTERS,
    MAX_CONTEXT_TOKENS,
    MAX_KV_ENGINE_CHARS,
    MAX_KV_ENGINES,
    MAX_MODEL_NAME_CHARS,
    MODELS_PATH,
    OPENAPI_PATH,
    SIDE_ENDPOINTS,
    Role,
)
from pdgate.registry.base import (
    EventStream,
    InstanceRecord,
    InstanceState,
    Registry,
    RegistryError,
    RegistryEvent,
    RegistryUnavailable,
)
from pdgate.registry.memory import MemoryRegistry

__all__ = [
    "MergedRegistry",
    "ProbeError",
    "ServedModels",
    "StaticRegistry",
    "StockInstance",
    "check_health",
    "list_models",
    "read_endpoints",
    "read_kv_engines",
    "read_models",
    "served_model",
    "static_api_keys",
    "static_instance_id",
    "with_static_instances",
]

logger = logging.getLogger(__name__)

STATIC_VERSION = "static"  # InstanceRecord.version of static instances (shown by /admin)
_MAX_BODY_BYTES = 1 << 20  # a /v1/models answer; vLLM's is a few hundred bytes per model
# An /openapi.json answer: vLLM's is a few hundred KiB (its request schemas).
_MAX_OPENAPI_BYTES = 8 << 20
_OPENAPI_TIMEOUTS = 5  # probe timeouts reading it may take
# Mooncake's bootstrap server: GET /query (vLLM's MooncakeBootstrapServer.query).
BOOTSTRAP_QUERY_PATH = "/query"
_MAX_WARNED = 1024
_EVENT_QUEUE = 256


class ProbeError(Exception):
    """A server answered, but not as an OpenAI server should."""


def static_instance_id(role: Role, url: str) -> str:
    """``prefill@host:port[/path]``: the same on every gateway for the same declaration (the
    fleet shares slot leases by id) and `pdgate announce`'s default for the same server."""
    return f"{role.value}@{url.partition('://')[2] or url}"


async def _get(
    session: aiohttp.ClientSession,
    url: str,
    headers: Mapping[str, str],
    limit: int = _MAX_BODY_BYTES,
    timeout_s: float | None = None,
) -> tuple[int, bytes]:
    # The session's own timeout unless this call has one.
    timeout = session.timeout if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s)
    async with session.get(url, headers=headers, allow_redirects=False, timeout=timeout) as resp:
        # Read to the end: one read returns only what has arrived so far.
        chunks: list[bytes] = []
        size = 0
        async for chunk in resp.content.iter_chunked(1 << 16):
            size += len(chunk)
            if size > limit:
                raise ProbeError(f"GET {url}: answer larger than {limit} bytes")
            chunks.append(chunk)
        return resp.status, b"".join(chunks)


async def check_health(
    session: aiohttp.ClientSession, base_url: str, headers: Mapping[str, str]
) -> None:
    """Raise unless ``GET {base_url}/health`` answers 200 (aiohttp errors pass through)."""
    status, _ = await _get(session, base_url + HEALTH_PATH, headers)
    if status != 200:
        raise ProbeError(f"GET {HEALTH_PATH} answered HTTP {status}")


@dataclass(frozen=True, slots=True)
class ServedModels:
    """What a server's ``GET /v1/models`` lists: its models in order, each one's
    ``max_model_len`` where it says one, and the LoRA adapters listed with it as ``parent``
    (an adapter whose parent is not listed is left out: nothing could serve it)."""

    bases: tuple[str, ...]
    context: Mapping[str, int] = field(default_factory=dict)
    adapters: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        """Every name listed, models first."""
        return [*self.bases, *(a for b in self.bases for a in self.adapters.get(b, ()))]


def _name(raw: object) -> str | None:
    return raw if isinstance(raw, str) and 0 < len(raw) <= MAX_MODEL_NAME_CHARS else None


async def read_models(
    session: aiohttp.ClientSession, base_url: str, headers: Mapping[str, str]
) -> ServedModels:
    """``GET {base_url}/v1/models`` read (see `ServedModels`); entries that are not a model
    card are skipped, names beyond the record's bounds too. Raises `ProbeError` or aiohttp's
    errors."""
    status, body = await _get(session, base_url + MODELS_PATH, headers)
    if status != 200:
        raise ProbeError(f"GET {MODELS_PATH} answered HTTP {status}")
    try:
        data = orjson.loads(body)["data"]
        entries = [e for e in data if isinstance(e, dict)]
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise ProbeError(f"GET {MODELS_PATH}: not an OpenAI model list") from exc
    bases: list[str] = []
    context: dict[str, int] = {}
    for entry in entries:
        name = _name(entry.get("id"))
        if name is None or entry.get("parent") is not None or name in context:
            continue
        bases.append(name)
        length = entry.get("max_model_len")
        context[name] = length if type(length) is int and 0 < length <= MAX_CONTEXT_TOKENS else 0
    adapters: dict[str, list[str]] = {}
    for entry in entries:
        name, parent = _name(entry.get("id")), _name(entry.get("parent"))
        if name is None or parent not in context or name in context:
            continue
        listed = adapters.setdefault(parent, [])
        if name not in listed and len(listed) < MAX_ADAPTERS:
            listed.append(name)
    if not bases:
        raise ProbeError(f"GET {MODELS_PATH} lists no model")
    return ServedModels(tuple(bases), context, {b: tuple(a) for b, a in adapters.items()})


async def list_models(
    session: aiohttp.ClientSession, base_url: str, headers: Mapping[str, str]
) -> list[str]:
    """The models ``GET {base_url}/v1/models`` lists, base models first (vLLM lists LoRA
    adapters too, with a ``parent``). Raises `ProbeError` or aiohttp's errors."""
    return (await read_models(session, base_url, headers)).names


async def read_endpoints(
    session: aiohttp.ClientSession,
    base_url: str,
    headers: Mapping[str, str],
    timeout_s: float,
) -> tuple[str, ...]:
    """The side endpoints (config/wire.py ``SIDE_ENDPOINTS``) among the paths of
    ``GET {base_url}/openapi.json``, in that order. Raises `ProbeError` or aiohttp's
    errors."""
    status, body = await _get(
        session, base_url + OPENAPI_PATH, headers, _MAX_OPENAPI_BYTES, timeout_s
    )
    if status != 200:
        raise ProbeError(f"GET {OPENAPI_PATH} answered HTTP {status}")
    try:
        paths = orjson.loads(body)["paths"]
        if not isinstance(paths, dict):
            raise TypeError("paths is not an object")
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise ProbeError(f"GET {OPENAPI_PATH}: not an OpenAPI document") from exc
    return tuple(p for p in SIDE_ENDPOINTS if p in paths)


async def read_kv_engines(
    session: aiohttp.ClientSession, bootstrap: str, timeout_s: float
) -> tuple[str, ...]:
    """The engine ids a Mooncake prefill's bootstrap server lists, by data-parallel rank
    (``GET {bootstrap}/query``: ``{rank: {"engine_id": ..., "worker_addr": ...}}``, vLLM's
    ``MooncakeBootstrapServer.query``). None listed yet (its workers register as they
    start) is a `ProbeError`, as are ranks with gaps. The server's API key is not sent: the
    bootstrap server is another server, and takes none."""
    status, body = await _get(session, bootstrap + BOOTSTRAP_QUERY_PATH, {}, timeout_s=timeout_s)
    if status != 200:
        raise ProbeError(f"GET {bootstrap}{BOOTSTRAP_QUERY_PATH} answered HTTP {status}")
    try:
        data = orjson.loads(body)
        ranks = {int(rank): entry["engine_id"] for rank, entry in data.items()}
    except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ProbeError(f"GET {bootstrap}{BOOTSTRAP_QUERY_PATH}: not a bootstrap answer") from exc
    if not ranks or sorted(ranks) != list(range(len(ranks))) or len(ranks) > MAX_KV_ENGINES:
        raise ProbeError(f"{bootstrap}: no engines registered yet, or ranks {sorted(ranks)[:8]}")
    engines = tuple(ranks[r] for r in range(len(ranks)))
    if any(not (isinstance(e, str) and 0 < len(e) <= MAX_KV_ENGINE_CHARS) for e in engines):
        raise ProbeError(f"{bootstrap}: an engine id is not a string of 1-128 characters")
    return engines


def static_api_keys(
    settings: GatewaySettings, environ: Mapping[str, str] = os.environ
) -> dict[str, str]:
    """URL -> API key of each static instance that names one (``api_key_env``), read from the
    environment once, at start-up. Raises `ValueError` naming the variable (never a value)
    when it is unset or empty, so a typo fails the start rather than every request."""
    keys: dict[str, str] = {}
    for spec in (*settings.static_prefills, *settings.static_decodes, *settings.static_aggregated):
        if spec.api_key_env is None:
            continue
        key = environ.get(spec.api_key_env, "").strip()
        if not key:
            raise ValueError(
                f"static instance {spec.url}: api_key_env={spec.api_key_env}, but that "
                "environment variable is not set"
            )
        if keys.setdefault(spec.url, key) != key:
            raise ValueError(f"static instance {spec.url} is given two different API keys")
    return keys


@dataclass(slots=True)
class StockInstance:
    """A server that does not register itself (stock vLLM), as pdgate lists it, whether a
    gateway declares it (static) or a `pdgate announce` sidecar does: the id and capacity
    its declaration names, else its URL's id and its role's default capacity."""

    role: Role
    spec: StaticInstance
    headers: Mapping[str, str]  # with the probes: the bearer token this server expects

    @property
    def id(self) -> str:
        return self.spec.id or static_instance_id(self.role, self.spec.url)

    @property
    def capacity(self) -> int:
        default = STATIC_PREFILL_CAPACITY if self.role is Role.PREFILL else STATIC_DECODE_CAPACITY
        return self.spec.capacity or default

    def ready_record(
        self,
        model: str,
        version: str,
        started_at: float | None = None,
        *,
        served: ServedModels | None = None,
        endpoints: tuple[str, ...] = (),
        kv_engines: tuple[str, ...] = (),
    ) -> InstanceRecord:
        """Its record, ready and serving `model` (started now unless `started_at`), with
        what `served` says of the model, the side `endpoints` it answers, its connector and
        (Mooncake) the `kv_engines` its bootstrap server lists."""
        return InstanceRecord(
            id=self.id,
            role=self.role,
            url=self.spec.url,
            model=model,
            group=self.spec.group,
            capacity=self.capacity,
            state=InstanceState.READY,
            version=version,
            started_at=time.time() if started_at is None else started_at,
            hardware=self.spec.hardware,
            kv_events=self.spec.kv_events,
            max_model_len=served.context.get(model, 0) if served is not None else 0,
            adapters=served.adapters.get(model, ()) if served is not None else (),
            endpoints=endpoints,
            connector=self.spec.connector.value if self.spec.connector else "",
            kv_bootstrap=self.spec.kv_bootstrap,
            kv_engines=kv_engines,
        )

    @property
    def bootstrap(self) -> str:
        """Where its KV engines are listed ("": it needs none listed): a Mooncake prefill's
        bootstrap server (a decode pulls; only a prefill's is asked)."""
        return self.spec.kv_bootstrap if self.role is Role.PREFILL else ""


async def served_kv_engines(
    session: aiohttp.ClientSession, server: StockInstance, timeout_s: float
) -> tuple[str, ...]:
    """The KV engines `server`'s bootstrap server lists (`read_kv_engines`); none for a
    server that has no bootstrap server. Raises as `read_kv_engines` does: a Mooncake
    prefill is not listed before its decodes can be told whom to pull from."""
    if not server.bootstrap:
        return ()
    return await read_kv_engines(session, server.bootstrap, timeout_s)


@dataclass(slots=True)
class _Target(StockInstance):
    """A static instance with its prober's state."""

    record: InstanceRecord | None = None  # what is published (None: never answered yet)
    failures: int = 0  # failed probes in a row
    learn: bool = True  # read GET /v1/models at the next answer (first, or after a failure)
    warned: bool = False  # "not answering" logged for the current outage

    @property
    def name(self) -> str:
        return f"static {self.role.value} {self.spec.url}"


async def served_model(
    session: aiohttp.ClientSession, server: StockInstance, name: str
) -> tuple[str, ServedModels | None]:
    """The model to register `server` under (the one its declaration names, else the first
    the server lists), with what the server lists (None: it could not be read).
    A named model stands even when the server's list cannot be read (logged) or lacks it
    (a warning); with none named, a failed list raises (`ProbeError`, aiohttp's errors)."""
    given = server.spec.model
    try:
        served = await read_models(session, server.spec.url, server.headers)
    except (ProbeError, aiohttp.ClientError) as exc:
        if given is None:
            raise
        logger.info("%s: %s; using the given model %r", name, _describe(exc), given)
        return given, None
    if given is None:
        return served.bases[0], served
    names = served.names
    if given not in names:
        logger.warning(
            "%s: model %r given, but the server lists %s: requests for %r will fail there",
            name,
            given,
            names[:8],
            given,
        )
    return given, served


async def reread_models(
    session: aiohttp.ClientSession, server: StockInstance
) -> ServedModels | None:
    """What the server lists now, re-read at a probe (None: not readable now; the caller
    keeps what it knew, and the probe of /health decides whether the server is up)."""
    try:
        return await read_models(session, server.spec.url, server.headers)
    except (ProbeError, aiohttp.ClientError, UnicodeError):
        return None


async def served_endpoints(
    session: aiohttp.ClientSession, server: StockInstance, name: str, probe_timeout_s: float
) -> tuple[str, ...]:
    """The side endpoints `server` answers (`read_endpoints`, within a few probe timeouts:
    a server renders its document on first ask); none when its OpenAPI document cannot be
    read (logged: its side endpoints are then not used)."""
    timeout_s = _OPENAPI_TIMEOUTS * probe_timeout_s
    try:
        return await read_endpoints(session, server.spec.url, server.headers, timeout_s)
    except (ProbeError, aiohttp.ClientError, TimeoutError, UnicodeError) as exc:
        logger.info("%s: no side endpoints (%s)", name, _describe(exc))
        return ()


class StaticRegistry:
    """Read-only `Registry` of servers given by URL; see the module docstring."""

    def __init__(
        self,
        prefills: Sequence[StaticInstance] = (),
        decodes: Sequence[StaticInstance] = (),
        aggregated: Sequence[StaticInstance] = (),
        *,
        probe_interval_s: float = 2.0,
        probe_timeout_s: float = 1.0,
        down_after: int = 2,
        headers: Mapping[str, str] | None = None,
        api_keys: Mapping[str, str] | None = None,
    ) -> None:
        """`headers` go with every probe; `api_keys` (URL -> key, `static_api_keys`) replace
        their bearer token for the servers that have their own."""
        if probe_interval_s <= 0 or probe_timeout_s <= 0 or down_after < 1:
            raise ValueError("probe interval and timeout must be positive, down_after >= 1")
        common = dict(headers or {})
        keys = dict(api_keys or {})
        self._targets: list[_Target] = []
        for role, specs in (
            (Role.PREFILL, prefills),
            (Role.DECODE, decodes),
            (Role.AGGREGATED, aggregated),
        ):
            for spec in specs:
                self._targets.append(
                    _Target(
                        role,
                        spec,
                        {**common, "authorization": f"Bearer {keys[spec.url]}"}
                        if spec.url in keys
                        else common,
                    )
                )
        ids = [t.id for t in self._targets]
        if len(set(ids)) != len(ids):
            raise ValueError(f"static instances with the same id: {sorted(ids)}")
        self._interval_s = probe_interval_s
        self._timeout_s = probe_timeout_s
        self._down_after = down_after
        # Refreshed every round: if the prober ever died, its records would expire rather
        # than stay READY forever.
        self._ttl_s = 3 * (probe_interval_s + probe_timeout_s)
        self._store = MemoryRegistry(max_instances=max(1, len(self._targets)))
        self._first_round = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"StaticRegistry({len(self._targets)} instances)"

    @property
    def ids(self) -> frozenset[str]:
        return frozenset(t.id for t in self._targets)

    # --- Registry ---------------------------------------------------------------------

    async def put(self, record: InstanceRecord, ttl_s: float, *, announce: bool = False) -> None:
        raise RegistryError("static instances are read-only (they come from the settings)")

    async def remove(self, instance_id: str) -> None:
        raise RegistryError("static instances are read-only (they come from the settings)")

    async def snapshot(self) -> list[InstanceRecord]:
        if self._closed:
            raise RegistryUnavailable("static instances: closed")
        self._start()
        if not self._first_round.is_set():
            # At start-up, wait for the first round, so servers that answer are in the first
            # view; a dead one holds start-up no longer than one probe timeout.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._timeout_s + 0.5):
                    await self._first_round.wait()
        return await self._store.snapshot()

    def generation(self) -> str | None:
        return None  # the settings' instances: nothing to lose

    def events(self) -> AsyncIterator[RegistryEvent]:
        self._start()
        return self._store.events()

    async def aclose(self) -> None:
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait([task])
        if self._session is not None:
            await self._session.close()
        await self._store.aclose()

    # --- probing ----------------------------------------------------------------------

    def _start(self) -> None:
        if self._task is None and not self._closed and self._targets:
            self._task = asyncio.create_task(self._run(), name="static-instances:probe")
        elif not self._targets:
            self._first_round.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        # Bounded: one connection per server at most (a round never overlaps the next).
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=len(self._targets), force_close=True),
            timeout=aiohttp.ClientTimeout(total=self._timeout_s),
        )
        while True:
            started = loop.time()
            await asyncio.gather(*(self._probe(t) for t in self._targets))
            self._first_round.set()
            await asyncio.sleep(max(0.0, started + self._interval_s - loop.time()))

    async def _probe(self, target: _Target) -> None:
        session = self._session
        assert session is not None
        model: str | None = None
        served: ServedModels | None = None
        endpoints: tuple[str, ...] | None = None
        engines: tuple[str, ...] | None = None
        learn = target.learn or target.record is None
        try:
            async with asyncio.timeout(self._timeout_s):
                await check_health(session, target.spec.url, target.headers)
                if learn:
                    model, served = await served_model(session, target, target.name)
                    # Its engine ids change only with a restart, as its routes do.
                    engines = await served_kv_engines(session, target, self._timeout_s)
                else:
                    served = await reread_models(session, target)
            if learn:  # its routes change only with a restart: once per (re)connection
                endpoints = await served_endpoints(session, target, target.name, self._timeout_s)
        except Exception as exc:  # the prober must outlive anything a server answers
            await self._failed(target, _describe(exc))
            return
        await self._answered(target, model, served, endpoints, engines)

    async def _answered(
        self,
        target: _Target,
        model: str | None,
        served: ServedModels | None,
        endpoints: tuple[str, ...] | None,
        engines: tuple[str, ...] | None = None,
    ) -> None:
        """`model`, `served`, `endpoints`, `engines`: None where this probe did not learn
        them (the record keeps what it had)."""
        old = target.record
        model = model or (old.model if old is not None else None)
        assert model is not None  # learned when there was no record
        record = target.ready_record(
            model,
            STATIC_VERSION,
            started_at=old.started_at if old is not None else None,
            served=served,
            endpoints=old.endpoints if endpoints is None and old is not None else endpoints or (),
            kv_engines=old.kv_engines if engines is None and old is not None else engines or (),
        )
        if served is None and old is not None:
            record = replace(record, max_model_len=old.max_model_len, adapters=old.adapters)
        changed = record != old
        if changed:
            logger.info(
                "%s is up: model %r (max_model_len %s, %d adapters), %d %s",
                target.name,
                model,
                record.max_model_len or "unknown",
                len(record.adapters),
                target.capacity,
                "slots" if target.role is Role.PREFILL else "running sequences",
            )
        target.record, target.failures, target.learn, target.warned = record, 0, False, False
        await self._store.put(record, self._ttl_s, announce=changed)

    async def _failed(self, target: _Target, reason: str) -> None:
        target.failures += 1
        target.learn = True  # it may come back restarted, serving another model
        record = target.record
        if record is None:
            if not target.warned:  # once per outage, not every round
                target.warned = True
                logger.warning("%s is not ready (%s); listed once it is", target.name, reason)
            return
        announce = False
        if target.failures >= self._down_after and record.state is InstanceState.READY:
            record = target.record = record.with_state(InstanceState.DRAINING)
            announce = True
            logger.warning(
                "%s failed %d probes in a row (%s): draining until it answers",
                target.name,
                target.failures,
                reason,
            )
        await self._store.put(record, self._ttl_s, announce=announce)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__


class _MergedStream:
    """Events of several streams as one; ends (or raises) as soon as any source does, so the
    consumer re-subscribes and re-polls, as it would for one registry."""

    def __init__(
        self, sources: Sequence[AsyncIterator[RegistryEvent]], hidden: frozenset[str]
    ) -> None:
        self._sources = list(sources)
        self._hidden = hidden  # ids the static declarations own: the other source's are dropped
        self._queue: asyncio.Queue[RegistryEvent | Exception | None] = asyncio.Queue(_EVENT_QUEUE)
        self._tasks: list[asyncio.Task[None]] = []
        self._ended = False

    def __aiter__(self) -> _MergedStream:
        return self

    async def wait_subscribed(self) -> None:
        for source in self._sources:
            if isinstance(source, EventStream):
                await source.wait_subscribed()

    async def __anext__(self) -> RegistryEvent:
        if self._ended:
            raise StopAsyncIteration
        if not self._tasks:
            self._tasks = [
                asyncio.create_task(self._pump(source, filtered=i > 0))
                for i, source in enumerate(self._sources)
            ]
        item = await self._queue.get()
        if item is None or isinstance(item, Exception):
            self._ended = True
            if item is None:
                raise StopAsyncIteration
            raise item
        return item

    async def _pump(self, source: AsyncIterator[RegistryEvent], *, filtered: bool) -> None:
        try:
            async for event in source:
                if filtered and event.instance_id in self._hidden:
                    continue
                await self._queue.put(event)
        except Exception as exc:
            await self._queue.put(exc)
        else:
            await self._queue.put(None)

    async def aclose(self) -> None:
        self._ended = True
        await cancel_and_wait(self._tasks)
        for source in self._sources:
            close = getattr(source, "aclose", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    await close()


class MergedRegistry:
    """The configured `registry` (it takes every write) plus the read-only static instances.

    A snapshot is both; when the registry cannot be reached the snapshot fails as it would
    without static instances (`Membership` keeps its last view, static instances included).
    A registered record with a static instance's id is ignored: the declaration wins.
    """

    def __init__(self, registry: Registry, static: StaticRegistry) -> None:
        self._registry = registry
        self._static = static
        self._warned: set[str] = set()

    def __repr__(self) -> str:
        return f"MergedRegistry({self._registry!r}, {self._static!r})"

    @property
    def inner(self) -> Registry:
        return self._registry

    async def put(self, record: InstanceRecord, ttl_s: float, *, announce: bool = False) -> None:
        await self._registry.put(record, ttl_s, announce=announce)

    async def remove(self, instance_id: str) -> None:
        await self._registry.remove(instance_id)

    async def snapshot(self) -> list[InstanceRecord]:
        static = await self._static.snapshot()
        hidden = self._static.ids
        merged = list(static)
        for record in await self._registry.snapshot():
            if record.id not in hidden:
                merged.append(record)
            elif record.id not in self._warned:
                if len(self._warned) >= _MAX_WARNED:
                    self._warned.clear()
                self._warned.add(record.id)
                logger.warning(
                    "registered instance %r has the id of a static one; the static "
                    "declaration is used",
                    record.id[:128],
                )
        return merged

    def generation(self) -> str | None:
        return self._registry.generation()  # the static part has nothing to lose

    def events(self) -> _MergedStream:
        return _MergedStream([self._static.events(), self._registry.events()], self._static.ids)

    async def aclose(self) -> None:
        try:
            await self._static.aclose()
        finally:
            await self._registry.aclose()


def with_static_instances(
    registry: Registry, settings: GatewaySettings, *, headers: Mapping[str, str] | None = None
) -> Registry:
    """`registry`, plus the static instances `settings` declare (if any). `headers` go with
    the probes (the upstream bearer token: stock vLLM with ``--api-key`` guards /v1/models),
    except that a server with its own ``api_key_env`` gets its own key."""
    if not (settings.static_prefills or settings.static_decodes or settings.static_aggregated):
        return registry
    static = StaticRegistry(
        settings.static_prefills,
        settings.static_decodes,
        settings.static_aggregated,
        probe_interval_s=settings.static_probe_interval_s,
        probe_timeout_s=settings.static_probe_timeout_s,
        down_after=settings.static_down_after,
        headers=headers,
        api_keys=static_api_keys(settings),
    )
    return MergedRegistry(registry, static)
