"""What is compared: the paper's baseline and on-demand forwarding, on one cluster shape.

* ``baseline``: P/D-Serve's "original version" (section 4, Fig. 14a): every prefill has a
  local FIFO queue (shim ``admission=queue``) and the gateway sends each request once to the
  prefill with the fewest open SSE streams (``dispatch=direct``, ``least_sse``), no retry.
* ``least_sse``: on-demand forwarding (section 3.5): queue-less prefills that answer 429 when
  full (``admission=reject``), a gateway-held queue with retries until the deadline
  (``dispatch=queue``), prefills ranked by open SSE streams.
* ``affinity_sse``: the same, with prefills ranked by prefix-cache affinity first.
* ``least_tokens``, ``affinity_overload``, ``first_token_early``, ``local_prefill``,
  ``least_sse_guard``, ``least_sse_q10``, ``least_sse_q50``, ``least_sse_q90``,
  ``least_sse_room``, ``least_sse_ra1``, ``least_sse_place``:
  on-demand forwarding with one of the gateway's newer features on, each a `Mode` whose
  `Mode.gateway` (and, if needed, `Mode.prefill` / `Mode.decode`) overrides settings.
* ``router_*``: the same queue-less prefills behind vllm-router instead of
  pdgate (loadtest/lib/router.py), with one of its policies and retries on. The router does
  not know the requests' deadlines; the client judges every mode by the same rule.
* ``smg_*``: behind SMG in its vLLM P/D mode, its prefill admission queue on: at most the
  prefills' slots in flight on each, the rest waiting in SMG up to the gateway's TTFT
  timeout (``gateway_ttft_timeout_s``); its prefix-aware policy, its load-aware one, or
  round robin for the prefills (its default, prefix-aware, for the decodes).

`ClusterSpec` is everything else, identical for every mode; `shim_fields` and
`gateway_fields` turn both into the servers' settings, the same for either deployment
(in-process or separate processes). `check_settings` builds those settings once in the
benchmark's own process, so a setting the servers do not know (a feature not merged yet, a
typo) fails the run before any cluster starts rather than at its first start-up.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from pdgate.config import GatewaySettings, Role, ShimSettings
from pdgate.policies import load_policy

__all__ = [
    "EXTRA_MODES",
    "FEATURE_MODES",
    "MODES",
    "ROUTER_MODES",
    "ClusterSpec",
    "Mode",
    "check_settings",
    "gateway_fields",
    "mode_named",
    "shim_fields",
    "shim_role",
]


@dataclass(frozen=True, slots=True)
class Mode:
    name: str
    admission: str  # ShimSettings.admission of the prefills
    dispatch: str  # GatewaySettings.dispatch
    prefill_policy: str
    queue_order: str = "edf"  # GatewaySettings.queue_order (dispatch=queue only)
    # Who fronts the cluster: "pdgate", or "vllm_router" or "smg" with `router_policy` (the
    # cluster's own gateway then only serves the readiness check).
    front: str = "pdgate"
    router_policy: str = ""
    # Overrides of GatewaySettings / the prefills' / the decodes' ShimSettings fields, applied
    # last (after the cluster's): what makes a feature's mode one line.
    gateway: Mapping[str, Any] = field(default_factory=dict)
    prefill: Mapping[str, Any] = field(default_factory=dict)
    decode: Mapping[str, Any] = field(default_factory=dict)
    # "aggregated": the cluster's prefills and decodes all start as aggregated instances (as
    # many, each computing prompts and decoding them, with the decodes' slots): the same
    # hardware served the other way; "partial": those, alternating phases (docs/strategies.md).
    strategy: str = "disaggregated"

    @property
    def queued(self) -> bool:
        """Does pdgate's gateway queue and forward on demand (so batch forwarding applies)?"""
        return self.front == "pdgate" and self.dispatch == "queue"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Mode:
        return cls(**data)


# Every prefill publishes its KV events, on a free port of its own.
_PUBLISH_KV_EVENTS = {"kv_events_port": 0}


def _on_demand(name: str, policy: str = "least_sse", **gateway: Any) -> Mode:
    """On-demand forwarding (queue-less prefills, gateway-held EDF queue) with `gateway`."""
    return Mode(name, admission="reject", dispatch="queue", prefill_policy=policy,
                gateway=gateway)  # fmt: skip


