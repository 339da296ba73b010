"""Load shared by the gateways of one fleet: prefill slot leases, gossiped counts, queue heads.

Gateways that share a registry share what they route on, so that N gateway processes act as
one (P/D-Serve runs many gateways in front of one pool):

* **Slot leases (exact, per request).** A gateway takes a lease on a prefill slot before it
  sends a request there, and gives it back when the KV has left the prefill. The lease count
  never exceeds the prefill's declared slots across the fleet, which keeps the queue-less
  rule for a stock server that would queue instead of answering 429, and spares pdgate
  shims the 429s that N gateways probing the same free slot would draw.
* **A fleet-wide deadline order.** Each gateway publishes the deadline of its most urgent
  queued request per (model, group). For a short window after a slot frees, only the gateway
  with the fleet's most urgent request may take it; the others yield (and are woken again
  when the window ends). After the window anyone may, so a slot never idles waiting for a
  gateway that does not come.
* **What each prefill computes (exact, per request).** A lease is in the prefill's
  computing set from its grant until the gateway saw the answer (`computed`). An acquire
  with ``idle`` grants only on a prefill whose set is empty, in the same step, so no gateway
  sends into a batch another gateway's requests compute, where its request would wait out
  of the fleet's deadline order.
* **Gossiped counts (every `sync_interval_s`).** Open streams and prompt tokens in flight
  per instance, summed over the fleet, for ranking; eventually consistent, off the request
  path. The same sync carries prefill-time samples (one stream for the fleet): every
  gateway estimates from every gateway's calls.
* **Freed-slot and idle notifications** over pub/sub wake every gateway's forwarders at
  once.

Liveness: a gateway's entry, its leases and its counts expire `ttl_s` after its last
renewal, so a gateway that dies (kill -9) leaves no phantom load beyond that bound.

All server-side logic is Lua, timed by the Redis server's clock (never the gateways'), so
hosts with skewed clocks agree. Redis is never on the per-token path: per request, one
acquire, one (coalesced) computed mark and one (coalesced) release.

`LocalFleet` is the same seam without Redis: one process's leases, or, for ``--workers``
without Redis, leases from one slot table the workers share through the OS
(registry/_slot_table.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from redis.exceptions import RedisError

from pdgate.registry._redis_url import open_clients
from pdgate.registry._slot_table import SlotTable
from pdgate.registry.base import RegistryUnavailable
from pdgate.registry.redis import redact_url, redis_unavailable

__all__ = [
    "Candidate",
    "FleetMembers",
    "FleetStore",
    "FleetView",
    "Freed",
    "Grant",
    "HeldLeases",
    "LocalFleet",
    "RedisFleet",
    "SlotTable",
]

log = logging.getLogger(__name__)

_ERRORS = (RedisError, OSError, asyncio.TimeoutError)
_FREED_POLL_S = 0.005  # how soon a worker notices a slot another worker freed (no Redis)


class Candidate(NamedTuple):
    """An instance a lease may be taken on, and its slots. A named tuple: the gateway makes
    one per ranked prefill on every dispatch, and the slot table takes them as they are."""

    instance_id: str
    capacity: int


class Freed(NamedTuple):
    """A fleet event: a slot of `instance_id` freed (`slot`), or it stopped computing
    (``slot=False``: idle, its slots may still hold KV). An empty id: somewhere."""

    instance_id: str
    slot: bool = True


@dataclass(frozen=True, slots=True)
class Grant:
    """The outcome of one acquire: leases on the first candidate with room, or none."""

    instance_id: str | None
    lease_ids: tuple[str, ...] = ()
    # A more urgent request at another gateway has the first try at this freed slot.
    yielded: bool = False
    # Fleet-wide used slots of the candidates examined (after this grant).
    used: Mapping[str, int] = field(default_factory=dict)
    # Fleet-wide requests each candidate examined is computing (after this grant).
    computing: Mapping[str, int] = field(default_factory=dict)
    # Ms to the deadline of the most urgent request queued at another gateway (None: none).
    others_head_ms: float | None = None


@dataclass(frozen=True, slots=True)
class FleetView:
    """What a sync returns: the fleet's view, this gateway's own share included."""

    gateways: int  # live gateways, this one included
    streams: Mapping[str, int]  # instance -> open streams, whole fleet
    tokens: Mapping[str, int]  # instance -> prompt tokens in flight, whole fleet
    slots: Mapping[str, int]  # instance -> leased prefill slots, whole fleet
    # instance -> requests the prefill is computing (sent, not yet answered), whole fleet
    computing: Mapping[str, int] = field(default_factory=dict)
    # queue -> the other gateways' prefill-time samples published since the last sync
    samples: Mapping[str, Sequence[str]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class HeldLeases:
    """The leases a gateway holds, for a sync to make the shared store agree with them."""

    # Leases of this store's acquires numbered up to this were answered before the list was
    # made (-1: judge none); a later one may be in Redis and not yet here.
    cutoff: int = -1
    live: Mapping[str, Sequence[tuple[str, bool]]] = field(default_factory=dict)  # instance
    # -> (lease id, still computing)
    keep: Mapping[str, Sequence[str]] = field(default_factory=dict)  # being given back


class FleetStore(Protocol):
    gateway_id: str
    shared: bool  # False: this process's own view only

    async def acquire(
        self,
        queue: str,
        candidates: Sequence[Candidate],
        want: int,
        *,
        head_in_ms: float | None,
        next_head_in_ms: float | None,
        idle: bool = False,
    ) -> Grant:
        """Up to `want` slot leases on the first candidate (in order) with room.

        `head_in_ms`: milliseconds left to the deadline of the request being placed (None:
        no deadline order); `next_head_in_ms`: the same for this queue's next request once
        these are placed (None: the queue will be empty); `idle`: only a candidate that
        computes nothing for anyone in the fleet may grant (a new lease counts as computing
        until `computed`). Raises `RegistryUnavailable`."""
        ...

    async def computed(self, leases: Sequence[tuple[str, str]]) -> None:
        """The prefill answered the requests of these ``(instance_id, lease_id)`` leases: it
        no longer computes them (their slots stay leased until `release`). A prefill that
        computes nothing more is announced to the fleet. Raises `RegistryUnavailable`."""
        ...

    async def release(self, leases: Sequence[tuple[str, str]]) -> None:
        """Give back ``(instance_id, lease_id)`` leases and tell the fleet the slots freed.
        Raises `RegistryUnavailable` (the leases then expire on their own)."""
        ...

    async def renew(self, leases: Mapping[str, Sequence[str]]) -> None:
        """Keep this gateway's live leases (instance -> lease ids) from expiring."""
        ...

    async def sync(
        self,
        streams: Mapping[str, int],
        tokens: Mapping[str, int],
        heads: Mapping[str, float | None],
        instances: Sequence[str],
        samples: Mapping[str, str] | None = None,
        leases: HeldLeases | None = None,
    ) -> FleetView:
        """Publish this gateway's counts (absolute, per instance), queue heads (queue -> ms
        to the most urgent deadline, None = empty) and new prefill-time samples (queue ->
        one packed string), make its leases on `instances` agree with `leases`, renew its
        liveness, and read the fleet's sums for `instances` and the other gateways'
        samples. Raises `RegistryUnavailable`."""
        ...

    def lease_cutoff(self) -> int:
        """The `HeldLeases.cutoff` of now: every acquire numbered up to it was answered."""
        ...

    def freed(self) -> AsyncIterator[Freed]:
        """Prefills whose slot another gateway just freed, or that just stopped computing
        (best effort; ends or raises `RegistryUnavailable` on failure, the caller
        re-subscribes)."""
        ...

    async def aclose(self) -> None: ...


