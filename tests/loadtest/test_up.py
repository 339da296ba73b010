"""How ``pdgate up`` sizes the KV caches of its vLLM engines so that all of them fit on the
machine (no vLLM needed: the choice is plain arithmetic over what memory is available)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdgate.config import ShimSettings
from pdgate.loadtest.up import (
    VLLM_ENGINE_OVERHEAD_BYTES,
    VLLM_MEMORY_RESERVE,
    GiB,
    MiB,
    kv_cache_per_engine,
    meminfo_available,
    model_weight_bytes,
    size_vllm_kv_cache,
)


def _shim(**update: object) -> ShimSettings:
    fields: dict[str, object] = {"engine": "vllm", "model": "/nonexistent/model", **update}
    return ShimSettings.model_validate(fields)


def test_engines_share_what_is_left_after_reserve_overhead_and_weights() -> None:
    available = 20 * GiB
    size = kv_cache_per_engine(available, 2, weights=GiB)
    usable = available * (1 - VLLM_MEMORY_RESERVE) - 2 * (VLLM_ENGINE_OVERHEAD_BYTES + GiB)
    assert size % MiB == 0
    assert usable / 2 - MiB < size <= usable / 2
    # Everything together stays within what was available.
    assert 2 * (size + VLLM_ENGINE_OVERHEAD_BYTES + GiB) <= available


def test_more_engines_get_less_each() -> None:
    sizes = [kv_cache_per_engine(24 * GiB, n) for n in (1, 2, 4)]
    assert sizes[0] > sizes[1] > sizes[2] > 0


def test_too_little_memory_is_refused_with_what_to_do() -> None:
    with pytest.raises(ValueError, match="PDGATE_SHIM_VLLM_KV_CACHE_BYTES"):
        kv_cache_per_engine(2 * GiB, 4)
    with pytest.raises(ValueError, match="no engines"):
        kv_cache_per_engine(24 * GiB, 0)


def test_pdgate_up_sizes_vllm_engines_and_says_so() -> None:
    shim, line = size_vllm_kv_cache(_shim(), 2, lambda: 6 * GiB, {})
    assert shim.vllm_kv_cache_bytes == kv_cache_per_engine(6 * GiB, 2)
    assert line == (
        f"KV cache per engine: {shim.vllm_kv_cache_bytes / GiB:.1f} GiB "
        "(2 engines, 6.0 GiB available)"
    )


@pytest.mark.parametrize(
    ("update", "env", "says"),
    [
        ({"vllm_kv_cache_bytes": 64 << 20}, {}, "0.1 GiB (as set)"),
        ({"vllm_engine_args": {"gpu_memory_utilization": 0.3}}, {}, "gpu_memory_utilization"),
        ({"vllm_engine_args": {"kv_cache_memory_bytes": 1 << 30}}, {}, "kv_cache_memory_bytes"),
        ({}, {"VLLM_CPU_KVCACHE_SPACE": "2"}, "2 GiB (VLLM_CPU_KVCACHE_SPACE)"),
    ],
)
def test_a_size_the_user_chose_wins(
    update: dict[str, object], env: dict[str, str], says: str
) -> None:
    def unused() -> int:
        raise AssertionError("memory is not read when the user chose a size")

    before = _shim(**update)
    shim, line = size_vllm_kv_cache(before, 2, unused, env)
    assert shim == before
    assert line is not None
    assert line.startswith("KV cache per engine:")
    assert says in line


def test_device_memory_is_left_to_vllm() -> None:
    shim, line = size_vllm_kv_cache(_shim(), 2, lambda: None, {})
    assert shim.vllm_kv_cache_bytes is None
    assert line is not None
    assert "vLLM's default" in line


def test_other_engines_are_untouched() -> None:
    sim = ShimSettings(engine="sim")
    assert size_vllm_kv_cache(sim, 4, lambda: GiB, {}) == (sim, None)


def test_the_weights_of_a_model_directory_count(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert model_weight_bytes(str(tmp_path), "bfloat16") == 1000
    # bf16 files loaded as float32 take twice their size.
    assert model_weight_bytes(str(tmp_path), "float32") == 2000
    assert model_weight_bytes("meta-llama/Llama-3.1-8B", "auto") == 0

    shim = _shim(model=str(tmp_path), vllm_dtype="float32")
    sized, _ = size_vllm_kv_cache(shim, 2, lambda: 8 * GiB, {})
    assert sized.vllm_kv_cache_bytes == kv_cache_per_engine(8 * GiB, 2, 2000)


def test_meminfo_available(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  24684092 kB\nMemFree: 1 kB\nMemAvailable:   23615108 kB\n")
    assert meminfo_available(str(meminfo)) == 23615108 * 1024
    assert meminfo_available(str(tmp_path / "missing")) is None
