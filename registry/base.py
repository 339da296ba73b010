"""The membership seam: one Protocol, two implementations (in-memory, Redis).

A `Registry` stores `InstanceRecord`s with a time-to-live. Instances keep their record alive
with a `Heartbeat` (registry/heartbeat.py); gateways follow membership with a `Membership`
(registry/membership.py), which polls `snapshot()` as the source of truth and reacts at once
to `events()` (join/leave notifications, best effort).
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from typing import Any, Protocol, Self, runtime_checkable

import orjson

from pdgate.config import Role
from pdgate.config.kv_events import connectable_endpoint
from pdgate.config.wire import (
    CONNECTOR_PATTERN,
    HARDWARE_PATTERN,
    MAX_ADAPTERS,
    MAX_BOOTSTRAP_CHARS,
    MAX_CONTEXT_TOKENS,
    MAX_ENDPOINT_CHARS,
    MAX_ENDPOINTS,
    MAX_EXTENSION_CHARS,
    MAX_EXTENSIONS,
    MAX_KV_ENGINE_CHARS,
    MAX_KV_ENGINES,
    MAX_MODEL_NAME_CHARS,
    record_connector,
)


class InstanceState(StrEnum):
    READY = "ready"
    DRAINING = "draining"  # finishing what it has; receives no new requests


_HARDWARE = re.compile(HARDWARE_PATTERN)
_CONNECTOR = re.compile(CONNECTOR_PATTERN)


@dataclass(frozen=True, slots=True)
class InstanceRecord:
    id: str
    role: Role
    url: str  # base URL, e.g. http://10.0.0.5:8100 (no trailing slash)
    model: str
    group: str = "default"
    capacity: int = 1
    state: InstanceState = InstanceState.READY
    version: str = ""
    started_at: float = field(default_factory=time.time)
    # pdgate extensions the instance speaks (config/wire.py EXT_*); empty for stock servers.
    extensions: tuple[str, ...] = ()
    # What it runs on, GPU[/tpN][/ppN] (engine_shim/hardware.py), as declared; "" unknown.
    hardware: str = ""
    # Where it publishes its KV-cache events (vLLM's ZMQ PUB, config/kv_events.py), as
    # tcp://host:port or ipc://path; "" when it publishes none.
    kv_events: str = ""
    # What the engine reports of its model (its GET /v1/models, or a shim's own engine):
    # prompt + max_tokens limit (0 unknown), and the LoRA adapters it serves on top of
    # `model`, by their served names.
    max_model_len: int = 0
    adapters: tuple[str, ...] = ()
    # The side endpoints (config/wire.py SIDE_ENDPOINTS) it answers, by path.
    endpoints: tuple[str, ...] = ()
    # The KV connector its engine runs (config/wire.py KvConnector), as declared or as a
    # shim says; "" none named (`kv_connector` says what that means).
    connector: str = ""
    # Mooncake: the prefill's bootstrap server (http://host:port) and the engine ids it
    # lists, one per data-parallel rank, that a decode is told to pull from.
    kv_bootstrap: str = ""
    kv_engines: tuple[str, ...] = ()
    # HMAC of the other fields with the fleet's cluster token (registry/signing.py).
    signature: str = ""

    def with_state(self, state: InstanceState) -> InstanceRecord:
        return replace(self, state=state)

    @property
    def kv_connector(self) -> str:
        """The connector it speaks (config/wire.py `record_connector`)."""
        return record_connector(self.connector, self.extensions)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> Self:
        """Parse a record; raises ValueError (bad JSON or field), KeyError or TypeError."""
        data = orjson.loads(raw)
        if not isinstance(data, dict):
            raise TypeError(f"record must be a JSON object, not {type(data).__name__}")
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        return cls(
            id=str(data["id"]),
            role=Role(data["role"]),
            url=str(data["url"]).rstrip("/"),
            model=str(data["model"]),
            group=str(data.get("group", "default")),
            capacity=int(data.get("capacity", 1)),
            state=InstanceState(data.get("state", InstanceState.READY)),
            version=str(data.get("version", "")),
            started_at=float(data.get("started_at", 0.0)),
            extensions=_extensions(data.get("extensions", ())),
            hardware=hardware_name(data.get("hardware", "")),
            kv_events=connectable_endpoint(data.get("kv_events", "")),
            max_model_len=context_tokens(data.get("max_model_len", 0)),
            adapters=adapter_names(data.get("adapters", ())),
            endpoints=endpoint_paths(data.get("endpoints", ())),
            connector=connector_name(data.get("connector", "")),
            kv_bootstrap=bootstrap_url(data.get("kv_bootstrap", "")),
            kv_engines=engine_ids(data.get("kv_engines", ())),
            signature=str(data.get("signature", "")),
        )


def hardware_name(raw: object) -> str:
    """A declared hardware type: at most 64 of a-z, 0-9 and ``/._-`` ("" for none)."""
    if not isinstance(raw, str) or not _HARDWARE.fullmatch(raw):
        raise ValueError("hardware must be at most 64 of a-z, 0-9 and /._- (e.g. l40s/tp2)")
    return raw


def context_tokens(raw: object) -> int:
    """A model's ``max_model_len`` as an engine reports it (0: unknown)."""
    if type(raw) is not int or not 0 <= raw <= MAX_CONTEXT_TOKENS:
        raise ValueError(f"max_model_len must be an integer in [0, {MAX_CONTEXT_TOKENS}]")
    return raw


def adapter_names(raw: object) -> tuple[str, ...]:
    """LoRA adapters' served names: at most `MAX_ADAPTERS`, each 1 to
    `MAX_MODEL_NAME_CHARS` characters (a name listed twice counts once)."""
    return tuple(dict.fromkeys(_names(raw, "adapters", MAX_ADAPTERS, MAX_MODEL_NAME_CHARS)))


