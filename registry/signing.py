"""Signed registry records: write access to Redis alone must not let anyone add an instance.

Without signatures, whoever can write a key under the registry's prefix can announce an
"instance" and receive other clients' prompts. With the fleet's cluster token configured,
every record is signed (HMAC-SHA256 over its canonical JSON) by the process that writes it,
and every reader drops records whose signature does not verify. `SigningRegistry` wraps any
`Registry`, so heartbeats, membership and the announce sidecar need no change.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, replace

import orjson

from pdgate.registry.base import EventStream, InstanceRecord, Registry, RegistryEvent

__all__ = ["RecordSigner", "SigningRegistry"]

logger = logging.getLogger(__name__)

_MAX_WARNED = 1024
# Fields added after v1 enter the signed form only when set, so records written before they
# existed still verify (and every field a record carries is signed).
_LATER = (
    "extensions",
    "hardware",
    "kv_events",
    "max_model_len",
    "adapters",
    "endpoints",
    "connector",
    "kv_bootstrap",
    "kv_engines",
)


class RecordSigner:
    def __init__(self, key: str) -> None:
        if not key:
            raise ValueError("the signing key must not be empty")
        # A derived key: the cluster token also authenticates HTTP calls, and one secret
        # should not be used raw for two purposes.
        self._key = hmac.new(key.encode(), b"pdgate registry record v1", hashlib.sha256).digest()

    def _mac(self, record: InstanceRecord) -> str:
        fields = asdict(record)
        fields.pop("signature", None)
        for later in _LATER:
            if not fields[later]:
                del fields[later]
        payload = orjson.dumps(fields, option=orjson.OPT_SORT_KEYS)
        return hmac.new(self._key, payload, hashlib.sha256).hexdigest()

    def sign(self, record: InstanceRecord) -> InstanceRecord:
        return replace(record, signature=self._mac(record))

    def verify(self, record: InstanceRecord) -> bool:
        return bool(record.signature) and hmac.compare_digest(record.signature, self._mac(record))


class _SignedStream:
    """The inner event stream, minus events whose record does not verify (the subscription
    handshake of an `EventStream` is passed through)."""

    def __init__(
        self, inner: AsyncIterator[RegistryEvent], trusted: Callable[[InstanceRecord], bool]
    ) -> None:
        self._inner = inner
        self._trusted = trusted

    def __aiter__(self) -> _SignedStream:
        return self

    async def __anext__(self) -> RegistryEvent:
        while True:
            event = await self._inner.__anext__()
            if event.record is None or self._trusted(event.record):
                return event

    async def wait_subscribed(self) -> None:
        if isinstance(self._inner, EventStream):
            await self._inner.wait_subscribed()

    async def aclose(self) -> None:
        close = getattr(self._inner, "aclose", None)
        if close is not None:
            await close()


class SigningRegistry:
    """A `Registry` whose writes are signed and whose reads drop what does not verify."""

    def __init__(self, inner: Registry, signer: RecordSigner) -> None:
        self._inner = inner
        self._signer = signer
        self._warned: set[str] = set()

    def __repr__(self) -> str:
        return f"SigningRegistry({self._inner!r})"

    @property
    def inner(self) -> Registry:
        return self._inner

    async def put(self, record: InstanceRecord, ttl_s: float, *, announce: bool = False) -> None:
        await self._inner.put(self._signer.sign(record), ttl_s, announce=announce)

    async def remove(self, instance_id: str) -> None:
        await self._inner.remove(instance_id)

    async def snapshot(self) -> list[InstanceRecord]:
        return [r for r in await self._inner.snapshot() if self._trusted(r)]

    def generation(self) -> str | None:
        return self._inner.generation()

    def events(self) -> _SignedStream:
        return _SignedStream(self._inner.events(), self._trusted)

    async def aclose(self) -> None:
        await self._inner.aclose()

    def _trusted(self, record: InstanceRecord) -> bool:
        if self._signer.verify(record):
            self._warned.discard(record.id)
            return True
        if record.id not in self._warned:
            if len(self._warned) >= _MAX_WARNED:
                self._warned.clear()
            self._warned.add(record.id)
            logger.warning(
                "ignoring registry record %r: its signature does not match the cluster token",
                record.id[:128],
            )
        return False