MODES: tuple[Mode, ...] = (
    Mode("baseline", admission="queue", dispatch="direct", prefill_policy="least_sse"),
    Mode("least_sse", admission="reject", dispatch="queue", prefill_policy="least_sse"),
    Mode("affinity_sse", admission="reject", dispatch="queue", prefill_policy="affinity_sse"),
)
# Not in the default comparison: on-demand forwarding with the gateway's default FIFO queue,
# to show what ordering the one mixed-scenario queue by deadline contributes.
EXTRA_MODES: tuple[Mode, ...] = (
    Mode(
        "least_sse_fifo",
        admission="reject",
        dispatch="queue",
        prefill_policy="least_sse",
        queue_order="fifo",
    ),
)


# The gateway's issue-12 features, one mode each (not in the default comparison).
FEATURE_MODES: tuple[Mode, ...] = (
    _on_demand("least_tokens", "least_tokens"),  # queued + in-flight prompt tokens
    # affinity_sse that holds a request for the busy prefill holding its prefix when that is
    # expected to finish sooner than a free prefill computing it all (policies/completion.py).
    _on_demand("affinity_overload", "affinity_hold"),
    # affinity_sse on what the prefills' own KV events say they hold (docs/kv-events.md).
    replace(_on_demand("precise_sse", "precise_sse"), prefill=_PUBLISH_KV_EVENTS),
    # The same, holding a request for the busy prefill that holds its prefix.
    replace(_on_demand("precise_hold", "precise_hold"), prefill=_PUBLISH_KV_EVENTS),
    _on_demand("first_token_early", first_token_early=True),
    _on_demand("local_prefill", local_prefill_max_uncached_chars=4000),
    # least_sse with the queue's start guard (a request about to be late goes first).
    _on_demand("least_sse_guard", queue_guard_s=0.5),
    # least_sse whose early drop uses the median prefill estimate instead of the 10% quantile.
    _on_demand("least_sse_q50", prefill_estimate_quantile=0.5),
    _on_demand("least_sse_q90", prefill_estimate_quantile=0.9),
    _on_demand("least_sse_q10", prefill_estimate_quantile=0.1),
    # least_sse that sends a prefill requests whenever it has a free slot, not only when idle
    # (`prefill_admit = room`, the former default): with several slots a prefill,
    # requests then wait inside busy prefills, out of the gateway's deadline order.
    _on_demand("least_sse_room", prefill_admit="room"),
    # least_sse whose every 503 and 429 says `Retry-After: 1`, as gateways commonly do,
    # against the computed one (docs/scheduling.md, "Retry-After").
    _on_demand("least_sse_ra1", retry_after_s=1.0, retry_after_max_s=1.0),
    # least_sse that keeps a refused request's place for its retry (`retry_keeps_place`).
    _on_demand("least_sse_place", retry_keeps_place=True),
    # The same instances aggregated: each request whole to one instance, from the queue.
    Mode(
        "aggregated",
        admission="reject",
        dispatch="queue",
        prefill_policy="least_sse",
        strategy="aggregated",
    ),
    Mode(
        "partial",
        admission="reject",
        dispatch="queue",
        prefill_policy="least_sse",
        prefill={"phases": True},
        decode={"phases": True},
        strategy="partial",
    ),
)


def _router_mode(policy: str) -> Mode:
    return Mode(
        f"router_{policy}",
        admission="reject",
        dispatch="queue",
        prefill_policy="least_sse",
        front="vllm_router",
        router_policy=policy,
    )


def _smg_mode(policy: str) -> Mode:
    return replace(_router_mode(policy), name=f"smg_{policy}", front="smg")


# vllm-router's prefix-aware policy (its default), its load-aware one, and round robin; SMG's
# prefix-aware, least-load and round-robin prefill policies.
ROUTER_MODES: tuple[Mode, ...] = (
    *(_router_mode(p) for p in ("cache_aware", "power_of_two", "round_robin")),
    *(_smg_mode(p) for p in ("cache_aware", "least_load", "round_robin")),
)


