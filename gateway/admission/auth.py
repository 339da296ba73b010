"""Client API keys, the admin token and per-key rate limits.

Keys are kept as SHA-256 digests only (a key file may hold digests, never needing the keys
themselves), looked up by digest, and never logged. A request presents its key as
``Authorization: Bearer <key>`` (what OpenAI's clients send); a wrong or missing key is a 401
with OpenAI's error body. The admin token is also accepted as HTTP Basic credentials (any
user name, the token as password), because a browser cannot send a Bearer header when it
navigates to ``/dashboard``; its 401 carries a Basic challenge so the browser asks for it.
A key may carry a name (the tenant, for logs, metrics and
fairness), a scenario group it is bound to, and a rate limit in requests per minute.

Key file: one key per line, ``<key or sha256:<hex digest>> [name=...] [group=...] [rpm=...]
[priority=high|normal|low] [weight=...]``;
``#`` starts a comment. ``pdgate keys hash`` prints the digest line for a key.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from starlette.responses import Response

from pdgate.config.server import is_loopback
from pdgate.gateway.admission.retry_after import RetryAfter
from pdgate.gateway.errors import Forbidden, RateLimited, Unauthorized

__all__ = [
    "ADMIN_CHALLENGE",
    "AdminUnauthorized",
    "ApiKey",
    "KeyRing",
    "basic_password",
    "bearer",
    "check_exposure",
    "digest",
    "parse_keys",
]


# What a 401 from an admin endpoint asks for: a browser then prompts for the admin token (as the
# password) and resends it, on the page and on the page's same-origin fetches.
ADMIN_CHALLENGE = 'Basic realm="pdgate"'


class AdminUnauthorized(Unauthorized):
    """A refused admin token: a 401 with a Basic challenge (RFC 7235 asks a 401 for one)."""

    def response(self) -> Response:
        response = super().response()
        response.headers["WWW-Authenticate"] = ADMIN_CHALLENGE
        return response


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def bearer(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def basic_password(authorization: str | None) -> str | None:
    """The password of an ``Authorization: Basic <base64(user:password)>`` header (the user
    name is ignored); None when the header is not well-formed Basic credentials."""
    if not authorization:
        return None
    scheme, _, encoded = authorization.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    _, colon, password = decoded.partition(":")
    return password if colon and password else None


PRIORITIES = {"high": 0, "normal": 1, "low": 2}


def parse_priority(value: str) -> int:
    """A priority class by name or number (0 most urgent); ValueError otherwise."""
    if value in PRIORITIES:
        return PRIORITIES[value]
    if value.isdigit() and int(value) <= max(PRIORITIES.values()):
        return int(value)
    raise ValueError(f"priority must be one of {', '.join(PRIORITIES)} (or 0-2)")


@dataclass(frozen=True, slots=True)
class ApiKey:
    name: str
    digest: bytes
    group: str | None = None
    rpm: int | None = None
    priority: int = PRIORITIES["normal"]
    weight: float = 1.0  # its share in the queue's fairness


def parse_keys(lines: Iterable[str], *, source: str = "keys") -> list[ApiKey]:
    """Keys from `lines` (see the module docstring). Raises ValueError naming the line."""
    keys: list[ApiKey] = []
    for number, raw in enumerate(lines, start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        secret, *options = line.split()
        fields: dict[str, str] = {}
        for option in options:
            name, sep, value = option.partition("=")
            if not sep or name not in ("name", "group", "rpm", "priority", "weight") or not value:
                raise ValueError(f"{source}:{number}: unknown option {name!r}")
            fields[name] = value
        if secret.startswith("sha256:"):
            try:
                key_digest = bytes.fromhex(secret.removeprefix("sha256:"))
            except ValueError:
                raise ValueError(f"{source}:{number}: the sha256 digest is not hex") from None
            if len(key_digest) != 32:
                raise ValueError(f"{source}:{number}: a sha256 digest has 64 hex digits")
        else:
            key_digest = digest(secret)
        rpm = fields.get("rpm")
        if rpm is not None and (not rpm.isdigit() or int(rpm) <= 0):
            raise ValueError(f"{source}:{number}: rpm must be a positive integer")
        try:
            priority = parse_priority(fields.get("priority", "normal"))
            weight = float(fields.get("weight", "1"))
        except ValueError as exc:
            raise ValueError(f"{source}:{number}: {exc}") from None
        if not 0 < weight <= 1000:
            raise ValueError(f"{source}:{number}: weight must be in (0, 1000]")
        keys.append(
            ApiKey(
                name=fields.get("name", f"key{len(keys) + 1}"),
                digest=key_digest,
                group=fields.get("group"),
                rpm=int(rpm) if rpm else None,
                priority=priority,
                weight=weight,
            )
        )
    return keys


class _Bucket:
    """A token bucket of `rpm` per minute, `rpm` deep (a minute's burst)."""

    __slots__ = ("_rate", "_tokens", "_updated", "capacity")

    def __init__(self, rpm: int) -> None:
        self.capacity = float(rpm)
        self._rate = rpm / 60.0
        self._tokens = float(rpm)
        self._updated = time.monotonic()

    def take(self) -> float:
        """0 if admitted, else seconds until a token is available."""
        now = time.monotonic()
        self._tokens = min(self.capacity, self._tokens + (now - self._updated) * self._rate)
        self._updated = now
        if self._tokens >= 1:
            self._tokens -= 1
            return 0.0
        return (1 - self._tokens) / self._rate


class KeyRing:
    """The gateway's client keys and admin token. Bounded: one bucket per configured key."""

    def __init__(self, keys: Iterable[ApiKey], admin_token: str | None = None) -> None:
        self._keys: Mapping[bytes, ApiKey] = {k.digest: k for k in keys}
        self._buckets = {k.digest: _Bucket(k.rpm) for k in self._keys.values() if k.rpm}
        self._admin = digest(admin_token) if admin_token else None

    @classmethod
    def load(cls, keys: Iterable[str], keys_file: Path | None, admin_token: str | None) -> KeyRing:
        parsed = parse_keys(keys, source="api_keys")
        if keys_file is not None:
            parsed += parse_keys(keys_file.read_text().splitlines(), source=str(keys_file))
        return cls(parsed, admin_token)

    @property
    def enabled(self) -> bool:
        """Whether clients must present a key."""
        return bool(self._keys)

    @property
    def has_admin(self) -> bool:
        return self._admin is not None

    def client(self, authorization: str | None) -> ApiKey | None:
        """The caller's key (None when keys are off). Raises `Unauthorized`."""
        if not self._keys:
            return None
        token = bearer(authorization)
        if token is None:
            raise Unauthorized(
                "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'."
            )
        key = self._keys.get(digest(token))
        if key is None:
            raise Unauthorized("Incorrect API key provided.")
        return key

    def admit(self, key: ApiKey | None, retry_after: RetryAfter) -> None:
        """Apply the key's rate limit. Raises `RateLimited` with Retry-After: until its
        bucket holds a token, and OpenAI's ``x-ratelimit-*`` headers for requests."""
        if key is None:
            return
        bucket = self._buckets.get(key.digest)
        if bucket is None:
            return
        wait = bucket.take()
        if wait > 0:
            seconds = retry_after.bounded(wait)
            raise RateLimited(
                f"Rate limit of {int(bucket.capacity)} requests per minute reached for "
                f"API key {key.name!r}.",
                retry_after=seconds,
                headers={
                    "x-ratelimit-limit-requests": str(int(bucket.capacity)),
                    "x-ratelimit-remaining-requests": "0",
                    "x-ratelimit-reset-requests": f"{seconds:g}s",
                },
            )

    def admin(self, authorization: str | None) -> None:
        """The admin token, for /admin/*, /dashboard (and /metrics when asked), as a Bearer
        token or as the password of Basic credentials. Without one configured, admin
        endpoints are open only when client keys are off too. Raises `AdminUnauthorized`."""
        if self._admin is None:
            if self._keys:
                raise Forbidden("admin endpoints are disabled: no admin token is configured")
            return
        token = bearer(authorization) or basic_password(authorization)
        # Digests of equal length, compared in constant time: nothing about the token leaks
        # through timing, whichever scheme carried it.
        if token is None or not hmac.compare_digest(digest(token), self._admin):
            raise AdminUnauthorized("this endpoint needs the admin token")


def check_exposure(host: str, *, keys: bool, allow_unauthenticated: bool) -> str | None:
    """Refuse (ValueError) to serve a non-loopback address without client keys unless that
    was asked for explicitly; a warning to log when it was."""
    if keys or is_loopback(host):
        return None
    if not allow_unauthenticated:
        raise ValueError(
            f"refusing to listen on {host} without client API keys: anyone who can reach it "
            "could use the fleet. Set api_keys or api_keys_file, or allow_unauthenticated = "
            "true if a proxy in front authenticates clients."
        )
    return f"listening on {host} WITHOUT client API keys (allow_unauthenticated = true)"
