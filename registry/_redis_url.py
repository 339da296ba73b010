"""A Redis client from a URL: one server, or the primary that Redis Sentinel names.

``redis://``, ``rediss://`` and ``unix://`` are redis-py's own forms. A replicated Redis is
reached through its sentinels::

    redis+sentinel://[[user]:password@]host:port[,host:port...]/service_name[/db][?options]
    rediss+sentinel://...   (TLS to the sentinels and to the primary)

The user and password are the data nodes' (the primary's and its replicas'); the sentinels'
own are the query's ``sentinel_username`` and ``sentinel_password``. The other query options
are redis-py's (``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs``, ...)
and apply to both. A port left out is Sentinel's 26379.

The client asks the sentinels for the primary's address on every new connection, so after a
failover its next connection goes to the new primary: a call that fails on the old one is
retried there (the callers' `Retry`), and a pub/sub subscription ends and is made again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode

from redis.asyncio import Redis
from redis.asyncio.connection import parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialBackoff, NoBackoff

__all__ = ["SENTINEL_SCHEMES", "SentinelUrl", "open_clients", "open_redis", "parse_sentinel_url"]

# Scheme -> TLS.
SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}
_SENTINEL_PORT = 26379
_SENTINEL_ONLY = ("sentinel_username", "sentinel_password")
# Idle pooled connections are PINGed before reuse after this long (redis-py wants an int).
_HEALTH_CHECK_INTERVAL_S = 5


@dataclass(frozen=True)
class SentinelUrl:
    sentinels: tuple[tuple[str, int], ...]
    service: str
    # Connection options of the data nodes (db, credentials, TLS) and of the sentinels.
    node: dict[str, Any] = field(default_factory=dict)
    sentinel: dict[str, Any] = field(default_factory=dict)


def parse_sentinel_url(url: str) -> SentinelUrl:
    """The parts of a ``redis+sentinel://`` or ``rediss+sentinel://`` URL (ValueError for a
    malformed one; the message never repeats the URL, which may hold a password)."""
    scheme, sep, rest = url.partition("://")
    tls = SENTINEL_SCHEMES.get(scheme.lower())
    if not sep or tls is None:
        raise ValueError("not a redis+sentinel:// or rediss+sentinel:// URL")
    rest, _, query = rest.partition("?")
    authority, _, path = rest.partition("/")
    userinfo, at, hosts = authority.rpartition("@")
    if not at:
        userinfo, hosts = "", authority
    sentinels = tuple(_host_port(h) for h in hosts.split(",") if h)
    if not sentinels:
        raise ValueError("a Sentinel URL names at least one sentinel host:port")
    service, _, db = path.strip("/").partition("/")
    if not service:
        raise ValueError("a Sentinel URL names the service after the hosts: .../service_name")
    options = parse_qsl(query, keep_blank_values=True)
    own = {k: v for k, v in options if k in _SENTINEL_ONLY}
    rest_query = urlencode([(k, v) for k, v in options if k not in _SENTINEL_ONLY])
    # redis-py reads credentials, db and TLS options from a plain URL: give it one.
    plain = f"{'rediss' if tls else 'redis'}://{userinfo + '@' if at else ''}sentinel/"
    node: dict[str, Any] = dict(
        parse_url(plain + (db or "0") + (f"?{rest_query}" if rest_query else ""))
    )
    for key in ("host", "port", "connection_class"):
        node.pop(key, None)
    tls_options = {k: v for k, v in node.items() if k.startswith("ssl")}
    if tls:
        node["ssl"] = True  # the Sentinel pool picks its TLS connection class from it
    sentinel: dict[str, Any] = {**tls_options, **({"ssl": True} if tls else {})}
    if own.get("sentinel_username"):
        sentinel["username"] = own["sentinel_username"]
    if own.get("sentinel_password"):
        sentinel["password"] = own["sentinel_password"]
    return SentinelUrl(sentinels, unquote(service), node, sentinel)


def _host_port(text: str) -> tuple[str, int]:
    if text.startswith("["):  # [IPv6]:port
        host, _, port = text[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    if not host:
        raise ValueError("a sentinel host is empty")
    try:
        number = int(port) if port else _SENTINEL_PORT
    except ValueError:
        raise ValueError("a sentinel port is not a number") from None
    if not 0 < number < 65536:
        raise ValueError("a sentinel port is out of range")
    return host, number


def open_redis(url: str, **options: Any) -> Redis:
    """A client for `url` with redis-py's client `options` (timeouts, retry, health checks);
    for a Sentinel URL, the client of the service's current primary. Connects lazily."""
    if url.partition("://")[0].lower() not in SENTINEL_SCHEMES:
        return Redis.from_url(url, **options)
    parsed = parse_sentinel_url(url)
    timeouts = {k: v for k, v in options.items() if k.startswith("socket_")}
    sentinel = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]  # typed from redis-py 8
        parsed.sentinels, sentinel_kwargs={**timeouts, **parsed.sentinel}, **parsed.node
    )
    client: Redis = sentinel.master_for(parsed.service, redis_class=Redis, **options)
    return client


def open_clients(url: str, timeout_s: float) -> tuple[Redis, Redis]:
    """The two clients every Redis user of pdgate's keeps: one for calls, with one quick
    retry (it covers a pooled connection left dead by a Redis restart; more would only
    stretch every call against a server that is really down), and one for pub/sub, with
    none (a silent reconnect would hide that events were lost, and the consumer must know so
    that it re-polls). Both give up on a socket after `timeout_s`."""
    common: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "health_check_interval": _HEALTH_CHECK_INTERVAL_S,
    }
    calls = open_redis(url, retry=Retry(ExponentialBackoff(cap=0.1, base=0.02), 1), **common)
    return calls, open_redis(url, retry=Retry(NoBackoff(), 0), **common)
