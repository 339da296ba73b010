"""Shared registry on Redis, for several gateways and instances on several hosts.

Layout under ``{prefix}``:

- ``{prefix}:instance:{id}``: the record as JSON, written with ``SET PX ttl``. Liveness is
  the key's server-side expiry alone, so writers' and readers' clocks never have to agree.
- ``{prefix}:members``: ZSET id -> writer's expiry (ms). Only an index, to list ids without
  SCAN; stale entries are pruned lazily by readers.
- ``{prefix}:events``: pub/sub channel of ``{"kind": "join"|"leave", "id": ..., "record": ...}``.
- ``{prefix}:generation``: a random name of the store's contents, written by the first reader
  that finds none. A new one means Redis lost its state (restarted empty, a replica promoted
  before it had the records): readers then keep what they knew (registry/membership.py).

Every Redis/socket failure leaves this module as `RegistryUnavailable`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import time
from collections.abc import Callable
from typing import Any

import orjson
from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.exceptions import RedisError

from pdgate.registry._redis_url import open_clients
from pdgate.registry.base import (
    EventKind,
    InstanceRecord,
    RegistryAuthError,
    RegistryEvent,
    RegistryUnavailable,
    is_auth_failure,
)

logger = logging.getLogger(__name__)

_ERRORS = (RedisError, OSError, asyncio.TimeoutError)

# Index entries whose writer-side expiry is this far in the past are dropped without
# looking at their key: generous, so that a writer's fast clock cannot hide a live member.
_INDEX_GRACE_MS = 60_000
_PING_PAYLOAD = b"pdgate-events"

# Drops index entries whose record key is gone, atomically: a plain ZREM after MGET could
# delete the entry of an instance that re-registered in between.
_PRUNE_MISSING = """
local removed = 0
for i, id in ipairs(ARGV) do
  if redis.call('EXISTS', KEYS[i]) == 0 then
    removed = removed + redis.call('ZREM', KEYS[#KEYS], id)
  end
end
return removed
"""


def _name(generation: object) -> str | None:
    if isinstance(generation, bytes):
        return generation.decode(errors="replace")
    return None if generation is None else str(generation)


def redact_url(url: str) -> str:
    """`url` fit for logs: user info and any ``password=`` query value replaced by ``***``."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "<redacted>" if "@" in url or "password" in url.lower() else url
    end = min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))
    authority, tail = rest[:end], rest[end:]
    if "@" in authority:
        authority = "***@" + authority.rpartition("@")[2]
    tail = re.sub(r"(?i)([?&]password=)[^&#]*", r"\1***", tail)
    return f"{scheme}{sep}{authority}{tail}"


def redis_unavailable(where: str, op: str, exc: BaseException) -> RegistryUnavailable:
    """A failed Redis call `op` of `where` (a store and its redacted URL) as the registry's
    error: `RegistryAuthError` when Redis refused the credentials, else `RegistryUnavailable`."""
    if is_auth_failure(exc):
        return RegistryAuthError(
            f"{where}: {op}: Redis refused the credentials "
            f"(password, ACL user or TLS settings in the URL): {exc}"
        )
    return RegistryUnavailable(f"{where}: {op} failed: {exc!r}")


def _event_payload(kind: EventKind, instance_id: str, record: InstanceRecord | None) -> bytes:
    return orjson.dumps(
        {"kind": kind, "id": instance_id, "record": None if record is None else record.to_dict()}
    )


def _decode_event(data: Any) -> RegistryEvent | None:
    """The event in a channel message, or None when it is not one of ours (never raises)."""
    try:
        msg = orjson.loads(data)
        kind = EventKind(msg["kind"])
        instance_id = msg["id"]
        if not isinstance(instance_id, str) or not instance_id:
            return None
        if kind is EventKind.LEAVE:
            return RegistryEvent(kind, instance_id)
        raw = msg["record"]
        if not isinstance(raw, dict):
            return None
        record = InstanceRecord.from_dict(raw)
    except (ValueError, KeyError, TypeError):
        return None
    if record.id != instance_id:
        return None
    return RegistryEvent(kind, instance_id, record)


async def _close_quietly(pubsub: PubSub) -> None:
    # Closing a pub/sub connection to a dead server must not mask the original error.
    with contextlib.suppress(*_ERRORS):
        await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # typed from redis-py 8


