"""What is compared: the paper's baseline and on-demand forwarding, on one cluster shape.

* ``baseline``: P/D-Serve's "original version" (section 4, Fig. 14a): every prefill has a
  local FIFO queue (shim ``admission=queue``) and the gateway sends each request once to the
  prefill with the fewest open SSE streams (``dispatch=direct``, ``least_sse``), no retry.
* ``least_sse``: on-demand forwarding (section 3.5): queue-less prefills that answer 429 when
  full (``admission=reject``), a gateway-held queue with retries until the deadline
  (``dispatch=queue``), prefills ranked by open SSE streams.
* ``affinity_sse``: the same, with prefills ranked by prefix-cache affinity first.
* ``router_*`` (issue 5, item 5): the same queue-less prefills behind vllm-router instead of
  pdgate (loadtest/router.py), with one of its policies and retries on. The router does not
  know the requests' deadlines; the client judges every mode by the same rule.

`ClusterSpec` is everything else, identical for every mode.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["EXTRA_MODES", "MODES", "ROUTER_MODES", "ClusterSpec", "Mode", "mode_named"]


@dataclass(frozen=True, slots=True)
class Mode:
    name: str
    admission: str  # ShimSettings.admission of the prefills
    dispatch: str  # GatewaySettings.dispatch
    prefill_policy: str
    queue_order: str = "edf"  # GatewaySettings.queue_order (dispatch=queue only)
    # Who fronts the cluster: "pdgate", or "vllm_router" with `router_policy` (the cluster's
    # own gateway then only serves the readiness check).
    front: str = "pdgate"
    router_policy: str = ""


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


def _router_mode(policy: str) -> Mode:
    return Mode(
        f"router_{policy}",
        admission="reject",
        dispatch="queue",
        prefill_policy="least_sse",
        front="vllm_router",
        router_policy=policy,
    )


# vllm-router's prefix-aware policy (its default), its load-aware one, and round robin.
ROUTER_MODES: tuple[Mode, ...] = tuple(
    _router_mode(p) for p in ("cache_aware", "power_of_two", "round_robin")
)


def mode_named(name: str) -> Mode:
    for mode in (*MODES, *EXTRA_MODES, *ROUTER_MODES):
        if mode.name == name:
            return mode
    known = ", ".join(m.name for m in (*MODES, *EXTRA_MODES, *ROUTER_MODES))
    raise ValueError(f"unknown mode {name!r}; known: {known}")


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """One simulated P/D cluster (gateway + prefills + decodes in one child process)."""

    model: str = "sim-llama-3.1-8b"
    sim_profile: str = "llama-3.1-8b-a100"
    gateways: int = 1  # behind a round-robin balancer (the paper's MSG layer), one view each
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
    # Prefix-cache blocks (16 tokens) per prefill; None keeps the profile's value. The
    # profile's timing constants are never changed, only how much HBM is left for the cache.
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
