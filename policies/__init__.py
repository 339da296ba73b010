"""Routing policies, chosen by name from configuration.

A name is either a built-in (below) or ``"package.module:factory"`` for a policy that lives
outside pdgate; either way the gateway code never changes to add one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from policies.affinity_sse import AffinitySSE
from policies.backoff import ConstantBackoff, ExponentialBackoff
from policies.base import Backoff, DecodePolicy, InstanceLoad, PrefillPolicy, RequestInfo
from policies.least_loaded import LeastLoaded
from policies.least_sse import LeastSSE
from policies.power_of_two import PowerOfTwo
from policies.round_robin import RoundRobin

PREFILL_POLICIES: Mapping[str, Callable[..., PrefillPolicy]] = {
    "least_sse": LeastSSE,
    "affinity_sse": AffinitySSE,
    "round_robin": RoundRobin,
    "power_of_two": PowerOfTwo,
}

DECODE_POLICIES: Mapping[str, Callable[..., DecodePolicy]] = {
    "least_loaded": LeastLoaded,
    "least_sse": LeastSSE,
    "round_robin": RoundRobin,
    "power_of_two": PowerOfTwo,
}


def _resolve(
    name: str, builtins: Mapping[str, Callable[..., Any]], kind: str, options: Mapping[str, Any]
) -> Any:
    if name in builtins:
        factory = builtins[name]
    elif ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"cannot load {kind} policy {name!r}: {exc}") from exc
    else:
        known = ", ".join(sorted(builtins))
        raise ValueError(f"unknown {kind} policy {name!r}; built-in: {known}, or 'module:factory'")
    try:
        return factory(**options)
    except TypeError as exc:
        raise ValueError(f"bad options for {kind} policy {name!r}: {exc}") from exc


def load_prefill_policy(name: str, options: Mapping[str, Any] | None = None) -> PrefillPolicy:
    policy: PrefillPolicy = _resolve(name, PREFILL_POLICIES, "prefill", options or {})
    return policy


def load_decode_policy(name: str, options: Mapping[str, Any] | None = None) -> DecodePolicy:
    policy: DecodePolicy = _resolve(name, DECODE_POLICIES, "decode", options or {})
    return policy


__all__ = [
    "DECODE_POLICIES",
    "PREFILL_POLICIES",
    "Backoff",
    "ConstantBackoff",
    "DecodePolicy",
    "ExponentialBackoff",
    "InstanceLoad",
    "PrefillPolicy",
    "RequestInfo",
    "load_decode_policy",
    "load_prefill_policy",
]