# -- without Redis -------------------------------------------------------------------------


class LocalFleet:
    """This node's leases. Alone (no `table`), one process's own count against each
    instance's whole capacity. With a `SlotTable` (``--workers`` without Redis), the workers
    of the node lease whole slots from one table shared through the OS, so together they
    never exceed an instance's capacity and any of them may use any free slot."""

    shared = False

    def __init__(self, gateway_id: str | None = None, table: SlotTable | None = None) -> None:
        self.gateway_id = gateway_id or f"gw-{secrets.token_hex(4)}"
        self._table = table
        self._leases: dict[str, set[str]] = {}
        self._seq = itertools.count()

    @property
    def shares_slots(self) -> bool:
        """Other processes lease from the same slots (their frees are polled, `freed`)."""
        return self._table is not None

    async def acquire(
        self,
        queue: str,
        candidates: Sequence[Candidate],
        want: int,
        *,
        head_in_ms: float | None,
        next_head_in_ms: float | None,
        idle: bool = False,
    ) -> Grant:
        # `idle` is the caller's own rule here: alone, this process's view of what its
        # prefills compute is exact (with a slot table, each worker knows only its own).
        used: dict[str, int] = {}
        if self._table is not None:
            index, granted = self._table.acquire(candidates, want)
            if index < 0:
                return Grant(None)
            return Grant(
                candidates[index].instance_id, self._new_leases(candidates[index], granted)
            )
        for c in candidates:
            held = self._leases.get(c.instance_id, set())
            free = c.capacity - len(held)
            used[c.instance_id] = len(held)
            if free > 0:
                ids = self._new_leases(c, min(free, want))
                used[c.instance_id] += len(ids)
                return Grant(c.instance_id, ids, used=used)
        return Grant(None, used=used)

    def _new_leases(self, candidate: Candidate, n: int) -> tuple[str, ...]:
        ids = tuple(f"{self.gateway_id}:{next(self._seq)}" for _ in range(n))
        self._leases.setdefault(candidate.instance_id, set()).update(ids)
        return ids

    async def computed(self, leases: Sequence[tuple[str, str]]) -> None:
        return None

    async def release(self, leases: Sequence[tuple[str, str]]) -> None:
        self.release_now(leases)

    def release_now(self, leases: Sequence[tuple[str, str]]) -> None:
        """`release` without the event loop: nothing here waits (one per request, on the
        hot path of a gateway that counts its own slots)."""
        for instance_id, lease_id in leases:
            held = self._leases.get(instance_id)
            if held is None or lease_id not in held:
                continue  # released once only
            held.discard(lease_id)
            if not held:
                del self._leases[instance_id]
            if self._table is not None:
                self._table.release(instance_id)

    async def renew(self, leases: Mapping[str, Sequence[str]]) -> None:
        return None

    async def sync(
        self,
        streams: Mapping[str, int],
        tokens: Mapping[str, int],
        heads: Mapping[str, float | None],
        instances: Sequence[str],
        samples: Mapping[str, str] | None = None,
        leases: HeldLeases | None = None,
    ) -> FleetView:
        return FleetView(
            1,
            dict(streams),
            dict(tokens),
            {i: len(self._leases.get(i, ())) for i in instances},
        )

    def lease_cutoff(self) -> int:
        return -1  # nothing shared to agree with

    async def freed(self) -> AsyncIterator[Freed]:
        if self._table is None:
            await asyncio.Event().wait()  # nobody else frees slots
        # Another worker's release bumps the table's generation: a read of shared memory
        # every few milliseconds, no system call, stands in for Redis pub/sub.
        last = self._table.generation() if self._table is not None else 0
        while self._table is not None:
            await asyncio.sleep(_FREED_POLL_S)
            now = self._table.generation()
            if now != last:
                last = now
                yield Freed("")

    async def aclose(self) -> None:
        if self._table is not None:
            for instance_id, held in self._leases.items():
                self._table.release(instance_id, len(held))
        self._leases.clear()


