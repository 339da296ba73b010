"""Sizing a heterogeneous P/D fleet (seed 002, section III-C): per role, the GPU type,
parallelism and instance count that meet the SLOs at the target rate for the least money.

**Prefill** (its eq. 1-3): an instance of GPU type g with (TP, PP) computes one prompt at a
time (P/D-Serve's rule), so its service time is the roofline's prefill time of the longest
prompt and it serves PP / service requests a second. The gateway's shared queue in front of
n prefills is an M/D/n queue; its wait is bounded by the M/M/n one (Erlang C, whose tail is
exponential: the wait exceeded by 1% of requests). TTFT at the 99th percentile = that wait
+ the longest prompt's prefill + its KV transfer over the slower NIC of the pair + one
decode step; n is the fewest prefills that keep it within `TTFT_MARGIN` of the TTFT SLO.

**Decode** (its eq. 4-6): the largest batch b whose step (the roofline's, at the workload's
mean context) stays within `TPOT_MARGIN` of the TPOT SLO and whose KV fits beside the
weights; an instance then serves PP x b / (output tokens x step) requests a second, and
n is the fewest that serve the rate at `DECODE_UTILIZATION`.

The plan is the cheapest (prefill option, decode option) pair that fits the GPUs on offer
(one pool where both roles use the same type). Cost per million tokens counts prompt and
output tokens. First-order, as the roofline is: `pdgate plan --verify` runs the plan.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pdgate.engine_shim.hardware import (
    Gpu,
    ModelSpec,
    Parallel,
    get_gpu,
    get_model,
    kv_capacity_tokens,
    profile_for,
)
from pdgate.engine_shim.sim_profile import SimProfile

__all__ = ["Offer", "Plan", "PlanInput", "RolePlan", "best_plans", "plan_fleet"]

TPOT_MARGIN = 0.8  # a full batch's step may take this share of the TPOT SLO
TTFT_MARGIN = 0.9  # the predicted TTFT p99 may take this share of the TTFT SLO
DECODE_UTILIZATION = 0.8  # decodes sized to run at this share of their batch
TTFT_QUANTILE = 0.99
PARALLEL = (Parallel(1), Parallel(2), Parallel(4), Parallel(8), Parallel(2, 2), Parallel(4, 2))
MAX_BATCH = 512


@dataclass(frozen=True, slots=True)
class Offer:
    gpu: str
    count: int
    price_per_hour: float

    def __post_init__(self) -> None:
        get_gpu(self.gpu)
        if self.count < 1 or self.price_per_hour < 0:
            raise ValueError(f"{self.gpu}: count >= 1 and a price >= 0")


@dataclass(frozen=True, slots=True)
class PlanInput:
    model: str
    rate_rps: float
    prompt_tokens: int  # mean
    prompt_spread: float  # prompts are uniform in mean x (1 +- spread)
    output_tokens: int
    ttft_slo_s: float
    tpot_slo_s: float
    offers: tuple[Offer, ...]

    def __post_init__(self) -> None:
        get_model(self.model)
        if self.rate_rps <= 0 or self.prompt_tokens < 1 or self.output_tokens < 2:
            raise ValueError("a positive rate, prompts of 1 token or more, outputs of 2 or more")
        if not 0 <= self.prompt_spread < 1 or self.ttft_slo_s <= 0 or self.tpot_slo_s <= 0:
            raise ValueError("prompt_spread in [0, 1), positive SLOs")
        if not self.offers or len({o.gpu for o in self.offers}) != len(self.offers):
            raise ValueError("offer each GPU type once")

    @property
    def longest_prompt(self) -> int:
        return math.ceil(self.prompt_tokens * (1 + self.prompt_spread))

    def offer(self, gpu: str) -> Offer:
        return next(o for o in self.offers if o.gpu == gpu)

    @classmethod
    def from_toml(cls, data: dict[str, Any]) -> PlanInput:
        """``model``, ``[workload]`` (rate_rps, prompt_tokens, prompt_spread, output_tokens),
        ``[slo]`` (ttft_s, tpot_s), ``[[gpus]]`` (type, count, price_per_hour)."""
        try:
            w, slo = data["workload"], data["slo"]
            return cls(
                model=str(data["model"]),
                rate_rps=float(w["rate_rps"]),
                prompt_tokens=int(w["prompt_tokens"]),
                prompt_spread=float(w.get("prompt_spread", 0.0)),
                output_tokens=int(w["output_tokens"]),
                ttft_slo_s=float(slo["ttft_s"]),
                tpot_slo_s=float(slo["tpot_s"]),
                offers=tuple(
                    Offer(str(g["type"]), int(g["count"]), float(g["price_per_hour"]))
                    for g in data["gpus"]
                ),
            )
        except KeyError as exc:
            raise ValueError(f"the plan's input lacks {exc.args[0]!r}") from None


@dataclass(frozen=True, slots=True)
class RolePlan:
    role: str
    gpu: str
    parallel: Parallel
    instances: int
    throughput_rps: float  # per instance
    latency_s: float  # prefill: predicted TTFT p99; decode: TPOT at a full batch
    batch: int  # decode: running sequences per instance; prefill: 1
    price_per_hour: float  # per GPU

    @property
    def gpus(self) -> int:
        return self.instances * self.parallel.gpus

    @property
    def cost_per_hour(self) -> float:
        return self.gpus * self.price_per_hour

    def sim_profile(self, model: str) -> str:
        """The sim's profile of one instance of `model` (engine_shim/hardware.py)."""
        p = self.parallel
        return (
            f"{model}@{self.gpu}"
            + (f"/tp{p.tp}" if p.tp > 1 else "")
            + (f"/pp{p.pp}" if p.pp > 1 else "")
        )

    def as_json(self, model: str) -> dict[str, Any]:
        return {
            "gpu": self.gpu,
            "tp": self.parallel.tp,
            "pp": self.parallel.pp,
            "instances": self.instances,
            "gpus": self.gpus,
            "throughput_rps_per_instance": round(self.throughput_rps, 3),
            ("ttft_p99_s" if self.role == "prefill" else "tpot_s"): round(self.latency_s, 4),
            "batch": self.batch,
            "cost_per_hour": round(self.cost_per_hour, 2),
            "sim_profile": self.sim_profile(model),
        }


