"""The ratio benchmark's two workloads, its cluster shape, and what eq. 1 predicts for them.

Two shapes at the two ends of P/D-Serve's scenarios (section 3.3: the best ratio differs by
scenario), each a single scenario so the gateway's advice is about one shape:

* **prompt-heavy**: long prompts (3,584-4,608 tokens, whose prefill is most of the work), short
  outputs (32 tokens): a summarisation or retrieval-augmented question;
* **decode-heavy**: short prompts (128-256 tokens), long outputs (512 tokens): chat or code
  generation.

Prompts are unique from their first block (``prefix_tokens=0``: the request's random tag
comes first), so no prefix cache hit changes a prefill's cost. The sim profile is the
calibrated ``llama-3.1-8b-a100`` one, untouched.

`model_ratio` is eq. 1 computed from that profile's timing model rather than measured: what
the advice should approach, given the shapes and the slots. It is the benchmark's
independent check of the gateway's measurements.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdgate.engine_shim.sim_profile import get_profile
from pdgate.loadtest.scheduling.workload import Scenario

__all__ = [
    "DECODE_HEAVY",
    "PROMPT_HEAVY",
    "QUICK_WORKLOADS",
    "WORKLOADS",
    "Shape",
    "Workload",
    "model_ratio",
    "split_of",
    "workload_named",
]


@dataclass(frozen=True, slots=True)
class Shape:
    """The cluster every run uses; only the prefill:decode split changes between runs."""

    instances: int = 8
    gateways: int = 1
    sim_profile: str = "llama-3.1-8b-a100"
    # One slot per prefill: P/D-Serve's rule (a prefill accepts only when idle), as in the
    # scheduling benchmark; eq. 1's b_p = 1.
    prefill_capacity: int = 1
    # Four running sequences per decode: few enough that a small test box can relay every
    # decode-bound run's SSE events next to the servers. A real decode runs far larger
    # batches; eq. 1 scales with b_d either way.
    decode_capacity: int = 4
    kv_wire_fraction: float = 1 / 131072  # transfer time still modelled at full size

    def __post_init__(self) -> None:
        if self.instances < 2 or self.gateways < 1:
            raise ValueError("at least 2 instances (one of each role) and 1 gateway")


@dataclass(frozen=True, slots=True)
class Workload:
    scenario: Scenario
    # Closed-loop users: enough to saturate the bottleneck of the best split of 8 (a
    # queue of waiting users beyond its slots), so goodput measures capacity.
    users: int

    @property
    def name(self) -> str:
        return self.scenario.name


PROMPT_HEAVY = Workload(
    Scenario("prompt_heavy", prefix_tokens=0, body_min=3584, body_max=4608, max_tokens=32,
             ttft_deadline_s=4.0),
    users=14,
)  # fmt: skip
DECODE_HEAVY = Workload(
    Scenario("decode_heavy", prefix_tokens=0, body_min=128, body_max=256, max_tokens=512,
             ttft_deadline_s=2.0),
    users=36,
)  # fmt: skip
WORKLOADS: tuple[Workload, ...] = (PROMPT_HEAVY, DECODE_HEAVY)
# `--quick`: the same two shapes at half the length (eq. 1 still advises 7:1 and 1:7), so a
# few seconds of window hold the 20 measurements the advice needs.
QUICK_WORKLOADS: tuple[Workload, ...] = (
    Workload(Scenario("prompt_heavy", prefix_tokens=0, body_min=1536, body_max=2560,
                      max_tokens=16, ttft_deadline_s=3.0), users=14),
    Workload(Scenario("decode_heavy", prefix_tokens=0, body_min=128, body_max=256,
                      max_tokens=128, ttft_deadline_s=2.0), users=36),
)  # fmt: skip


def workload_named(name: str, *, quick: bool = False) -> Workload:
    for w in QUICK_WORKLOADS if quick else WORKLOADS:
        if w.name == name:
            return w
    raise ValueError(f"unknown workload {name!r}; known: {', '.join(w.name for w in WORKLOADS)}")


_TAG_TOKENS = 6  # scheduling/workload.py: the unique tag before the body


def model_ratio(workload: Workload, shape: Shape) -> dict[str, float]:
    """Eq. 1 from the sim profile's timing model, at the workload's mean lengths: T_p (one
    prompt alone; b_p = 1), T_d = KV transfer + G x decode step at a full batch of b_d
    sequences of mean context, each side's requests/s per instance, and the ratio
    n_p / n_d = (T_p / b_p) / (T_d / b_d)."""
    s = workload.scenario
    profile = get_profile(shape.sim_profile)
    prompt = s.prefix_tokens + _TAG_TOKENS + (s.body_min + s.body_max) // 2
    t_p = profile.prefill_batch_s([(prompt, 0)] * shape.prefill_capacity)
    b_d = shape.decode_capacity
    step = profile.decode_step_s(b_d, b_d * (prompt + s.max_tokens // 2))
    t_d = profile.kv_transfer_s(prompt) + s.max_tokens * step
    per_p = shape.prefill_capacity / t_p
    per_d = b_d / t_d
    return {"t_prefill_s": t_p, "t_decode_s": t_d, "per_prefill_rps": per_p,
            "per_decode_rps": per_d, "ratio": per_d / per_p}  # fmt: skip


def split_of(ratio: float, instances: int) -> tuple[int, int]:
    """The advised n_p / n_d as whole instances summing to `instances`, each role at least 1:
    n_p = round(N r / (1 + r))."""
    if ratio <= 0 or instances < 2:
        raise ValueError("a positive ratio and at least 2 instances")
    prefills = min(instances - 1, max(1, round(instances * ratio / (1 + ratio))))
    return prefills, instances - prefills