# -- on Redis ------------------------------------------------------------------------------

# Every script starts with this (`RedisFleetStore`): the time from Redis, in ms, one clock for
# every gateway's leases.
_NOW_MS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# A prefill's slots are a sorted set of lease ids (score: expiry). Of those, the ones whose
# prompt it is still computing are also in its "computing" set, from the grant until the
# gateway saw the answer (`computed`) or gave the lease back.
#
# KEYS: gw, freed_at, then per candidate: slots key, computing key.  ARGV: me, ttl_ms,
# window_ms, tolerance_ms, want, head_in_ms (-1: none), next_head_in_ms (-1: empty), heads
# key, lease base, n, idle (0/1), then per candidate: instance id, capacity.
# Returns {index of the granting candidate (0: none), yielded (0/1), ms to the most urgent
# queued request at another live gateway (-1: none), used..., computing..., lease ids...}.
_ACQUIRE = """
local me, ttl, window, tol = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local want, head, nxt = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local heads_key, base, n, idle = ARGV[8], ARGV[9], tonumber(ARGV[10]), ARGV[11] == '1'
redis.call('ZADD', KEYS[1], now + ttl, me)
local function others_first(instance)
  if head < 0 then return false end
  local freed = tonumber(redis.call('HGET', KEYS[2], instance) or '0')
  if now - freed >= window then return false end
  local mine = now + head
  local rows = redis.call('ZRANGE', heads_key, 0, 7, 'WITHSCORES')
  for i = 1, #rows, 2 do
    local gw, due = rows[i], tonumber(rows[i + 1])
    if due >= mine - tol then return false end
    -- (a head whose deadline passed is a stale entry: that request is gone)
    if gw ~= me and due >= now then
      local alive = tonumber(redis.call('ZSCORE', KEYS[1], gw) or '0')
      if alive >= now then return true end
    end
  end
  return false
end
local others = -1
local head_rows = redis.call('ZRANGE', heads_key, 0, 7, 'WITHSCORES')
for i = 1, #head_rows, 2 do
  local gw, due = head_rows[i], tonumber(head_rows[i + 1])
  if others < 0 and gw ~= me and due >= now then
    if tonumber(redis.call('ZSCORE', KEYS[1], gw) or '0') >= now then others = due - now end
  end
end
local used, computing, granted, yielded, ids = {}, {}, 0, 0, {}
for i = 1, n do
  local key, busy_key = KEYS[1 + 2 * i], KEYS[2 + 2 * i]
  local instance, cap = ARGV[10 + 2 * i], tonumber(ARGV[11 + 2 * i])
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  redis.call('ZREMRANGEBYSCORE', busy_key, '-inf', now)
  local busy = redis.call('ZCARD', key)
  used[i] = busy
  computing[i] = redis.call('ZCARD', busy_key)
  if granted == 0 and busy < cap and not (idle and computing[i] > 0) then
    if others_first(instance) then
      yielded = 1
    else
      local k = math.min(want, cap - busy)
      for j = 1, k do
        local id = base .. ':' .. j
        redis.call('ZADD', key, now + ttl, id)
        redis.call('ZADD', busy_key, now + ttl, id)
        ids[#ids + 1] = id
      end
      used[i] = busy + k
      computing[i] = computing[i] + k
      granted = i
    end
  end
end
-- This gateway's head from now on: the request after those placed if it placed any, else
-- the one it still holds (a gateway that found no room must not look less urgent).
local after = head
if granted > 0 then after = nxt end
if after >= 0 then
  redis.call('ZADD', heads_key, now + after, me)
else
  redis.call('ZREM', heads_key, me)
end
redis.call('PEXPIRE', heads_key, ttl * 4)
local out = {granted, yielded, others}
for i = 1, n do out[#out + 1] = used[i] end
for i = 1, n do out[#out + 1] = computing[i] end
for i = 1, #ids do out[#out + 1] = ids[i] end
return out
"""