class _RedisEventStream:
    """One pub/sub subscription; ends (raising `RegistryUnavailable`) on any failure.

    redis-py's health check PINGs the connection but never notices a missing reply, so the
    stream sends its own PING after ``ping_interval_s`` of silence and gives up when
    nothing at all arrives within ``timeout_s`` after it (a half-open TCP connection).
    """

    def __init__(
        self,
        client: Redis,
        channel: str,
        *,
        timeout_s: float,
        ping_interval_s: float,
        describe: Callable[[str, BaseException], RegistryUnavailable],
        on_close: Callable[[_RedisEventStream], None],
    ) -> None:
        self._client = client
        self._channel = channel
        self._timeout_s = timeout_s
        self._ping_interval_s = ping_interval_s
        self._describe = describe
        self._on_close = on_close
        self._pubsub: PubSub | None = None
        self._closed = False
        self._last_seen = 0.0
        self._ping_sent: float | None = None

    def __aiter__(self) -> _RedisEventStream:
        return self

    async def wait_subscribed(self) -> None:
        if self._closed:
            raise RegistryUnavailable("event stream is closed")
        if self._pubsub is not None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout_s
        pubsub = self._client.pubsub()
        try:
            async with asyncio.timeout_at(deadline):
                await pubsub.subscribe(self._channel)
            # Only the confirmation proves the server will deliver what is published next.
            # (An explicit deadline, not just the scope above: a cancellation-based timeout
            # can be lost inside redis-py on Python 3.11, see registry/_aio.py.)
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise TimeoutError("no confirmation of SUBSCRIBE")
                msg = await pubsub.get_message(timeout=remaining)
                if msg is not None and msg["type"] == "subscribe":
                    break
        except _ERRORS as exc:
            await _close_quietly(pubsub)
            raise await self._fail("subscribe", exc) from exc
        except BaseException:
            await _close_quietly(pubsub)
            raise
        self._pubsub = pubsub
        self._last_seen = loop.time()

    async def __anext__(self) -> RegistryEvent:
        if self._closed:
            raise StopAsyncIteration
        await self.wait_subscribed()
        pubsub = self._pubsub
        assert pubsub is not None
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            try:
                if self._ping_sent is not None:
                    wait = self._ping_sent + self._timeout_s - now
                    if wait <= 0:
                        raise TimeoutError("no reply to PING on the event stream")
                elif now - self._last_seen >= self._ping_interval_s:
                    await pubsub.ping(_PING_PAYLOAD)
                    self._ping_sent = now
                    wait = self._timeout_s
                else:
                    wait = self._ping_interval_s - (now - self._last_seen)
                msg = await pubsub.get_message(timeout=wait)
            except _ERRORS as exc:
                raise await self._fail("read events", exc) from exc
            if msg is None:
                continue
            self._last_seen = loop.time()
            self._ping_sent = None
            if msg["type"] != "message":
                continue
            event = _decode_event(msg["data"])
            if event is None:
                logger.debug("ignoring malformed registry event on %s", self._channel)
                continue
            return event

    async def aclose(self) -> None:
        self._closed = True
        self._on_close(self)
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            await _close_quietly(pubsub)

    async def _fail(self, op: str, exc: BaseException) -> RegistryUnavailable:
        await self.aclose()
        return self._describe(op, exc)