@dataclass(frozen=True, slots=True)
class Plan:
    prefill: RolePlan
    decode: RolePlan
    spec: PlanInput

    @property
    def cost_per_hour(self) -> float:
        return self.prefill.cost_per_hour + self.decode.cost_per_hour

    @property
    def cost_per_million_tokens(self) -> float:
        s = self.spec
        tokens_per_hour = s.rate_rps * (s.prompt_tokens + s.output_tokens) * 3600
        return self.cost_per_hour / tokens_per_hour * 1e6

    @property
    def mixed(self) -> bool:
        return self.prefill.gpu != self.decode.gpu

    def as_json(self) -> dict[str, Any]:
        return {
            "prefill": self.prefill.as_json(self.spec.model),
            "decode": self.decode.as_json(self.spec.model),
            "cost_per_hour": round(self.cost_per_hour, 2),
            "cost_per_million_tokens": round(self.cost_per_million_tokens, 4),
            "mixed": self.mixed,
        }


def _erlang_c(n: int, load: float) -> float:
    """Probability that an arrival waits in an M/M/n queue offered `load` Erlangs (< n)."""
    term, total = 1.0, 1.0
    for k in range(1, n):
        term *= load / k
        total += term
    last = term * load / n * n / (n - load)
    return last / (total + last)


def _wait_quantile(n: int, rate: float, service_rate: float, q: float) -> float:
    """The wait exceeded by 1 - q of requests in M/M/n (inf when overloaded)."""
    load = rate / service_rate
    if load >= n:
        return math.inf
    waits = _erlang_c(n, load)
    if waits <= 1 - q:
        return 0.0
    return math.log(waits / (1 - q)) / (n * service_rate - rate)


def _profiles(model: ModelSpec, gpu: Gpu) -> Iterator[tuple[Parallel, SimProfile]]:
    for par in PARALLEL:
        try:
            yield par, profile_for(model, gpu, par)
        except ValueError:
            continue  # the weights do not fit


@dataclass(frozen=True, slots=True)
class _Prefill:
    gpu: str
    parallel: Parallel
    service_s: float
    profile: SimProfile