# KEYS: freed_at, then per lease: its computing key.  ARGV: channel, then per lease:
# instance, id. A prefill left computing nothing opens the fleet's priority window and is
# announced, as a freed slot is.
_COMPUTED = """
local told = {}
for i = 2, #KEYS do
  local instance, id = ARGV[2 * i - 2], ARGV[2 * i - 1]
  if redis.call('ZREM', KEYS[i], id) == 1 and not told[instance] then
    redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now)
    if redis.call('ZCARD', KEYS[i]) == 0 then
      told[instance] = true
      redis.call('HSET', KEYS[1], instance, now)
      redis.call('PUBLISH', ARGV[1], instance)
    end
  end
end
return 0
"""

# KEYS: freed_at, then per lease: its slots key, its computing key.  ARGV: channel, idle
# channel, then per lease: instance, id. A lease given back before its answer also leaves the
# computing set; a prefill that then computes nothing is announced as `_COMPUTED` does.
_RELEASE = """
local freed, idle = {}, {}
for i = 1, (#KEYS - 1) / 2 do
  local instance, id = ARGV[2 * i + 1], ARGV[2 * i + 2]
  local busy_key = KEYS[2 * i + 1]
  if redis.call('ZREM', busy_key, id) == 1 and not idle[instance] then
    redis.call('ZREMRANGEBYSCORE', busy_key, '-inf', now)
    if redis.call('ZCARD', busy_key) == 0 then
      idle[instance] = true
      redis.call('PUBLISH', ARGV[2], instance)
    end
  end
  if redis.call('ZREM', KEYS[2 * i], id) == 1 and not freed[instance] then
    freed[instance] = true
    redis.call('HSET', KEYS[1], instance, now)
    redis.call('PUBLISH', ARGV[1], instance)
  end
end
return 0
"""

# KEYS: per instance: its slots key, its computing key.  ARGV: ttl_ms, then per instance:
# count, ids... (XX: a lease already given back, or answered, is not brought back).
_RENEW = """
local ttl, a = tonumber(ARGV[1]), 2
for i = 1, #KEYS / 2 do
  local count = tonumber(ARGV[a]); a = a + 1
  for j = 1, count do
    redis.call('ZADD', KEYS[2 * i - 1], 'XX', 'GT', now + ttl, ARGV[a])
    redis.call('ZADD', KEYS[2 * i], 'XX', 'GT', now + ttl, ARGV[a])
    a = a + 1
  end
end
return 0
"""