def endpoint_paths(raw: object) -> tuple[str, ...]:
    """Side endpoints' paths: at most `MAX_ENDPOINTS`, each ``/...`` of at most
    `MAX_ENDPOINT_CHARS` characters."""
    paths = _names(raw, "endpoints", MAX_ENDPOINTS, MAX_ENDPOINT_CHARS)
    if any(not p.startswith("/") for p in paths):
        raise ValueError("an endpoint is a path starting with /")
    return paths


def connector_name(raw: object) -> str:
    """A KV connector's name: at most 32 of a-z, 0-9 and ``_`` ("" none named). Names this
    version does not know are kept: such an instance pairs only with its own kind."""
    if not isinstance(raw, str) or not _CONNECTOR.fullmatch(raw):
        raise ValueError("connector must be at most 32 of a-z, 0-9 and _ (e.g. nixl)")
    return raw


def bootstrap_url(raw: object) -> str:
    """A Mooncake bootstrap server's base URL, ``http://host:port`` ("" none)."""
    if not isinstance(raw, str) or len(raw) > MAX_BOOTSTRAP_CHARS:
        raise ValueError(f"kv_bootstrap must be a URL of at most {MAX_BOOTSTRAP_CHARS} chars")
    if raw and (not raw.startswith(("http://", "https://")) or not raw.isprintable()):
        raise ValueError("kv_bootstrap must be http://host:port")
    return raw


def engine_ids(raw: object) -> tuple[str, ...]:
    """A prefill's KV engine ids, one per data-parallel rank: at most `MAX_KV_ENGINES`, each
    1 to `MAX_KV_ENGINE_CHARS` printable characters."""
    ids = _names(raw, "kv_engines", MAX_KV_ENGINES, MAX_KV_ENGINE_CHARS)
    if any(not i.isprintable() for i in ids):
        raise ValueError("each of kv_engines is printable")
    return ids


def _names(raw: object, what: str, count: int, chars: int) -> tuple[str, ...]:
    if not isinstance(raw, list | tuple) or len(raw) > count:
        raise ValueError(f"{what} must be a list of at most {count} names")
    if any(not isinstance(x, str) or not 0 < len(x) <= chars for x in raw):
        raise ValueError(f"each of {what} is a string of 1 to {chars} characters")
    return tuple(raw)


def _extensions(raw: object) -> tuple[str, ...]:
    if not isinstance(raw, list | tuple) or len(raw) > MAX_EXTENSIONS:
        raise ValueError(f"extensions must be a list of at most {MAX_EXTENSIONS} names")
    names = tuple(str(x) for x in raw)
    if any(not 0 < len(n) <= MAX_EXTENSION_CHARS for n in names):
        raise ValueError(f"an extension name has 1 to {MAX_EXTENSION_CHARS} characters")
    return names


class EventKind(StrEnum):
    JOIN = "join"  # new record, or a changed one (state, capacity)
    LEAVE = "leave"  # deregistered cleanly


@dataclass(frozen=True, slots=True)
class RegistryEvent:
    kind: EventKind
    instance_id: str
    record: InstanceRecord | None = None  # present for JOIN


class RegistryError(Exception):
    """Base of registry failures."""


class RegistryUnavailable(RegistryError):
    """The backing store cannot be reached; callers keep their last known view."""


class RegistryAuthError(RegistryUnavailable):
    """The backing store refused this process's credentials (no or a wrong password or ACL
    user, a missing TLS certificate). At start-up it is fatal: a configuration error must
    be loud, not a process that serves while nobody can see it."""

    user_facing = True  # the CLI prints it as one line and exits 2


def is_auth_failure(exc: BaseException) -> bool:
    """Whether a Redis/socket error means "bad credentials" rather than "unreachable"."""
    from redis.exceptions import AuthenticationError, AuthorizationError, ResponseError

    if isinstance(exc, AuthenticationError | AuthorizationError):
        return True
    text = str(exc)
    return isinstance(exc, ResponseError) and any(
        code in text for code in ("NOAUTH", "WRONGPASS", "NOPERM")
    )


@runtime_checkable
class EventStream(Protocol):
    """What the built-in registries' `events()` return: an async iterator that can also be
    awaited until its subscription is live. A consumer that re-polls after (re)subscribing
    waits for that first, so nothing published in between is missed."""

    def __aiter__(self) -> EventStream: ...

    async def __anext__(self) -> RegistryEvent: ...

    async def wait_subscribed(self) -> None:
        """Raises `RegistryUnavailable`."""
        ...

    async def aclose(self) -> None: ...


class Registry(Protocol):
    async def put(self, record: InstanceRecord, ttl_s: float, *, announce: bool = False) -> None:
        """Write or refresh `record`, expiring `ttl_s` after this call.

        With ``announce`` a JOIN event is published (first registration, state change).
        Raises `RegistryUnavailable`.
        """
        ...

    async def remove(self, instance_id: str) -> None:
        """Delete the record now and publish LEAVE. Raises `RegistryUnavailable`."""
        ...

    async def snapshot(self) -> list[InstanceRecord]:
        """All live (unexpired) records. Raises `RegistryUnavailable`."""
        ...

    def generation(self) -> str | None:
        """The store's contents as of the last `snapshot()`, named: a new name means it lost
        its state in between (a Redis restarted empty, a replica promoted before it had the
        records), which is not every instance leaving. None: a store that cannot tell."""
        ...

    def events(self) -> AsyncIterator[RegistryEvent]:
        """Join/leave notifications from now on. Best effort: may end or raise
        `RegistryUnavailable`; the caller re-subscribes and re-polls."""
        ...

    async def aclose(self) -> None: ...