def _prefill_options(spec: PlanInput, model: ModelSpec) -> list[_Prefill]:
    out = []
    for offer in spec.offers:
        gpu = get_gpu(offer.gpu)
        for par, profile in _profiles(model, gpu):
            if par.gpus > offer.count:
                continue
            if kv_capacity_tokens(model, gpu, par) < spec.longest_prompt:
                continue
            service = profile.prefill_batch_s([(spec.longest_prompt, 0)])
            out.append(_Prefill(offer.gpu, par, service, profile))
    return out


def _decode_options(spec: PlanInput, model: ModelSpec) -> list[RolePlan]:
    out = []
    context = spec.prompt_tokens + spec.output_tokens // 2
    budget = spec.tpot_slo_s * TPOT_MARGIN
    for offer in spec.offers:
        gpu = get_gpu(offer.gpu)
        for par, profile in _profiles(model, gpu):
            if par.gpus > offer.count:
                continue
            fits = kv_capacity_tokens(model, gpu, par) // (spec.longest_prompt + spec.output_tokens)
            batch = 0
            for b in range(1, min(MAX_BATCH, fits) + 1):
                if profile.decode_step_s(b, b * context) > budget:
                    break
                batch = b
            if batch == 0:
                continue
            step = profile.decode_step_s(batch, batch * context)
            per_instance = par.pp * batch / (spec.output_tokens * step)
            n = max(1, math.ceil(spec.rate_rps / (per_instance * DECODE_UTILIZATION)))
            out.append(RolePlan("decode", offer.gpu, par, n, per_instance, step, batch,
                                offer.price_per_hour))  # fmt: skip
    return out


def _prefill_plan(
    spec: PlanInput, option: _Prefill, decode: RolePlan, model: ModelSpec
) -> RolePlan | None:
    """The fewest prefills of `option` that keep TTFT p99 within the SLO next to `decode`."""
    decode_nic = profile_for(model, get_gpu(decode.gpu), decode.parallel).kv_bandwidth_bytes_s
    nic = min(option.profile.kv_bandwidth_bytes_s, decode_nic)
    kv_bytes = model.kv_bytes_per_token * spec.longest_prompt
    transfer = option.profile.kv_transfer_latency_s + kv_bytes / nic
    fixed = option.service_s + transfer + decode.latency_s
    budget = spec.ttft_slo_s * TTFT_MARGIN
    if fixed > budget:
        return None
    service_rate = option.parallel.pp / option.service_s
    offer = spec.offer(option.gpu)
    n = max(1, math.ceil(spec.rate_rps / service_rate))
    while n * option.parallel.gpus <= offer.count:
        wait = _wait_quantile(n, spec.rate_rps, service_rate, TTFT_QUANTILE)
        if fixed + wait <= budget:
            return RolePlan("prefill", option.gpu, option.parallel, n, service_rate,
                            fixed + wait, 1, offer.price_per_hour)  # fmt: skip
        n += 1
    return None


def _fits(spec: PlanInput, prefill: RolePlan, decode: RolePlan) -> bool:
    if prefill.gpu == decode.gpu:
        return prefill.gpus + decode.gpus <= spec.offer(prefill.gpu).count
    return (
        prefill.gpus <= spec.offer(prefill.gpu).count
        and decode.gpus <= spec.offer(decode.gpu).count
    )


def plan_fleet(spec: PlanInput, *, gpus: Sequence[str] | None = None) -> Plan | None:
    """The cheapest plan using only `gpus` (None: every type offered); None if none meets
    the SLOs within the GPUs on offer."""
    model = get_model(spec.model)
    allowed = set(gpus) if gpus is not None else {o.gpu for o in spec.offers}
    decodes = [d for d in _decode_options(spec, model) if d.gpu in allowed]
    prefills = [p for p in _prefill_options(spec, model) if p.gpu in allowed]
    best: Plan | None = None
    for decode in decodes:
        for option in prefills:
            prefill = _prefill_plan(spec, option, decode, model)
            if prefill is None or not _fits(spec, prefill, decode):
                continue
            plan = Plan(prefill, decode, spec)
            if best is None or plan.cost_per_hour < best.cost_per_hour - 1e-9:
                best = plan
    return best


def best_plans(spec: PlanInput) -> tuple[Plan | None, dict[str, Plan | None]]:
    """The cheapest plan overall, and the cheapest using each GPU type alone."""
    single = {o.gpu: plan_fleet(spec, gpus=[o.gpu]) for o in spec.offers}
    return plan_fleet(spec), single
