"""GPUs and models for the sim: a datasheet catalogue and a roofline that turns (model, GPU,
tensor parallel, pipeline parallel) into the sim's timing profile, as seed 002's simulator
does (its section III-C: compute and communication time under discount factors, memory
access time for decode, memory = weights + activations + KV).

**Catalogue** (`GPUS`): dense bf16 tensor FLOP/s (no sparsity), memory bandwidth and size,
the intra-node link per GPU (NVLink / Infinity Fabric, or PCIe where there is none) and
the NIC per GPU of the usual 8-GPU server, from the vendors' datasheets:

* NVIDIA H100 SXM5 80GB and H200 SXM 141GB: "NVIDIA H100 Tensor Core GPU" and "NVIDIA H200
  Tensor Core GPU" datasheets (989 TFLOPS bf16 dense, 3.35 / 4.8 TB/s, NVLink 900 GB/s);
  400 Gb/s ConnectX-7 per GPU (DGX H100 / H200).
* NVIDIA A100 SXM4 80GB: "NVIDIA A100 Tensor Core GPU" datasheet (312 TFLOPS, 2,039 GB/s,
  NVLink 600 GB/s); 200 Gb/s per GPU (DGX A100).
* NVIDIA L40S: "NVIDIA L40S GPU" datasheet (362 TFLOPS bf16 dense, 864 GB/s GDDR6, 48 GB, no
  NVLink: PCIe Gen4 x16, 64 GB/s); 100 Gb/s Ethernet per GPU assumed.
* NVIDIA L20: "NVIDIA L20" product brief (119.5 TFLOPS, 864 GB/s, 48 GB, PCIe Gen4 x16); the
  GPU of EcoServe's cluster; 25 Gb/s Ethernet per GPU (EcoServe's commodity network).
* AMD Instinct MI300X: "AMD Instinct MI300X Accelerator" datasheet (1,307 TFLOPS bf16 dense,
  5.3 TB/s HBM3, 192 GB, Infinity Fabric 7 x 128 GB/s = 896 GB/s); 400 Gb/s per GPU.

**Roofline** (`profile_for`): the discount factors are those the ``llama-3.1-8b-h100``
profile was calibrated with from public vLLM measurements (sim_profile.py): prefill GEMMs at
27% of peak FLOP/s, weight and KV reads at 78% of the memory bandwidth, an all-reduce at
70% of the link; the per-sequence terms are scheduling and sampling work, the same on every
GPU. With tensor parallelism `tp`, compute and memory terms divide by `tp` and every layer
adds two all-reduces of its activations (ring: 2 (tp-1)/tp of the bytes, plus a latency);
with pipeline parallelism `pp`, a request still passes every layer (latency as `pp` = 1,
plus a hop per stage) while `pp` micro-batches are in flight (throughput x `pp`, the
planner's business). What the model leaves out: kernel-level effects, CUDA-graph buckets,
FP8, MoE; it is first order, as the sim is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from pdgate.engine_shim.sim_profile import SimProfile

__all__ = [
    "DECODE_PER_SEQ_S",
    "GPUS",
    "MODELS",
    "Gpu",
    "ModelSpec",
    "Parallel",
    "get_gpu",
    "get_model",
    "kv_capacity_tokens",
    "parse_hardware",
    "profile_for",
]

# Discount factors (module docstring), and per-sequence work that does not scale with the GPU.
MFU = 0.27
MBU = 0.78
LINK_EFFICIENCY = 0.7
NIC_EFFICIENCY = 0.5  # KV connectors reach about half the NIC (sim_profile.py)
ALLREDUCE_LATENCY_S = 10e-6
PREFILL_PER_SEQ_S = 2.0e-4
DECODE_PER_SEQ_S = 6.0e-5
TRANSFER_LATENCY_S = 1.0e-3
MEMORY_HEADROOM = 0.9  # of HBM for weights and KV (vLLM's gpu_memory_utilization)
BLOCK_TOKENS = 16


@dataclass(frozen=True, slots=True)
class Gpu:
    name: str
    vendor: str
    bf16_tflops: float  # dense
    memory_gb: float
    memory_tb_s: float
    link_gb_s: float  # intra-node, per GPU
    nic_gbit_s: float  # network per GPU
    source: str

    @property
    def flops(self) -> float:
        return self.bf16_tflops * 1e12

    @property
    def bandwidth(self) -> float:
        return self.memory_tb_s * 1e12

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    params: float
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * self.kv_heads * self.head_dim * 2 * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class Parallel:
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise ValueError("tensor and pipeline parallel degrees are at least 1")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp


GPUS: Mapping[str, Gpu] = MappingProxyType({
    g.name: g
    for g in (
        Gpu("h100", "nvidia", 989.0, 80, 3.35, 900, 400, "NVIDIA H100 Tensor Core GPU datasheet"),
        Gpu("h200", "nvidia", 989.0, 141, 4.8, 900, 400, "NVIDIA H200 Tensor Core GPU datasheet"),
        Gpu("a100", "nvidia", 312.0, 80, 2.039, 600, 200, "NVIDIA A100 Tensor Core GPU datasheet"),
        Gpu("l40s", "nvidia", 362.0, 48, 0.864, 64, 100, "NVIDIA L40S GPU datasheet"),
        Gpu("l20", "nvidia", 119.5, 48, 0.864, 64, 25, "NVIDIA L20 product brief"),
        Gpu("mi300x", "amd", 1307.0, 192, 5.3, 896, 400, "AMD Instinct MI300X datasheet"),
    )
})  # fmt: skip

# Architectures from the models' config.json (Hugging Face model cards).
MODELS: Mapping[str, ModelSpec] = MappingProxyType({
    m.name: m
    for m in (
        ModelSpec("llama-3.1-8b", 8.03e9, 32, 4096, 8, 128),
        ModelSpec("llama-3.1-70b", 70.6e9, 80, 8192, 8, 128),
        ModelSpec("llama-2-7b", 6.74e9, 32, 4096, 32, 128),
        ModelSpec("qwen2.5-32b", 32.8e9, 64, 5120, 8, 128),
    )
})  # fmt: skip


def get_gpu(name: str) -> Gpu:
    try:
        return GPUS[name]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}") from None


def get_model(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None


def _ring_s(gpu: Gpu, tp: int, nbytes: float) -> float:
    """Transfer time of a ring all-reduce of `nbytes` over `tp` GPUs (its latency aside)."""
    return 2 * (tp - 1) / tp * nbytes / (gpu.link_gb_s * 1e9 * LINK_EFFICIENCY)


def kv_capacity_tokens(model: ModelSpec, gpu: Gpu, parallel: Parallel) -> int:
    """Tokens of KV an instance holds once its weights are loaded (0: they do not fit)."""
    free = parallel.gpus * gpu.memory_bytes * MEMORY_HEADROOM - model.weight_bytes
    return max(0, int(free // model.kv_bytes_per_token))


def profile_for(model: ModelSpec, gpu: Gpu, parallel: Parallel | None = None) -> SimProfile:
    """The sim's timing profile of one instance of `model` on `parallel.gpus` GPUs of `gpu`;
    ValueError if the weights do not fit."""
    par = parallel or Parallel()
    tp = par.tp
    kv_tokens = kv_capacity_tokens(model, gpu, par)
    if kv_tokens < BLOCK_TOKENS:
        raise ValueError(
            f"{model.name} does not fit {par.gpus} x {gpu.name} (TP {tp}, PP {par.pp})"
        )
    read_weights = model.weight_bytes / tp / (gpu.bandwidth * MBU)
    # Two all-reduces a layer, each of every token's activations (bf16): their transfer per
    # token, their latency per pass; and a hop between pipeline stages.
    per_token_comm = 2 * model.layers * _ring_s(gpu, tp, model.hidden * model.dtype_bytes)
    pass_latency = (2 * model.layers * ALLREDUCE_LATENCY_S if tp > 1 else 0.0) + (
        (par.pp - 1) * ALLREDUCE_LATENCY_S
    )
    compute = gpu.flops * MFU * tp
    nic = gpu.nic_gbit_s * 1e9 / 8 * NIC_EFFICIENCY * tp  # each GPU moves its share of the KV
    step_tokens = 8192 if gpu.memory_gb >= 70 and gpu.name != "a100" else 2048
    return SimProfile(
        name=f"{model.name}@{gpu.name}"
        + (f"/tp{tp}" if tp > 1 else "")
        + (f"/pp{par.pp}" if par.pp > 1 else ""),
        prefill_overhead_s=read_weights + pass_latency,
        prefill_per_seq_s=PREFILL_PER_SEQ_S,
        prefill_per_token_s=2 * model.params / compute + per_token_comm,
        prefill_attention_s=4 * model.layers * model.hidden / compute,
        decode_base_s=read_weights + pass_latency,
        decode_per_seq_s=DECODE_PER_SEQ_S + per_token_comm,
        decode_per_context_token_s=model.kv_bytes_per_token / tp / (gpu.bandwidth * MBU),
        kv_bytes_per_token=model.kv_bytes_per_token,
        kv_bandwidth_bytes_s=nic,
        kv_transfer_latency_s=TRANSFER_LATENCY_S,
        prefix_cache_blocks=int(kv_tokens // BLOCK_TOKENS * 0.9),
        step_tokens=step_tokens,
    )


def parse_hardware(name: str) -> SimProfile | None:
    """A profile named ``MODEL@GPU[/tpN][/ppN]`` (e.g. ``llama-3.1-8b@l40s/tp2``), built by
    the roofline; None for a name of another form."""
    model, at, rest = name.partition("@")
    if not at:
        return None
    gpu, *parts = rest.split("/")
    tp = pp = 1
    for part in parts:
        if part.startswith("tp") and part[2:].isdigit():
            tp = int(part[2:])
        elif part.startswith("pp") and part[2:].isdigit():
            pp = int(part[2:])
        else:
            raise ValueError(f"{name!r}: expected MODEL@GPU[/tpN][/ppN]")
    return profile_for(get_model(model), get_gpu(gpu), Parallel(tp, pp))