# The per-gateway hashes never expire on their own: a live gateway's sync removes a dead one's
# counts from the sums and then its hash, so the two cannot disagree.
# Prefill-time samples go into one stream, an entry per gateway, queue and sync, capped (a
# few seconds of the fleet's samples): each gateway reads the others' entries, every queue's,
# after its cursor.
# KEYS: gw, sums (hash instance -> "streams tokens"), mine (hash, same), samples stream, then
# per queue: heads key, then per instance read: its slots key, its computing key.
# ARGV: me, ttl_ms, prefix of the per-gateway hashes, n_queues, n_read, n_counts, then per
# queue: ms to its head (-1: empty); per read instance: its id; per count: instance, streams,
# tokens; then the samples cursor ("-": from the start), then per queue: its name, its new
# samples ("": none); then the lease cutoff, then per read instance: n_live, n_live (lease
# id, computing 0/1), n_keep, n_keep lease ids.
# This gateway's leases are made to agree with what it holds (`_reconcile`): a live one Redis
# lost (a failover to a replica that had not received it, a Redis back empty) is written
# again, one of its own that it no longer holds and that is not being given back (a release
# the old primary took with it) is removed. Only leases of acquires answered before this
# sync was built (sequence <= the cutoff) can be judged so.
# Returns {live gateways, then per read instance: streams, tokens, slots, computing, then the
# new cursor, n, and n (queue, samples) pairs of the other gateways}.
_SYNC = """
local me, ttl, gw_prefix = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local nq, nr, nc = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local gw, sums, mine = KEYS[1], KEYS[2], KEYS[3]
-- the dead take their counts with them
local dead = redis.call('ZRANGEBYSCORE', gw, '-inf', now)
for _, g in ipairs(dead) do
  if g ~= me then
    local key = gw_prefix .. g
    local rows = redis.call('HGETALL', key)
    for i = 1, #rows, 2 do
      local s, k = string.match(rows[i + 1], '(%-?%d+) (%-?%d+)')
      redis.call('HINCRBY', sums, rows[i] .. '|s', 0 - tonumber(s))
      redis.call('HINCRBY', sums, rows[i] .. '|t', 0 - tonumber(k))
    end
    redis.call('DEL', key)
    redis.call('ZREM', gw, g)
  end
end
redis.call('ZADD', gw, now + ttl, me)
-- my counts: apply the change since my last sync to the fleet's sums
local a = 7 + nq + nr
local seen = {}
for i = 1, nc do
  local instance, s, k = ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]); a = a + 3
  seen[instance] = true
  local old = redis.call('HGET', mine, instance)
  local os, ok = 0, 0
  if old then
    local x, y = string.match(old, '(%-?%d+) (%-?%d+)')
    os, ok = tonumber(x), tonumber(y)
  end
  if s ~= os then redis.call('HINCRBY', sums, instance .. '|s', s - os) end
  if k ~= ok then redis.call('HINCRBY', sums, instance .. '|t', k - ok) end
  if s == 0 and k == 0 then
    redis.call('HDEL', mine, instance)
  else
    redis.call('HSET', mine, instance, s .. ' ' .. k)
  end
end
local rows = redis.call('HGETALL', mine)
for i = 1, #rows, 2 do
  if not seen[rows[i]] then
    local x, y = string.match(rows[i + 1], '(%-?%d+) (%-?%d+)')
    redis.call('HINCRBY', sums, rows[i] .. '|s', 0 - tonumber(x))
    redis.call('HINCRBY', sums, rows[i] .. '|t', 0 - tonumber(y))
    redis.call('HDEL', mine, rows[i])
  end
end
for q = 1, nq do
  local hk, due = KEYS[4 + q], tonumber(ARGV[6 + q])
  -- overdue heads (those requests are gone) and the heads of gateways no longer live go:
  -- the key is renewed by every sync, and reads see only its first eight entries
  redis.call('ZREMRANGEBYSCORE', hk, '-inf', '(' .. now)
  for _, g in ipairs(redis.call('ZRANGE', hk, 0, -1)) do
    if g ~= me and tonumber(redis.call('ZSCORE', gw, g) or '0') < now then
      redis.call('ZREM', hk, g)
    end
  end
  if due >= 0 then
    redis.call('ZADD', hk, now + due, me)
  else
    redis.call('ZREM', hk, me)
  end
  redis.call('PEXPIRE', hk, ttl * 4)
end
local b = a + 1 + 2 * nq
local cutoff = tonumber(ARGV[b]); b = b + 1
local mine_prefix = me .. ':'
local function stale_own(id, held)
  if held[id] or string.sub(id, 1, #mine_prefix) ~= mine_prefix then return false end
  local seq = tonumber(string.match(string.sub(id, #mine_prefix + 1), '^(%d+):%d+$'))
  return seq ~= nil and seq <= cutoff
end
local out = {redis.call('ZCARD', gw)}
for r = 1, nr do
  local instance = ARGV[6 + nq + r]
  local key, busy_key = KEYS[3 + nq + 2 * r], KEYS[4 + nq + 2 * r]
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  redis.call('ZREMRANGEBYSCORE', busy_key, '-inf', now)
  local held = {}
  local n_live = tonumber(ARGV[b]); b = b + 1
  for j = 1, n_live do
    local id, comp = ARGV[b], ARGV[b + 1]; b = b + 2
    held[id] = true
    redis.call('ZADD', key, 'NX', now + ttl, id)
    if comp == '1' then redis.call('ZADD', busy_key, 'NX', now + ttl, id) end
  end
  local n_keep = tonumber(ARGV[b]); b = b + 1
  for j = 1, n_keep do held[ARGV[b]] = true; b = b + 1 end
  for _, set in ipairs({key, busy_key}) do
    for _, id in ipairs(redis.call('ZRANGE', set, 0, -1)) do
      if stale_own(id, held) then redis.call('ZREM', set, id) end
    end
  end
  out[#out + 1] = tonumber(redis.call('HGET', sums, instance .. '|s') or '0')
  out[#out + 1] = tonumber(redis.call('HGET', sums, instance .. '|t') or '0')
  out[#out + 1] = redis.call('ZCARD', key)
  out[#out + 1] = redis.call('ZCARD', busy_key)
end
local stream, cursor = KEYS[4], ARGV[a]
local last = cursor
for q = 1, nq do
  local name, new = ARGV[a + 2 * q - 1], ARGV[a + 2 * q]
  if new ~= '' then
    last = redis.call('XADD', stream, 'MAXLEN', '~', 1024, '*', 'g', me, 'q', name, 's', new)
  end
end
redis.call('PEXPIRE', stream, ttl * 30)
local from = '-'
if cursor ~= '-' then from = '(' .. cursor end
local entries = redis.call('XRANGE', stream, from, '+', 'COUNT', 1024)
local theirs = {}
for _, e in ipairs(entries) do
  last = e[1]
  local f = e[2]
  if f[2] ~= me then
    theirs[#theirs + 1] = f[4]
    theirs[#theirs + 1] = f[6]
  end
end
out[#out + 1] = last
out[#out + 1] = #theirs / 2
for _, x in ipairs(theirs) do out[#out + 1] = x end
return out
"""


