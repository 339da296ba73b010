"""Stored responses of the Responses API, where the fleet's state lives.

A response the gateway answered with ``store`` on is kept so that a later request can chain
on it (``previous_response_id``) through any gateway of the fleet, and read or delete it
(``GET``/``DELETE /v1/responses/{id}``). The store keeps opaque bytes under a *scope* (the
client key's digest: a key never reads another key's responses) and an id; what the bytes
hold is the gateway's business (gateway/translate/responses.py).

Two implementations of one Protocol: `MemoryResponseStore` for a gateway alone, and
`RedisResponseStore` on the fleet's Redis (the registry's URL, Sentinel included), which falls
back to a memory store of its own while Redis cannot be reached, so a gateway that loses
Redis keeps answering (a chain then continues only through the gateway that stored it).

Every store is bounded: each entry in bytes, each scope in entries, everything by a time to
live; the memory store also in total bytes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from redis.exceptions import RedisError

from pdgate.registry._redis_url import open_clients
from pdgate.registry.redis import redact_url

__all__ = [
    "EntryTooLarge",
    "MemoryResponseStore",
    "RedisResponseStore",
    "ResponseStore",
    "StoreLimits",
]

log = logging.getLogger("pdgate.responses")


class EntryTooLarge(ValueError):
    """The entry is over the store's per-entry bound: it is not stored."""


@dataclass(frozen=True, slots=True)
class StoreLimits:
    ttl_s: float = 86400.0
    max_entry_bytes: int = 4 << 20
    max_per_scope: int = 1000
    max_bytes: int = 256 << 20  # the memory store's whole content

    def __post_init__(self) -> None:
        if self.ttl_s <= 0 or min(self.max_entry_bytes, self.max_per_scope, self.max_bytes) <= 0:
            raise ValueError("the response store's limits must be positive")

    def check(self, data: bytes) -> None:
        if len(data) > self.max_entry_bytes:
            raise EntryTooLarge(
                f"a stored response is at most {self.max_entry_bytes} bytes; this one has "
                f"{len(data)}"
            )


class ResponseStore(Protocol):
    limits: StoreLimits

    async def get(self, scope: str, response_id: str) -> bytes | None:
        """The entry, or None (never stored, deleted, expired, or another scope's)."""
        ...

    async def put(self, scope: str, response_id: str, data: bytes) -> None:
        """Store `data` (raises `EntryTooLarge`); the scope's oldest entries go past its
        bound."""
        ...

    async def delete(self, scope: str, response_id: str) -> bool:
        """Whether there was such an entry."""
        ...

    async def aclose(self) -> None: ...


class MemoryResponseStore:
    """This process's stored responses, oldest first: a new entry evicts the expired ones,
    then the oldest past the scope's or the store's bound."""

    def __init__(self, limits: StoreLimits | None = None) -> None:
        self.limits = limits or StoreLimits()
        # (scope, id) -> (expires at, data), in the order they were stored.
        self._entries: OrderedDict[tuple[str, str], tuple[float, bytes]] = OrderedDict()
        self._per_scope: dict[str, OrderedDict[str, None]] = {}
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    async def get(self, scope: str, response_id: str) -> bytes | None:
        entry = self._entries.get((scope, response_id))
        if entry is None:
            return None
        if entry[0] <= time.monotonic():
            self._drop((scope, response_id))
            return None
        return entry[1]

    async def put(self, scope: str, response_id: str, data: bytes) -> None:
        limits = self.limits
        limits.check(data)
        key = (scope, response_id)
        if key in self._entries:
            self._drop(key)
        now = time.monotonic()
        while self._entries:
            oldest = next(iter(self._entries))
            expires, _ = self._entries[oldest]
            if expires > now and self._bytes + len(data) <= limits.max_bytes:
                break
            self._drop(oldest)
        ids = self._per_scope.setdefault(scope, OrderedDict())
        while len(ids) >= limits.max_per_scope:
            self._drop((scope, next(iter(ids))))
        self._entries[key] = (now + limits.ttl_s, data)
        self._per_scope.setdefault(scope, ids)[response_id] = None
        self._bytes += len(data)

    async def delete(self, scope: str, response_id: str) -> bool:
        key = (scope, response_id)
        if key not in self._entries:
            return False
        expired = self._entries[key][0] <= time.monotonic()
        self._drop(key)
        return not expired

    def _drop(self, key: tuple[str, str]) -> None:
        _, data = self._entries.pop(key)
        self._bytes -= len(data)
        scope, response_id = key
        ids = self._per_scope[scope]
        del ids[response_id]
        if not ids:
            del self._per_scope[scope]

    async def aclose(self) -> None:
        self._entries.clear()
        self._per_scope.clear()
        self._bytes = 0