class RedisRegistry:
    """`Registry` on a Redis server (``redis://``, ``rediss://`` or ``unix://`` URL) or on the
    primary of a replicated one, through its sentinels (``redis+sentinel://``,
    registry/_redis_url.py)."""

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = "pdgate",
        max_instances: int = 4096,
        connect_timeout_s: float = 1.0,
        event_ping_interval_s: float = 5.0,
    ) -> None:
        if max_instances <= 0 or connect_timeout_s <= 0 or event_ping_interval_s <= 0:
            raise ValueError("max_instances and the timeouts must be positive")
        if not key_prefix:
            raise ValueError("key_prefix must not be empty")
        self._safe_url = redact_url(url)
        self._max_instances = max_instances
        self._timeout_s = connect_timeout_s
        self._ping_interval_s = event_ping_interval_s
        self._key_base = f"{key_prefix}:instance:".encode()
        self._members_key = f"{key_prefix}:members"
        self._generation_key = f"{key_prefix}:generation"
        self._generation: str | None = None
        self._channel = f"{key_prefix}:events"
        self._client, self._sub_client = open_clients(url, connect_timeout_s)
        self._prune_missing = self._client.register_script(_PRUNE_MISSING)
        self._streams: set[_RedisEventStream] = set()
        self._warned_ids: set[bytes] = set()
        self._over_limit = False

    def __repr__(self) -> str:
        return f"RedisRegistry({self._safe_url!r}, channel={self._channel!r})"

    async def put(self, record: InstanceRecord, ttl_s: float, *, announce: bool = False) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        ttl_ms = max(1, round(ttl_s * 1000))
        try:
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.set(self._key(record.id), record.to_json(), px=ttl_ms)
                pipe.zadd(self._members_key, {record.id: time.time() * 1000 + ttl_ms})
                if announce:
                    pipe.publish(self._channel, _event_payload(EventKind.JOIN, record.id, record))
                await pipe.execute()
        except _ERRORS as exc:
            raise self._unavailable("put", exc) from exc

    async def remove(self, instance_id: str) -> None:
        try:
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.delete(self._key(instance_id))
                pipe.zrem(self._members_key, instance_id)
                pipe.publish(self._channel, _event_payload(EventKind.LEAVE, instance_id, None))
                await pipe.execute()
        except _ERRORS as exc:
            raise self._unavailable("remove", exc) from exc

    def generation(self) -> str | None:
        return self._generation

    async def snapshot(self) -> list[InstanceRecord]:
        try:
            # Each step is one MULTI, and each names the generation it read: a Redis emptied
            # between the index and the records must read as lost, not as every instance
            # leaving under the old name (the view would then have nothing left to hold).
            async with self._client.pipeline(transaction=True) as pipe:
                # A Redis without it lost its state (restarted empty, or a replica promoted
                # before it had it): the first reader names the new contents.
                pipe.setnx(self._generation_key, secrets.token_hex(8))
                pipe.get(self._generation_key)
                pipe.zremrangebyscore(
                    self._members_key, "-inf", time.time() * 1000 - _INDEX_GRACE_MS
                )
                pipe.zcard(self._members_key)
                # Freshest first: if over the bound, the recently refreshed are the ones kept.
                pipe.zrange(self._members_key, 0, self._max_instances - 1, desc=True)
                _, generation, _, total, ids = await pipe.execute()
            self._generation = _name(generation)
            self._check_bound(int(total))
            if not ids:
                return []
            keys = [self._key(i) for i in ids]
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.mget(keys)
                pipe.setnx(self._generation_key, secrets.token_hex(8))
                pipe.get(self._generation_key)
                raws, _, generation = await pipe.execute()
            self._generation = _name(generation)
            records: list[InstanceRecord] = []
            missing: list[bytes] = []
            for instance_id, raw in zip(ids, raws, strict=True):
                if raw is None:
                    missing.append(instance_id)
                    continue
                record = self._parse(instance_id, raw)
                if record is not None:
                    records.append(record)
            if missing:
                await self._prune_missing(
                    keys=[*(self._key(i) for i in missing), self._members_key], args=missing
                )
        except _ERRORS as exc:
            raise self._unavailable("snapshot", exc) from exc
        return records

    def events(self) -> _RedisEventStream:
        stream = _RedisEventStream(
            self._sub_client,
            self._channel,
            timeout_s=self._timeout_s,
            ping_interval_s=self._ping_interval_s,
            describe=self._unavailable,
            on_close=self._streams.discard,
        )
        self._streams.add(stream)
        return stream

    async def aclose(self) -> None:
        for stream in list(self._streams):
            await stream.aclose()
        for client in (self._sub_client, self._client):
            with contextlib.suppress(*_ERRORS):
                await client.aclose()

    def _key(self, instance_id: str | bytes) -> bytes:
        if isinstance(instance_id, str):
            instance_id = instance_id.encode()
        return self._key_base + instance_id

    def _parse(self, instance_id: bytes, raw: bytes | str) -> InstanceRecord | None:
        try:
            record = InstanceRecord.from_json(raw)
            if record.id.encode() != instance_id:
                raise ValueError(f"record id {record.id!r} does not match its key")
        except (ValueError, KeyError, TypeError) as exc:
            # Once per id (bounded), and never the value itself: it may be large or sensitive.
            if instance_id not in self._warned_ids:
                if len(self._warned_ids) >= self._max_instances:
                    self._warned_ids.clear()
                self._warned_ids.add(instance_id)
                logger.warning(
                    "skipping corrupt registry record %r (%d bytes): %s",
                    self._key(instance_id).decode(errors="replace"),
                    len(raw),
                    type(exc).__name__,
                )
            return None
        self._warned_ids.discard(instance_id)
        return record

    def _check_bound(self, total: int) -> None:
        over = total > self._max_instances
        if over and not self._over_limit:
            logger.warning(
                "registry %s lists %d members, more than max_instances=%d; reading the "
                "freshest only",
                self._members_key,
                total,
                self._max_instances,
            )
        self._over_limit = over

    def _unavailable(self, op: str, exc: BaseException) -> RegistryUnavailable:
        return redis_unavailable(f"redis registry {self._safe_url}", op, exc)
