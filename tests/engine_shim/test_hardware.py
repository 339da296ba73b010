"""The sim's hardware catalogue and roofline: datasheet GPUs of several vendors, and profiles
of (model, GPU, parallelism) that agree with the calibrated one where both exist."""

from __future__ import annotations

import dataclasses

import pytest

from pdgate.config import Role
from pdgate.engine_shim.hardware import (
    DECODE_PER_SEQ_S,
    GPUS,
    Parallel,
    get_gpu,
    get_model,
    kv_capacity_tokens,
    profile_for,
)
from pdgate.engine_shim.sim_profile import get_profile
from pdgate.registry.memory import MemoryRegistry
from tests.engine_shim.conftest import StartShim

_TERMS = (
    "prefill_overhead_s",
    "prefill_per_token_s",
    "prefill_attention_s",
    "decode_base_s",
    "decode_per_seq_s",
    "decode_per_context_token_s",
    "kv_bytes_per_token",
    "kv_bandwidth_bytes_s",
    "prefix_cache_blocks",
    "step_tokens",
)


def test_the_catalogue_has_datasheet_gpus_of_several_vendors() -> None:
    assert len(GPUS) >= 4 and len({g.vendor for g in GPUS.values()}) >= 2
    for gpu in GPUS.values():
        assert gpu.source and gpu.bf16_tflops > 0 and gpu.memory_gb > 0 and gpu.memory_tb_s > 0
    with pytest.raises(ValueError, match="known: h100"):
        get_gpu("tpu")


@pytest.mark.parametrize("calibrated", ["llama-3.1-8b-h100", "llama-3.1-8b-a100"])
def test_the_roofline_meets_the_calibrated_profiles_within_10_percent(calibrated: str) -> None:
    gpu = calibrated.rsplit("-", 1)[1]
    built = dataclasses.asdict(profile_for(get_model("llama-3.1-8b"), get_gpu(gpu)))
    known = dataclasses.asdict(get_profile(calibrated))
    terms = _TERMS if gpu == "h100" else tuple(t for t in _TERMS if t != "decode_per_seq_s")
    for term in terms:
        assert built[term] == pytest.approx(known[term], rel=0.10), term


def test_tensor_parallel_divides_the_work_and_pays_for_its_all_reduces() -> None:
    model, gpu = get_model("llama-3.1-70b"), get_gpu("h100")
    with pytest.raises(ValueError, match="does not fit"):
        profile_for(model, gpu)  # 141 GB of weights on one 80 GB GPU
    tp2, tp4 = profile_for(model, gpu, Parallel(tp=2)), profile_for(model, gpu, Parallel(tp=4))
    assert tp4.decode_per_context_token_s == pytest.approx(tp2.decode_per_context_token_s / 2)
    # Compute halves, the activations' all-reduce per token grows with the ring's share.
    assert tp2.prefill_per_token_s / 2 < tp4.prefill_per_token_s < tp2.prefill_per_token_s
    assert tp4.decode_per_seq_s > tp2.decode_per_seq_s > get_profile("null").decode_per_seq_s
    assert kv_capacity_tokens(model, gpu, Parallel(tp=4)) > 2 * kv_capacity_tokens(
        model, gpu, Parallel(tp=2)
    )
    # PCIe-only GPUs all-reduce far slower than NVLink ones of similar compute per GPU.
    l40s = profile_for(get_model("llama-3.1-8b"), get_gpu("l40s"), Parallel(tp=2))
    h100 = profile_for(get_model("llama-3.1-8b"), gpu, Parallel(tp=2))
    assert l40s.decode_per_seq_s - DECODE_PER_SEQ_S > 10 * (
        h100.decode_per_seq_s - DECODE_PER_SEQ_S
    )


def test_roofline_profiles_by_name() -> None:
    assert get_profile("llama-3.1-70b@mi300x").name == "llama-3.1-70b@mi300x"
    assert get_profile("llama-3.1-8b@l40s/tp2/pp2").name == "llama-3.1-8b@l40s/tp2/pp2"
    bad_names = (
        ("llama-3.1-8b@h100/x3", "expected MODEL@GPU"),
        ("gpt@h100", "unknown model"),
        ("nothing", "unknown sim profile"),
    )
    for bad, why in bad_names:
        with pytest.raises(ValueError, match=why):
            get_profile(bad)


async def test_a_shim_serves_on_a_roofline_profile_and_registers_its_hardware(
    start_shim: StartShim, registry: MemoryRegistry
) -> None:
    shim = await start_shim(Role.PREFILL, sim_profile="llama-3.1-8b@l40s/tp2")
    reply = await shim.prefilled()
    assert reply["kv_transfer_params"]
    declared = await start_shim(Role.DECODE, hardware="h100")
    by_url = {r.url: r.hardware for r in await registry.snapshot()}
    assert by_url[shim.url] == "l40s/tp2" and by_url[declared.url] == "h100"