# KEYS: the entry, the scope's index (ids by the time stored). ARGV: data, ttl ms, now ms,
# the scope's bound, the id, the entries' key prefix. The index expires with its newest entry
# and drops what expired or is past the bound, with those entries.
_PUT = """
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[5])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', tonumber(ARGV[3]) - tonumber(ARGV[2]))
local over = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[4])
if over > 0 then
  local old = redis.call('ZPOPMIN', KEYS[2], over)
  for i = 1, #old, 2 do redis.call('DEL', ARGV[6] .. old[i]) end
end
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return 1
"""

_REDIS_DOWN = (RedisError, OSError, asyncio.TimeoutError)


class RedisResponseStore:
    """Stored responses in the fleet's Redis: an entry per response (expiring with the TTL)
    and a sorted index per scope that bounds its entries. A call that fails (Redis away)
    goes to this process's own memory store instead, and a read that finds nothing in Redis
    looks there too, so what was stored while Redis was away stays readable here."""

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = "pdgate",
        limits: StoreLimits | None = None,
        connect_timeout_s: float = 1.0,
    ) -> None:
        self.limits = limits or StoreLimits()
        self._safe_url = redact_url(url)
        self._base = f"{key_prefix}:responses:"
        self._client, _ = open_clients(url, connect_timeout_s)
        self._put = self._client.register_script(_PUT)
        self.fallback = MemoryResponseStore(self.limits)
        self._down = False

    def __repr__(self) -> str:
        return f"RedisResponseStore({self._safe_url!r})"

    def _entry(self, scope: str, response_id: str) -> str:
        # The scope in braces: one hash slot per scope, should the store ever be a cluster.
        return f"{self._base}{{{scope}}}:{response_id}"

    def _index(self, scope: str) -> str:
        return f"{self._base}{{{scope}}}"

    def _failed(self, op: str, exc: BaseException) -> None:
        if not self._down:
            self._down = True
            log.warning(
                "response store %s: %s failed (%s); storing in this process until it answers",
                self._safe_url,
                op,
                type(exc).__name__,
            )

    def _answered(self) -> None:
        if self._down:
            self._down = False
            log.info("response store %s answers again", self._safe_url)

    async def get(self, scope: str, response_id: str) -> bytes | None:
        try:
            data = await self._client.get(self._entry(scope, response_id))
        except _REDIS_DOWN as exc:
            self._failed("get", exc)
            return await self.fallback.get(scope, response_id)
        self._answered()
        if data is None:
            return await self.fallback.get(scope, response_id)
        return data if isinstance(data, bytes) else str(data).encode()

    async def put(self, scope: str, response_id: str, data: bytes) -> None:
        limits = self.limits
        limits.check(data)
        ttl_ms = max(1, round(limits.ttl_s * 1000))
        try:
            await self._put(
                keys=[self._entry(scope, response_id), self._index(scope)],
                args=[
                    data,
                    ttl_ms,
                    int(time.time() * 1000),
                    limits.max_per_scope,
                    response_id,
                    self._entry(scope, ""),
                ],
            )
        except _REDIS_DOWN as exc:
            self._failed("put", exc)
            await self.fallback.put(scope, response_id, data)
            return
        self._answered()

    async def delete(self, scope: str, response_id: str) -> bool:
        local = await self.fallback.delete(scope, response_id)
        try:
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.delete(self._entry(scope, response_id))
                pipe.zrem(self._index(scope), response_id)
                deleted, _ = await pipe.execute()
        except _REDIS_DOWN as exc:
            self._failed("delete", exc)
            return local
        self._answered()
        return bool(deleted) or local

    async def aclose(self) -> None:
        await self._client.aclose()
        await self.fallback.aclose()
