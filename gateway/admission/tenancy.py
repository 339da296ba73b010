"""Whose request it is and how urgent: the tenant, priority class and share weight the
gateway-held queue orders by (gateway/placement/queue.py).

**Tenant.** With client keys on, the API key's name (``name=`` in the key file): a header
naming another tenant is refused (403), so a key cannot spend another tenant's share. With
keys off, the ``x-pdgate-tenant`` header (1 to 64 characters: letters, digits and
``. _ - : @``; anything else is a 400), else ``anonymous``: a gateway without keys trusts
whatever sits in front of it (docs/security.md).

**Priority class** (0 ``high``, 1 ``normal``, 2 ``low``), in this order:

1. the request's default: its scenario group's ``priority`` when its rule sets one, else its
   key's ``priority`` (keys on), else ``normal``;
2. ``x-pdgate-priority: high|normal|low`` (or 0-2) may lower it to anything, and raise it
   only up to the most urgent of that default and what its key allows (``priority=`` in the
   key file); with keys off, up to ``keyless_max_priority`` (default ``normal``). Asking for
   more is a 403, an unknown value a 400.

**Weight**: the key's ``weight=`` (its share of the queue and of the token fairness), 1
without keys.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from pdgate.gateway.admission.auth import PRIORITIES, ApiKey, parse_priority
from pdgate.gateway.errors import BadRequest, Forbidden

__all__ = ["PRIORITY_HEADER", "TENANT_HEADER", "Tenancy", "resolve_tenancy"]

TENANT_HEADER = "x-pdgate-tenant"
PRIORITY_HEADER = "x-pdgate-priority"
ANONYMOUS = "anonymous"
_TENANT = re.compile(r"[A-Za-z0-9._:@-]{1,64}")
_NAMES = {number: name for name, number in PRIORITIES.items()}


@dataclass(frozen=True, slots=True)
class Tenancy:
    tenant: str
    priority: int
    weight: float


def resolve_tenancy(
    key: ApiKey | None,
    headers: Mapping[str, str],
    *,
    group_priority: int | None,
    keyless_max_priority: int,
) -> Tenancy:
    """The request's tenant, priority class and weight (see the module docstring). Raises
    `BadRequest` (a malformed header) or `Forbidden` (a header the key does not allow)."""
    asked_tenant = headers.get(TENANT_HEADER)
    if asked_tenant is not None and not _TENANT.fullmatch(asked_tenant):
        raise BadRequest(
            f"{TENANT_HEADER} must be 1 to 64 letters, digits or . _ - : @", param=TENANT_HEADER
        )
    if key is not None:
        if asked_tenant is not None and asked_tenant != key.name:
            raise Forbidden(
                f"this API key is tenant {key.name!r}; it may not act as {asked_tenant!r}",
                param=TENANT_HEADER,
            )
        tenant, weight = key.name, key.weight
    else:
        tenant, weight = asked_tenant or ANONYMOUS, 1.0
    default = group_priority if group_priority is not None else PRIORITIES["normal"]
    if group_priority is None and key is not None:
        default = key.priority
    raw = headers.get(PRIORITY_HEADER)
    if raw is None:
        return Tenancy(tenant, default, weight)
    try:
        asked = parse_priority(raw.strip().lower())
    except ValueError as exc:
        raise BadRequest(f"{PRIORITY_HEADER}: {exc}", param=PRIORITY_HEADER) from None
    allowed = min(default, key.priority if key is not None else keyless_max_priority)
    if asked < allowed:
        who = "this API key" if key is not None else "a request without an API key"
        raise Forbidden(
            f"{who} may ask for priority {_NAMES[allowed]!r} at most, not {_NAMES[asked]!r}",
            param=PRIORITY_HEADER,
        )
    return Tenancy(tenant, asked, weight)
