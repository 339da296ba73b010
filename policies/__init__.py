"""Routing policies, composed from named plugins in configuration.

A policy is a **profile** (a named list of filters, weighted scorers and a picker) with
optional overrides, or a whole ranker written by hand and named ``"package.module:factory"``.
Every plugin is named the same way: a built-in name below, or ``"package.module:factory"``
for one that lives outside pdgate. Adding one never touches gateway code
(docs/extending.md has a worked example).

Options (``prefill_policy_options`` / ``decode_policy_options``)::

    filters = ["not_ejected", "not_busy", "has_room"]       # replace the profile's filters
    scorers = {prefix_affinity = 1.0, open_streams = 0.2}   # replace its scorers and weights
    picker = "power_of_two"                                 # replace its picker
    hold = "expected_completion"                            # add (or "" to drop) a holder
    prefix_affinity = {load_guard = 4}                      # a plugin's keyword arguments
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pdgate.policies.base import (
    Filter,
    Holder,
    Picker,
    Policy,
    Ranker,
    Scorer,
)
from pdgate.policies.completion import ExpectedCompletion
from pdgate.policies.filters import HasRoom, Idle, NotBusy, NotEjected
from pdgate.policies.pickers import MaxScore, PowerOfTwo, RoundRobin
from pdgate.policies.scorers import (
    FreeRoom,
    Inflight,
    InflightTokens,
    Load,
    OpenStreams,
    PrecisePrefix,
    PrefixAffinity,
    PrefixHash,
)

FILTERS: Mapping[str, Callable[..., Filter]] = {
    "has_room": HasRoom,
    "idle": Idle,
    "not_busy": NotBusy,
    "not_ejected": NotEjected,
}
SCORERS: Mapping[str, Callable[..., Scorer]] = {
    "open_streams": OpenStreams,
    "inflight": Inflight,
    "inflight_tokens": InflightTokens,
    "load": Load,
    "free_room": FreeRoom,
    "prefix_affinity": PrefixAffinity,
    "precise_prefix": PrecisePrefix,
    "prefix_hash": PrefixHash,
}
PICKERS: Mapping[str, Callable[..., Picker]] = {
    "max_score": MaxScore,
    "round_robin": RoundRobin,
    "power_of_two": PowerOfTwo,
}
HOLDERS: Mapping[str, Callable[..., Holder]] = {
    "expected_completion": ExpectedCompletion,
}


@dataclass(frozen=True)
class Profile:
    filters: tuple[str, ...]
    scorers: Mapping[str, float]
    picker: str
    hold: str | None = None


# What may be tried at all: the same for every built-in profile and both legs.
DEFAULT_FILTERS = ("not_ejected", "not_busy", "has_room")

# The affinity profiles' weights: `_AFFINITY` scores this gateway's routing history,
# `_PRECISE` what the engines' KV events say they hold.
_AFFINITY = {"prefix_affinity": 1.0, "prefix_hash": 0.5, "open_streams": 0.1, "inflight": 0.001}
_PRECISE = {"precise_prefix": 1.0, "prefix_hash": 0.5, "open_streams": 0.1, "inflight": 0.001}

PROFILES: Mapping[str, Profile] = {
    # The paper's gateway: fewest open SSE streams; in-flight requests break ties.
    "least_sse": Profile(DEFAULT_FILTERS, {"open_streams": 1.0, "inflight": 0.01}, "max_score"),
    # Prefix-cache affinity first (with a load guard); for a prefix nobody has seen, the
    # prefill its hash names (the same at every gateway); open streams last.
    "affinity_sse": Profile(
        DEFAULT_FILTERS,
        _AFFINITY,
        "max_score",
    ),
    # affinity_sse that also pays under overload: a request whose prefix a busy prefill
    # holds waits for it when that is expected to finish sooner than a free prefill
    # computing the whole prompt (policies/completion.py).
    "affinity_hold": Profile(
        DEFAULT_FILTERS,
        _AFFINITY,
        "max_score",
        hold="expected_completion",
    ),
    # affinity_sse on what the engines report they hold (KV events, token-exact blocks,
    # evictions seen), the character history for engines that publish no events.
    "precise_sse": Profile(
        DEFAULT_FILTERS,
        _PRECISE,
        "max_score",
    ),
    # precise_sse that holds a request for the busy prefill holding its prefix, as
    # affinity_hold does.
    "precise_hold": Profile(
        DEFAULT_FILTERS,
        _PRECISE,
        "max_score",
        hold="expected_completion",
    ),
    # Token-work load (as SGLang's gateway and Dynamo balance): the least prompt work
    # computing (estimated tokens, credited at dispatch), open streams next, then requests.
    "least_tokens": Profile(
        DEFAULT_FILTERS,
        {"inflight_tokens": 1.0, "open_streams": 0.1, "inflight": 0.01},
        "max_score",
    ),
    "round_robin": Profile(DEFAULT_FILTERS, {}, "round_robin"),
    "power_of_two": Profile(DEFAULT_FILTERS, {"load": 1.0}, "power_of_two"),
    # Decode choice: the most free room, then the fewest open streams.
    "least_loaded": Profile(DEFAULT_FILTERS, {"free_room": 1.0, "open_streams": 0.01}, "max_score"),
}

_COMPOSITION = ("filters", "scorers", "picker", "hold")


def _factory(name: str, builtins: Mapping[str, Callable[..., Any]], kind: str) -> Any:
    if name in builtins:
        return builtins[name]
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            return getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"cannot load {kind} {name!r}: {exc}") from exc
    known = ", ".join(sorted(builtins))
    raise ValueError(f"unknown {kind} {name!r}; built-in: {known}, or 'package.module:factory'")


# What each kind of plugin must have (its Protocol in base.py), for the start-up check.
_CONTRACT = {
    "filter": (Filter, "name, needs and filter(request, candidates)"),
    "scorer": (Scorer, "name, needs and score(request, candidates)"),
    "picker": (Picker, "name, needs and order(request, candidates, scores)"),
    "holder": (Holder, "name, needs, scan and choose(now, busy, remaining_s=, held_s=)"),
    "policy": (Ranker, "name, needs, hold, rank(request, candidates) and describe()"),
}


def _build(name: str, builtins: Mapping[str, Callable[..., Any]], kind: str, kwargs: Any) -> Any:
    factory = _factory(name, builtins, kind)
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"options of {kind} {name!r} must be a table of keyword arguments")
    try:
        plugin = factory(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bad options for {kind} {name!r}: {exc}") from exc
    protocol, members = _CONTRACT[kind]
    if not isinstance(plugin, protocol):
        raise ValueError(f"{kind} {name!r} does not implement the {kind} contract: {members}")
    return plugin


def load_policy(name: str, options: Mapping[str, Any] | None = None) -> Ranker:
    """The policy `name` (a profile, or ``module:factory`` of a whole ranker) with `options`.

    Raises ValueError for unknown names or options: a typo fails at start-up, not on the
    first request."""
    options = dict(options or {})
    if name not in PROFILES:
        if ":" not in name:
            known = ", ".join(sorted(PROFILES))
            raise ValueError(f"unknown policy {name!r}; built-in: {known}, or 'module:factory'")
        ranker: Ranker = _build(name, {}, "policy", options)
        return ranker
    profile = PROFILES[name]
    filters = options.pop("filters", profile.filters)
    scorers = options.pop("scorers", profile.scorers)
    picker = options.pop("picker", profile.picker)
    hold = options.pop("hold", profile.hold) or None
    if not isinstance(filters, list | tuple) or not isinstance(scorers, Mapping):
        raise ValueError("policy options: filters is a list of names, scorers a table of weights")
    if hold is not None and not isinstance(hold, str):
        raise ValueError("policy options: hold is a holder's name")
    used = {*filters, *scorers, picker, *([hold] if hold else [])}
    unknown = sorted(k for k in options if k not in used)
    if unknown:
        raise ValueError(
            f"policy {name!r}: options {unknown} name no plugin of the policy; a plugin's "
            f"options go under its name (e.g. prefix_affinity = {{load_guard = 4}}), and "
            f"{', '.join(_COMPOSITION)} change the composition"
        )
    try:
        weights = [(s, float(w)) for s, w in scorers.items()]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"policy {name!r}: scorer weights must be numbers") from exc
    return Policy(
        name,
        [_build(f, FILTERS, "filter", options.get(f, {})) for f in filters],
        [(_build(s, SCORERS, "scorer", options.get(s, {})), w) for s, w in weights],
        _build(picker, PICKERS, "picker", options.get(picker, {})),
        None if hold is None else _build(hold, HOLDERS, "holder", options.get(hold, {})),
    )


def admit_idle(ranker: Ranker) -> Ranker:
    """`ranker` with the `idle` filter last (the prefill leg's ``prefill_admit = idle``); a
    ranker that is not a `Policy` (``module:factory``) is its own judge and stays as it is."""
    if not isinstance(ranker, Policy) or any(isinstance(f, Idle) for f in ranker.filters):
        return ranker
    return Policy(
        ranker.name, (*ranker.filters, Idle()), ranker.scorers, ranker.picker, ranker.hold
    )


__all__ = [
    "DEFAULT_FILTERS",
    "FILTERS",
    "HOLDERS",
    "PICKERS",
    "PROFILES",
    "SCORERS",
    "Profile",
    "admit_idle",
    "load_policy",
]
