"""Instance membership: who is up, where, in which state (see registry/base.py)."""

from __future__ import annotations

from urllib.parse import urlsplit

from pdgate.config import RegistrySettings
from pdgate.registry._redis_url import SENTINEL_SCHEMES
from pdgate.registry.base import (
    EventKind,
    EventStream,
    InstanceRecord,
    InstanceState,
    Registry,
    RegistryAuthError,
    RegistryError,
    RegistryEvent,
    RegistryUnavailable,
)
from pdgate.registry.heartbeat import Heartbeat
from pdgate.registry.membership import Listener, Membership
from pdgate.registry.memory import MemoryRegistry
from pdgate.registry.redis import RedisRegistry, redact_url
from pdgate.registry.signing import RecordSigner, SigningRegistry

_REDIS_SCHEMES = frozenset({"redis", "rediss", "unix", *SENTINEL_SCHEMES})


def open_registry(settings: RegistrySettings) -> Registry:
    """The registry `settings` describe: in-memory without a URL, else Redis.

    Nothing is connected yet: the first call on the result does that (and may raise
    `RegistryUnavailable`), so a process can start while Redis is still coming up.
    """
    registry = _open(settings)
    if settings.cluster_token is not None:
        # Records are signed and checked: Redis write access alone adds no instance.
        return SigningRegistry(registry, RecordSigner(settings.cluster_token.get_secret_value()))
    return registry


async def check_access(registry: Registry) -> None:
    """Fail at once (`RegistryAuthError`) if the registry refuses our credentials; an
    unreachable registry is fine here (processes start while Redis is still coming up)."""
    try:
        await registry.snapshot()
    except RegistryAuthError:
        raise
    except RegistryUnavailable:
        pass


def _open(settings: RegistrySettings) -> Registry:
    if not settings.url:  # an empty PDGATE_REGISTRY_URL means unset too
        return MemoryRegistry(max_instances=settings.max_instances)
    scheme = urlsplit(settings.url).scheme.lower()
    if scheme not in _REDIS_SCHEMES:
        raise ValueError(
            f"registry url {redact_url(settings.url)!r}: unsupported scheme {scheme!r}; "
            "expected redis://, rediss://, unix://, redis+sentinel:// or rediss+sentinel:// "
            "(or no url for the in-memory registry)"
        )
    try:
        return RedisRegistry(
            settings.url,
            key_prefix=settings.key_prefix,
            max_instances=settings.max_instances,
            connect_timeout_s=settings.connect_timeout_s,
        )
    except ValueError as exc:  # a malformed URL: say which setting, without the password
        raise ValueError(f"registry url {redact_url(settings.url)!r}: {exc}") from exc


__all__ = [
    "EventKind",
    "EventStream",
    "Heartbeat",
    "InstanceRecord",
    "InstanceState",
    "Listener",
    "Membership",
    "MemoryRegistry",
    "RedisRegistry",
    "Registry",
    "RegistryAuthError",
    "RegistryError",
    "RegistryEvent",
    "RegistryUnavailable",
    "SigningRegistry",
    "check_access",
    "open_registry",
    "redact_url",
]
