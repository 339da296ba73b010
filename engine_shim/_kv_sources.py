"""Where a decode may pull KV from: the prefill instances of its own registry.

The decode connects to whatever ``kv_transfer_params`` name (``remote_host``,
``remote_port``). Taken on trust, that lets anyone who can reach a decode make it open
connections to any host and port (server-side request forgery), with the cluster token on
them. So a decode follows the registry's membership (`pdgate.registry.Membership`, the
gateway's own view: bounded, kept while the registry is down) and pulls only from the URL of
a registered prefill. A record of a Redis registry with a cluster token is signed, so
writing to Redis does not add a source either.

A prefill that registered a moment ago may not be in the view yet (the gateway that sent the
request may have heard of it first): a miss reads the registry once more before refusing.
Those reads are shared by every request that misses at the same time and happen at most
once per `refresh_interval_s`, so requests naming made-up hosts cannot flood the registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit

from pdgate.config.wire import Role
from pdgate.registry.base import InstanceRecord, Registry, RegistryError
from pdgate.registry.membership import Membership

__all__ = ["KvSources", "endpoint"]

log = logging.getLogger("pdgate.shim.decode")

Endpoint = tuple[str, int]


def endpoint(host: object, port: object) -> Endpoint | None:
    """A normalised (host, port), or None if they are not one: a port is a JSON number or
    decimal digits; a host loses surrounding blanks and an IPv6 literal's brackets."""
    if isinstance(port, int) and not isinstance(port, bool):
        number = port
    elif isinstance(port, str) and port.isascii() and port.isdecimal():
        number = int(port)
    else:
        return None
    name = str(host).strip().strip("[]").lower()
    if not name or not 0 < number < 65536:
        return None
    return name, number


def _of_url(url: str) -> Endpoint | None:
    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    return endpoint(parts.hostname or "", port)


def _prefills(records: Iterable[InstanceRecord], limit: int) -> frozenset[Endpoint]:
    out: set[Endpoint] = set()
    for record in records:
        if len(out) >= limit:
            break
        if record.role == Role.PREFILL and (ep := _of_url(record.url)) is not None:
            out.add(ep)
    return frozenset(out)


class KvSources:
    def __init__(
        self,
        registry: Registry,
        *,
        poll_interval_s: float,
        max_instances: int,
        refresh_interval_s: float = 0.25,
        hold_s: float = 0.0,
    ) -> None:
        self._registry = registry
        self._max = max_instances
        # `hold_s`: prefills a registry that lost its state forgot stay sources meanwhile.
        self._membership = Membership(
            registry, poll_interval_s=poll_interval_s, max_instances=max_instances, hold_s=hold_s
        )
        self._membership.add_listener(self._changed)
        self._known: frozenset[Endpoint] = frozenset()  # the membership's view
        self._fresh: frozenset[Endpoint] = frozenset()  # the last read after a miss
        self._refresh_interval_s = refresh_interval_s
        self._last_read = float("-inf")
        self._reading: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._membership.start()
        self._changed(self._membership.instances(), set())

    async def aclose(self) -> None:
        if self._reading is not None:
            self._reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reading
        await self._membership.stop()

    def _changed(self, view: Mapping[str, InstanceRecord], departed: set[str]) -> None:
        self._known = _prefills(view.values(), self._max)

    def known(self, host: object, port: object) -> bool:
        ep = endpoint(host, port)
        return ep is not None and (ep in self._known or ep in self._fresh)

    async def allowed(self, host: object, port: object) -> bool:
        """Whether a registered prefill listens at `host`:`port` (reads the registry once
        more on a miss, see the module docstring)."""
        if self.known(host, port):
            return True
        if endpoint(host, port) is None:
            return False
        if self._reading is None or self._reading.done():
            self._reading = asyncio.create_task(self._read(), name="kv-sources-read")
        # Shielded: one request leaving must not cancel the read the others wait for.
        await asyncio.shield(self._reading)
        return self.known(host, port)

    async def _read(self) -> None:
        wait = self._last_read + self._refresh_interval_s - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        self._last_read = time.monotonic()
        try:
            records = await self._registry.snapshot()
        except (RegistryError, OSError) as exc:
            log.info("registry unreachable while checking a KV source (%s); known ones only", exc)
            return
        self._fresh = _prefills(records, self._max)