class RedisFleet:
    """`FleetStore` on the registry's Redis (same URL and key prefix)."""

    shared = True

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = "pdgate",
        gateway_id: str | None = None,
        ttl_s: float = 2.0,
        window_s: float = 0.02,
        tolerance_s: float = 0.01,
        connect_timeout_s: float = 1.0,
    ) -> None:
        if ttl_s <= 0 or window_s < 0 or tolerance_s < 0:
            raise ValueError("ttl_s must be positive, window_s and tolerance_s >= 0")
        self.gateway_id = gateway_id or f"gw-{secrets.token_hex(6)}"
        self._safe_url = redact_url(url)
        self._ttl_ms = max(1, round(ttl_s * 1000))
        self._window_ms = round(window_s * 1000)
        self._tolerance_ms = round(tolerance_s * 1000)
        base = f"{key_prefix}:fleet:"
        self._base = base
        self._gw = base + "gw"
        self._freed_at = base + "freed_at"
        self._sums = base + "sums"
        self._mine = base + "load:" + self.gateway_id
        self._channel = base + "freed"
        self._idle_channel = base + "idle"
        self._samples = base + "samples"
        self._cursor = "-"  # the last samples entry read
        self._seq = itertools.count()
        self._last_seq = -1  # the last acquire's number
        self._pending: set[int] = set()  # acquires not answered yet
        self._client, self._sub_client = open_clients(url, connect_timeout_s)
        self._acquire = self._client.register_script(_NOW_MS + _ACQUIRE)
        self._computed = self._client.register_script(_NOW_MS + _COMPUTED)
        self._release = self._client.register_script(_NOW_MS + _RELEASE)
        self._renew = self._client.register_script(_NOW_MS + _RENEW)
        self._sync = self._client.register_script(_NOW_MS + _SYNC)
        self._timeout_s = connect_timeout_s

    def __repr__(self) -> str:
        return f"RedisFleet({self._safe_url!r}, gateway={self.gateway_id!r})"

    def _slots(self, instance_id: str) -> str:
        return f"{self._base}slots:{instance_id}"

    def _computing(self, instance_id: str) -> str:
        return f"{self._base}computing:{instance_id}"

    def _heads(self, queue: str) -> str:
        return f"{self._base}heads:{queue}"

    def _unavailable(self, op: str, exc: BaseException) -> RegistryUnavailable:
        return redis_unavailable(f"fleet state {self._safe_url}", op, exc)

    async def acquire(
        self,
        queue: str,
        candidates: Sequence[Candidate],
        want: int,
        *,
        head_in_ms: float | None,
        next_head_in_ms: float | None,
        idle: bool = False,
    ) -> Grant:
        if not candidates or want <= 0:
            return Grant(None)
        seq = self._last_seq = next(self._seq)
        self._pending.add(seq)
        try:
            return await self._acquire_as(
                seq, queue, candidates, want, head_in_ms, next_head_in_ms, idle
            )
        finally:
            self._pending.discard(seq)

    def lease_cutoff(self) -> int:
        return min(self._pending) - 1 if self._pending else self._last_seq

    async def _acquire_as(
        self,
        seq: int,
        queue: str,
        candidates: Sequence[Candidate],
        want: int,
        head_in_ms: float | None,
        next_head_in_ms: float | None,
        idle: bool,
    ) -> Grant:
        args: list[Any] = [
            self.gateway_id,
            self._ttl_ms,
            self._window_ms,
            self._tolerance_ms,
            want,
            -1 if head_in_ms is None else max(0, round(head_in_ms)),
            -1 if next_head_in_ms is None else max(0, round(next_head_in_ms)),
            self._heads(queue),
            f"{self.gateway_id}:{seq}",
            len(candidates),
            1 if idle else 0,
        ]
        keys = [self._gw, self._freed_at]
        for c in candidates:
            args += [c.instance_id, c.capacity]
            keys += [self._slots(c.instance_id), self._computing(c.instance_id)]
        try:
            out = await self._acquire(keys=keys, args=args)
        except _ERRORS as exc:
            raise self._unavailable("acquire", exc) from exc
        chosen, yielded, others = int(out[0]), bool(out[1]), int(out[2])
        n = len(candidates)
        used = {c.instance_id: int(out[3 + i]) for i, c in enumerate(candidates)}
        computing = {c.instance_id: int(out[3 + n + i]) for i, c in enumerate(candidates)}
        ids = tuple(_text(x) for x in out[3 + 2 * n :])
        instance = candidates[chosen - 1].instance_id if chosen else None
        return Grant(
            instance,
            ids,
            yielded=yielded,
            used=used,
            computing=computing,
            others_head_ms=None if others < 0 else float(others),
        )

    async def computed(self, leases: Sequence[tuple[str, str]]) -> None:
        if not leases:
            return
        keys = [self._freed_at, *(self._computing(i) for i, _ in leases)]
        args: list[Any] = [self._idle_channel]
        for instance_id, lease_id in leases:
            args += [instance_id, lease_id]
        try:
            await self._computed(keys=keys, args=args)
        except _ERRORS as exc:
            raise self._unavailable("computed", exc) from exc

    async def release(self, leases: Sequence[tuple[str, str]]) -> None:
        if not leases:
            return
        keys = [self._freed_at]
        args: list[Any] = [self._channel, self._idle_channel]
        for instance_id, lease_id in leases:
            keys += [self._slots(instance_id), self._computing(instance_id)]
            args += [instance_id, lease_id]
        try:
            await self._release(keys=keys, args=args)
        except _ERRORS as exc:
            raise self._unavailable("release", exc) from exc

    async def renew(self, leases: Mapping[str, Sequence[str]]) -> None:
        held = {i: ids for i, ids in leases.items() if ids}
        if not held:
            return
        args: list[Any] = [self._ttl_ms]
        for ids in held.values():
            args += [len(ids), *ids]
        try:
            keys = [k for i in held for k in (self._slots(i), self._computing(i))]
            await self._renew(keys=keys, args=args)
        except _ERRORS as exc:
            raise self._unavailable("renew", exc) from exc

    async def sync(
        self,
        streams: Mapping[str, int],
        tokens: Mapping[str, int],
        heads: Mapping[str, float | None],
        instances: Sequence[str],
        samples: Mapping[str, str] | None = None,
        leases: HeldLeases | None = None,
    ) -> FleetView:
        queues = list(heads)
        counts = sorted(set(streams) | set(tokens))
        keys = [
            self._gw,
            self._sums,
            self._mine,
            self._samples,
            *(self._heads(q) for q in queues),
            *(k for i in instances for k in (self._slots(i), self._computing(i))),
        ]
        args: list[Any] = [
            self.gateway_id,
            self._ttl_ms,
            self._base + "load:",
            len(queues),
            len(instances),
            len(counts),
        ]
        for q in queues:
            due = heads[q]
            args.append(-1 if due is None else max(0, round(due)))
        args += list(instances)
        for i in counts:
            args += [i, int(streams.get(i, 0)), int(tokens.get(i, 0))]
        args.append(self._cursor)
        for q in queues:
            args += [q, (samples or {}).get(q, "")]
        held = leases or HeldLeases()
        args.append(held.cutoff)
        for i in instances:
            live = held.live.get(i, ())
            keep = held.keep.get(i, ())
            args.append(len(live))
            for lease_id, computing in live:
                args += [lease_id, 1 if computing else 0]
            args += [len(keep), *keep]
        try:
            out = await self._sync(keys=keys, args=args)
        except _ERRORS as exc:
            raise self._unavailable("sync", exc) from exc
        view_streams: dict[str, int] = {}
        view_tokens: dict[str, int] = {}
        view_slots: dict[str, int] = {}
        view_computing: dict[str, int] = {}
        for r, instance in enumerate(instances):
            s, k, used, computing = out[1 + 4 * r : 5 + 4 * r]
            view_streams[instance] = max(0, int(s))
            view_tokens[instance] = max(0, int(k))
            view_slots[instance] = int(used)
            view_computing[instance] = int(computing)
        theirs: dict[str, list[str]] = {}
        at = 1 + 4 * len(instances)
        self._cursor = _text(out[at])
        for k in range(int(out[at + 1])):
            queue, packed = _text(out[at + 2 + 2 * k]), _text(out[at + 3 + 2 * k])
            theirs.setdefault(queue, []).append(packed)
        return FleetView(int(out[0]), view_streams, view_tokens, view_slots, view_computing, theirs)

    async def freed(self) -> AsyncIterator[Freed]:
        pubsub = self._sub_client.pubsub()
        try:
            try:
                await pubsub.subscribe(self._channel, self._idle_channel)
            except _ERRORS as exc:
                raise self._unavailable("subscribe", exc) from exc
            loop = asyncio.get_running_loop()
            heard = loop.time()
            while True:
                try:
                    msg = await pubsub.get_message(
                        ignore_subscribe_messages=True, timeout=self._timeout_s
                    )
                except _ERRORS as exc:
                    raise self._unavailable("read freed slots", exc) from exc
                if msg is None:
                    # Quiet channel: prove the connection is alive (a half-open TCP link
                    # would otherwise look like a fleet where nothing frees).
                    if loop.time() - heard > 3 * self._timeout_s:
                        raise self._unavailable("read freed slots", TimeoutError("no PONG"))
                    try:
                        await pubsub.ping()
                    except _ERRORS as exc:
                        raise self._unavailable("ping", exc) from exc
                    continue
                heard = loop.time()
                if msg.get("type") == "message":
                    channel = _text(msg.get("channel", b""))
                    yield Freed(_text(msg["data"]), slot=channel != self._idle_channel)
        finally:
            with contextlib.suppress(*_ERRORS):
                await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # typed from redis-py 8

    async def aclose(self) -> None:
        # Leave now rather than at expiry: our counts stop counting at once. With Redis away
        # they expire there instead (`sync` raises RegistryUnavailable, not the client's
        # error): a gateway stopping then must still close.
        with contextlib.suppress(RegistryUnavailable, *_ERRORS):
            await self.sync({}, {}, {}, [])
            await self._client.zrem(self._gw, self.gateway_id)
        for client in (self._sub_client, self._client):
            with contextlib.suppress(*_ERRORS):
                await client.aclose()