def mode_named(name: str) -> Mode:
    every = (*MODES, *EXTRA_MODES, *FEATURE_MODES, *ROUTER_MODES)
    for mode in every:
        if mode.name == name:
            return mode
    raise ValueError(f"unknown mode {name!r}; known: {', '.join(m.name for m in every)}")


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """One simulated P/D cluster: gateways, prefills and decodes."""

    model: str = "sim-llama-3.1-8b"
    sim_profile: str = "llama-3.1-8b-a100"
    # Users are split evenly across them (user i sends to gateway i mod N), as a load
    # balancer in front of a fleet would; they share the registry and nothing else.
    gateways: int = 1
    prefills: int = 8
    # One decode, as the decode is never the bottleneck here: its larger batch makes each
    # token step (and so each SSE stream) longer, which is what P/D-Serve says makes the
    # open-stream count a poor sign of a prefill's load.
    decodes: int = 1
    # Slots per prefill. 1: a prefill accepts only when idle, P/D-Serve's rule ("if the
    # prefill is idle, it accepts new requests"); with more, a busy prefill still accepts and
    # the request waits in its engine behind the running batch (a small local queue).
    prefill_capacity: int = 1
    decode_capacity: int = 256  # running sequences per decode: never the bottleneck
    # Prefix-cache blocks (16 tokens) per prefill (ShimSettings.sim_prefix_cache_blocks);
    # None keeps the profile's value. The profile's timing constants are never changed, only
    # how much HBM is left for the cache.
    prefix_cache_blocks: int | None = 192
    # Bytes actually sent per KV token relative to the real size (transfer time is still
    # modelled at full size): the smallest value, so two CPU cores are not spent on KV bytes.
    kv_wire_fraction: float = 1 / 131072
    local_queue_size: int = 1024  # baseline prefills' local queue bound: never the limit
    gateway_ttft_timeout_s: float = 10.0  # upper bound; requests shorten it by header
    gateway: dict[str, Any] = field(default_factory=dict)  # extra GatewaySettings fields

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ClusterSpec:
        return cls(**data)


def shim_role(mode: Mode, role: str) -> str:
    """The role a `role` ("prefill" or "decode") place of the cluster starts in under `mode`."""
    return role if mode.strategy == "disaggregated" else "aggregated"


def shim_fields(spec: ClusterSpec, mode: Mode, role: str) -> dict[str, Any]:
    """ShimSettings fields of a `role` ("prefill" or "decode") instance, role itself aside
    (`shim_role`)."""
    decodes = role == "decode" or mode.strategy != "disaggregated"
    fields: dict[str, Any] = {
        "model": spec.model,
        "sim_profile": spec.sim_profile,
        "capacity": spec.decode_capacity if decodes else spec.prefill_capacity,
        "admission": mode.admission,
        "local_queue_size": spec.local_queue_size,
        "sim_kv_wire_fraction": spec.kv_wire_fraction,
    }
    if spec.prefix_cache_blocks is not None:
        fields["sim_prefix_cache_blocks"] = spec.prefix_cache_blocks
    return {**fields, **(mode.prefill if role == "prefill" else mode.decode)}


def gateway_fields(spec: ClusterSpec, mode: Mode) -> dict[str, Any]:
    """GatewaySettings fields of every gateway of the cluster."""
    return {
        "dispatch": mode.dispatch,
        "prefill_policy": mode.prefill_policy,
        "queue_order": mode.queue_order,
        "ttft_timeout_s": spec.gateway_ttft_timeout_s,
        **spec.gateway,
        **mode.gateway,
    }


def check_settings(spec: ClusterSpec, mode: Mode) -> None:
    """Build every server's settings and the gateway's policies for `mode` on `spec`, as the
    servers will; ValueError naming the mode and the setting if any is unknown or invalid."""
    try:
        gateway = GatewaySettings(**gateway_fields(spec, mode))
        for role in (Role.PREFILL, Role.DECODE):
            ShimSettings(role=shim_role(mode, role.value), **shim_fields(spec, mode, role.value))
        load_policy(gateway.prefill_policy, gateway.prefill_policy_options)
        load_policy(gateway.decode_policy, gateway.decode_policy_options)
    except ValueError as exc:  # pydantic's ValidationError is one
        raise ValueError(f"mode {mode.name}: its settings do not start a server: {exc}") from None
