"""What ``pdgate bench strategies`` compares: the same simulated GPUs served three ways.

* **aggregated** (NoDG): every GPU an aggregated instance (it prefills its requests in its
  running batch, chunked, and decodes them); the gateway queues, ranks by open streams and
  retries.
* **disaggregated** (FuDG, P/D-Serve): prefills and decodes at the split eq. 1 of P/D-Serve
  advises for the workload on the profile (`advised_split`, the ratio advice's own
  equation computed from the sim's timing model), the KV moved over the interconnect.
* **partial** (PaDG, EcoServe): the aggregated instances alternating prefill and decode
  phases at the shim, ranked by rolling activation at the gateway, held to the TPOT SLO.

Every request carries its scenario's TTFT deadline (as the scheduling bench's do) and one
TPOT SLO (`StrategiesPlan.tpot_slo_s`): success is both met. The interconnect only changes
what disaggregation moves, so aggregated and partial run once per workload and stand for
every interconnect (`transfers_kv`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pdgate.engine_shim.sim_profile import get_profile
from pdgate.loadtest.ratio.workload import split_of
from pdgate.loadtest.scheduling.modes import ClusterSpec, Mode, check_settings, mode_named
from pdgate.loadtest.scheduling.runner import Timing
from pdgate.loadtest.scheduling.workload import Workload, WorkloadSpec, workload_named

__all__ = [
    "STRATEGIES",
    "Shape",
    "StrategiesPlan",
    "advised_split",
    "transfers_kv",
]

STRATEGIES = ("aggregated", "disaggregated", "partial")
# The scheduling bench's mode each strategy is served by.
_MODES = {"aggregated": "aggregated", "disaggregated": "least_sse", "partial": "partial"}
_TAG_TOKENS = 6  # scheduling/workload.py: the unique tag between prefix and body
_BLOCK = 16  # prefix-cache block, tokens


def transfers_kv(strategy: str) -> bool:
    """Does the strategy move KV between instances (so the interconnect matters)?"""
    return strategy == "disaggregated"


def advised_split(
    spec: WorkloadSpec,
    profile_name: str,
    gpus: int,
    *,
    prefill_slots: int,
    decode_slots: int,
    kv_gbps: float | None,
) -> tuple[int, int]:
    """n_p : n_d for `gpus` by eq. 1 (n_p / n_d = (T_p / b_p) / (T_d / b_d)) from the sim
    profile, at each scenario's mean lengths weighted by its share of requests. A shared
    prefix counts as cached (the profile's cache holds every scenario's); a decode runs a
    full batch of `decode_slots`; T_d includes the KV transfer at `kv_gbps`."""
    profile = get_profile(profile_name)
    if kv_gbps is not None:
        profile = replace(profile, kv_bandwidth_bytes_s=kv_gbps * 1e9 / 8)
    total = sum(s.weight for s in spec.scenarios)
    t_p = t_d = 0.0
    for s in spec.scenarios:
        prompt = s.prefix_tokens + _TAG_TOKENS + (s.body_min + s.body_max) // 2
        cached = s.prefix_tokens // _BLOCK * _BLOCK
        share = s.weight / total
        t_p += share * profile.prefill_batch_s([(prompt, cached)] * prefill_slots) / prefill_slots
        step = profile.decode_step_s(decode_slots, decode_slots * (prompt + s.max_tokens // 2))
        t_d += share * (profile.kv_transfer_s(prompt) + s.max_tokens * step) / decode_slots
    return split_of(t_p / t_d, gpus)  # t_p / t_d: prefills needed per decode


@dataclass(frozen=True, slots=True)
class Shape:
    """One strategy's cluster for one workload and interconnect."""

    strategy: str
    workload: str
    kv_gbps: float | None  # None: no KV moves (aggregated, partial)
    spec: ClusterSpec
    mode: Mode

    @property
    def instances(self) -> str:
        s = self.spec
        if self.strategy == "disaggregated":
            return f"{s.prefills}P+{s.decodes}D"
        return f"{s.prefills + s.decodes}x{self.strategy}"