# KEYS: gw.  ARGV: gateway ids.  Returns 1 per id whose entry is live now, else 0.
_LIVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
for i, id in ipairs(ARGV) do
  local expiry = tonumber(redis.call('ZSCORE', KEYS[1], id) or '0')
  out[i] = expiry > now and 1 or 0
end
return out
"""


class FleetMembers:
    """Which gateways are live members of the fleet, read from its Redis (same URL and key
    prefix as `RedisFleet`): for a prefill that holds KV for gateways, so that it lets go of
    what a gateway that left will never pull."""

    def __init__(
        self, url: str, *, key_prefix: str = "pdgate", connect_timeout_s: float = 1.0
    ) -> None:
        self._safe_url = redact_url(url)
        self._gw = f"{key_prefix}:fleet:gw"
        self._client, self._sub_client = open_clients(url, connect_timeout_s)
        self._live = self._client.register_script(_LIVE)

    async def live(self, gateway_ids: Sequence[str]) -> set[str]:
        """Those of `gateway_ids` whose fleet entry has not expired. Raises
        `RegistryUnavailable`."""
        if not gateway_ids:
            return set()
        try:
            flags = await self._live(keys=[self._gw], args=list(gateway_ids))
        except _ERRORS as exc:
            raise redis_unavailable(f"fleet state {self._safe_url}", "live", exc) from exc
        return {g for g, flag in zip(gateway_ids, flags, strict=True) if int(flag)}

    async def aclose(self) -> None:
        for client in (self._sub_client, self._client):
            with contextlib.suppress(*_ERRORS):
                await client.aclose()


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