@dataclass(frozen=True, slots=True)
class StrategiesPlan:
    gpus: int = 8
    strategies: tuple[str, ...] = STRATEGIES
    workloads: tuple[str, ...] = ("mix", "long-prompt")
    interconnects_gbps: tuple[float, ...] = (25.0, 400.0)  # Ethernet, an RDMA NIC per GPU
    loads: tuple[float, ...] = (0.5, 1.0, 1.5, 2.0)  # shares of each strategy's capacity
    seeds: tuple[int, ...] = (0, 1, 2)
    tpot_slo_s: float = 0.1
    sim_profile: str = "llama-3.1-8b-a100"
    slots: int = 64  # running sequences per decode or aggregated instance
    prefill_slots: int = 1  # P/D-Serve's rule: a prefill accepts when idle
    timing: Timing = field(default_factory=lambda: Timing(warmup_s=3.0, measure_s=20.0))
    # Capacity (EcoServe's goodput): the highest Poisson rate at which `attainment_target`
    # of the requests meet both SLOs. Found on one cluster by doubling from `start_rps`
    # per GPU until a rate misses, then `bisections` halvings of the interval.
    attainment_target: float = 0.9
    start_rps: float = 0.5
    bisections: int = 3
    sweep_timing: Timing = field(default_factory=lambda: Timing(warmup_s=3.0, measure_s=12.0))
    max_in_flight: int = 512  # the open loop's bound: arrivals beyond it fail as dropped

    def __post_init__(self) -> None:
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown or not self.strategies:
            raise ValueError(f"strategies: some of {', '.join(STRATEGIES)}")
        if self.gpus < 2:
            raise ValueError("at least 2 GPUs (one prefill and one decode)")
        if not self.workloads or not self.interconnects_gbps or not self.loads or not self.seeds:
            raise ValueError("a plan needs a workload, an interconnect, a load and a seed")
        if min(self.loads) <= 0 or min(self.interconnects_gbps) <= 0 or self.tpot_slo_s <= 0:
            raise ValueError("loads, interconnects and the TPOT SLO must be positive")
        if self.slots < 1 or self.prefill_slots < 1 or self.max_in_flight < 1:
            raise ValueError("slots and the in-flight bound must be at least 1")
        if not 0 < self.attainment_target <= 1 or self.start_rps <= 0 or self.bisections < 0:
            raise ValueError("capacity search: a target in (0, 1], a positive start rate")
        for name in self.workloads:
            workload_named(name)
        get_profile(self.sim_profile)

    def workload_for(self, name: str, seed: int) -> Workload:
        """The workload's prompts with every scenario held to the plan's TPOT SLO."""
        spec = workload_named(name)
        scenarios = [replace(s, tpot_slo_s=self.tpot_slo_s) for s in spec.scenarios]
        return Workload(scenarios, seed=seed, tenants=spec.tenants)

    def shapes(self, workload: str) -> list[Shape]:
        """Every strategy's cluster for `workload`: one per interconnect where KV moves."""
        out: list[Shape] = []
        for strategy in self.strategies:
            links: tuple[float | None, ...] = (
                self.interconnects_gbps if transfers_kv(strategy) else (None,)
            )
            out.extend(self.shape(strategy, workload, link) for link in links)
        return out

    def shape(self, strategy: str, workload: str, kv_gbps: float | None) -> Shape:
        base = ClusterSpec(
            sim_profile=self.sim_profile,
            decode_capacity=self.slots,
            prefill_capacity=self.prefill_slots,
            prefix_cache_blocks=None,  # the profile's: what the GPU's memory leaves
        )
        if transfers_kv(strategy):
            p, d = advised_split(
                workload_named(workload), self.sim_profile, self.gpus,
                prefill_slots=self.prefill_slots, decode_slots=self.slots, kv_gbps=kv_gbps,
            )  # fmt: skip
            spec = replace(base, prefills=p, decodes=d)
        else:
            spec = replace(base, prefills=self.gpus, decodes=0)
        mode = mode_named(_MODES[strategy])
        shim: dict[str, object] = {}
        if kv_gbps is not None:
            shim["sim_kv_bandwidth_gbps"] = kv_gbps
        if strategy == "partial":
            shim["tpot_slo_s"] = self.tpot_slo_s
            mode = replace(mode, gateway={**mode.gateway, "tpot_slo_s": self.tpot_slo_s})
        mode = replace(
            mode, name=strategy, prefill={**mode.prefill, **shim}, decode={**mode.decode, **shim}
        )
        return Shape(strategy, workload, kv_gbps, spec, mode)

    def check(self) -> None:
        """Every cluster's settings build (ValueError before anything starts otherwise)."""
        for workload in self.workloads:
            for shape in self.shapes(workload):
                check_settings(shape.spec, shape.mode)
