"""Timing profiles of the sim engine: how long a real engine would take, by model and GPU.

The model is first order (a roofline with efficiency factors), which is what a scheduler
experiment needs: prefill time grows with uncached tokens and batch size, decode step time
with batch size and total context, and KV sizes follow the model architecture.

* **Prefill** of a batch = ``prefill_overhead_s`` (one pass over the weights plus launch and
  scheduling) + ``prefill_per_seq_s`` per sequence + ``prefill_per_token_s`` per uncached
  prompt token (the GEMMs: ~2 x params FLOPs per token) + ``prefill_attention_s`` per pair
  (uncached query token, context token it attends to) (causal attention, which makes long
  prompts super-linear).
* **Decode step** = ``decode_base_s`` (reading all weights once: decode is memory bound)
  + ``decode_per_seq_s`` per running sequence (sampling, scheduling, per-row compute)
  + ``decode_per_context_token_s`` per token of context over the batch (reading the KV cache).
* **Mixed step** (a decode that prefills a plain request itself, chunked prefill): the
  running sequences' decode tokens plus prompt chunks of at most ``step_tokens`` tokens in
  all, in one pass: the weights are read once (the larger of ``decode_base_s`` and
  ``prefill_overhead_s``), then the decode terms, then the prefill terms of the chunks.
  Every running sequence waits for the whole step, so a local prefill stretches their
  inter-token latency by its chunks' compute: the cost that makes it a trade-off.
* **KV transfer** = ``kv_transfer_latency_s`` (the metadata exchange before a transfer)
  + full-size KV bytes / ``kv_bandwidth_bytes_s``.

Calibration of ``llama-3.1-8b-h100`` (bf16, one H100 SXM 80GB, vLLM, TP=1):

* Architecture: 8.03 B parameters (16.06 GB in bf16); 32 layers, 8 KV heads, head dim 128,
  so KV = 32 x 8 x 128 x 2 (K and V) x 2 bytes = 131,072 B/token; hidden size 4096.
* Hardware (NVIDIA H100 SXM datasheet): 3.35 TB/s HBM3, 989 TFLOPS dense bf16.
* Decode: weights / bandwidth = 4.8 ms per step is the floor. A public vLLM sweep of
  Llama-3.1-8B (https://johnmusgrave.com/p/vllm-throughput-latency-sweep-on, A100-40GB,
  vLLM 0.23) measured batch-1 decode at ~77% of the memory-bandwidth ceiling; the same
  efficiency on H100 gives ~6 ms, i.e. ~160 tokens/s for a single stream. KV reads at that
  efficiency cost 131,072 / (3.35e12 x 0.78) = 50 ns per context token. The per-sequence
  term is chosen so that ITL roughly doubles from batch 1 to batch 64 at 1k context
  (6 ms -> ~13.5 ms), the shape reported by the sweep above and by vLLM's own performance
  update for Llama 3 8B on one H100 (https://blog.vllm.ai/2024/09/05/perf-update.html).
* Prefill: 60 us per token is ~16.7k prompt tokens/s, ~27% of peak bf16 FLOPs, inside the
  10-20k tokens/s per H100 that public vLLM benchmarks of Llama-3-8B report for prompt
  throughput (e.g. https://blog.ori.co/benchmarking-llama-3.1-8b-instruct-on-nvidia-h100-and-a100-chips-with-the-vllm-inferencing-engine).
  Attention adds 4 x 32 layers x 4096 = 524k FLOPs per (query, key) pair, at the same
  efficiency ~1.9 ns; an 8k-token prompt then takes ~0.56 s.
* Mixed steps: ``step_tokens`` is vLLM V1's default ``max_num_batched_tokens`` for its
  OpenAI server (vllm/engine/arg_utils.py, ``_set_default_args``): 8192 on a GPU with at
  least 70 GiB that is not an A100 (H100, H200), 2048 otherwise. The scheduler takes the
  running sequences' decode tokens first and fills the rest of the budget with prompt
  chunks, oldest first, as here. The per-token and attention costs of a chunk are the
  prefill constants above: a chunk is the same GEMMs and attention as a prefill.
* KV transfer: 25 GB/s effective (about half of a 400 Gb/s RDMA NIC per GPU, what KV
  connectors such as NIXL report in practice), plus 1 ms of metadata exchange.
* Prefix cache: (80 GB x 0.9 - 16 GB weights) / (16 tokens x 131,072 B) ~ 26k blocks; 24k
  are kept for the cache.

These are honest approximations, not measurements of ours: they ignore chunked prefill,
CUDA-graph batch-size buckets, tensor parallelism and kernel-level effects. They are right
to within tens of percent at the batch sizes and prompt lengths of the experiments, which is
what matters for comparing schedulers. ``llama-3.1-8b-a100`` scales the same model to an
A100 SXM 80GB (2.04 TB/s, 312 TFLOPS, 200 Gb/s NIC). ``null`` answers as fast as possible.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["DEFAULT_PROFILE", "PROFILES", "SimProfile", "get_profile"]


@dataclass(frozen=True, slots=True)
class SimProfile:
    name: str
    prefill_overhead_s: float
    prefill_per_seq_s: float
    prefill_per_token_s: float
    prefill_attention_s: float
    decode_base_s: float
    decode_per_seq_s: float
    decode_per_context_token_s: float
    kv_bytes_per_token: int
    kv_bandwidth_bytes_s: float  # math.inf: transfers take no modelled time
    kv_transfer_latency_s: float
    prefix_cache_blocks: int
    step_tokens: int = 8192  # tokens one engine step computes at most (mixed steps)

    def _prefill_terms(self, seqs: Iterable[tuple[int, int]]) -> tuple[int, float]:
        """(sequences, seconds of their per-sequence, per-token and attention terms) for
        (prompt tokens, cached tokens) pairs: everything of a prefill but the weights' pass."""
        n_seqs = 0
        tokens = 0
        pairs = 0.0
        for prompt, cached in seqs:
            uncached = max(0, prompt - cached)
            n_seqs += 1
            tokens += uncached
            # Causal: uncached query p (cached < p <= prompt) attends to p keys.
            pairs += uncached * (cached + (uncached + 1) / 2)
        return n_seqs, (
            self.prefill_per_seq_s * n_seqs
            + self.prefill_per_token_s * tokens
            + self.prefill_attention_s * pairs
        )

    def prefill_batch_s(self, seqs: Iterable[tuple[int, int]]) -> float:
        """Time of one prefill batch; `seqs` holds (prompt tokens, cached tokens) pairs."""
        n_seqs, terms = self._prefill_terms(seqs)
        return self.prefill_overhead_s + terms if n_seqs else 0.0

    def mixed_step_s(
        self, batch_size: int, context_tokens: int, chunks: Iterable[tuple[int, int]]
    ) -> float:
        """One chunked-prefill step: a token for each of `batch_size` running sequences (with
        `context_tokens` of context in all) and prompt chunks, as (tokens computed after
        this step, tokens computed before it) pairs."""
        n_chunks, terms = self._prefill_terms(chunks)
        if n_chunks == 0:
            return self.decode_step_s(batch_size, context_tokens)
        if batch_size <= 0:
            return self.prefill_overhead_s + terms
        return (
            max(self.prefill_overhead_s, self.decode_base_s)  # the weights, read once
            + self.decode_per_seq_s * batch_size
            + self.decode_per_context_token_s * context_tokens
            + terms
        )

    def decode_step_s(self, batch_size: int, context_tokens: int) -> float:
        """Time of one decode step: every running sequence gets one token."""
        if batch_size <= 0:
            return 0.0
        return (
            self.decode_base_s
            + self.decode_per_seq_s * batch_size
            + self.decode_per_context_token_s * context_tokens
        )

    def kv_bytes(self, tokens: int) -> int:
        """Real size of the KV cache of `tokens` tokens."""
        return tokens * self.kv_bytes_per_token

    def kv_wire_bytes(self, tokens: int, fraction: float) -> int:
        """Bytes actually moved for `tokens`: a fraction of the real size, at least 1 per token."""
        return max(tokens, round(self.kv_bytes(tokens) * fraction))

    def kv_transfer_s(self, tokens: int) -> float:
        """Modelled time to move the full-size KV of `tokens` tokens between GPUs."""
        if tokens <= 0:
            return 0.0
        return self.kv_transfer_latency_s + self.kv_bytes(tokens) / self.kv_bandwidth_bytes_s


_LLAMA_31_8B_KV = 32 * 8 * 128 * 2 * 2  # layers x KV heads x head dim x (K, V) x bf16 bytes

LLAMA_31_8B_H100 = SimProfile(
    name="llama-3.1-8b-h100",
    prefill_overhead_s=6.0e-3,
    prefill_per_seq_s=2.0e-4,
    prefill_per_token_s=6.0e-5,
    prefill_attention_s=1.9e-9,
    decode_base_s=6.0e-3,
    decode_per_seq_s=6.0e-5,
    decode_per_context_token_s=5.0e-8,
    kv_bytes_per_token=_LLAMA_31_8B_KV,
    kv_bandwidth_bytes_s=25e9,
    kv_transfer_latency_s=1.0e-3,
    prefix_cache_blocks=24_000,
    step_tokens=8192,
)

# Same model on an A100 SXM 80GB: bandwidth-bound terms scale by 3.35/2.04, compute-bound
# terms by 989/312; a 200 Gb/s NIC per GPU.
LLAMA_31_8B_A100 = SimProfile(
    name="llama-3.1-8b-a100",
    prefill_overhead_s=1.0e-2,
    prefill_per_seq_s=3.0e-4,
    prefill_per_token_s=1.9e-4,
    prefill_attention_s=6.0e-9,
    decode_base_s=1.0e-2,
    decode_per_seq_s=8.0e-5,
    decode_per_context_token_s=8.3e-8,
    kv_bytes_per_token=_LLAMA_31_8B_KV,
    kv_bandwidth_bytes_s=12.5e9,
    kv_transfer_latency_s=1.0e-3,
    prefix_cache_blocks=24_000,
    step_tokens=2048,
)

NULL = SimProfile(
    name="null",
    prefill_overhead_s=0.0,
    prefill_per_seq_s=0.0,
    prefill_per_token_s=0.0,
    prefill_attention_s=0.0,
    decode_base_s=0.0,
    decode_per_seq_s=0.0,
    decode_per_context_token_s=0.0,
    kv_bytes_per_token=0,
    kv_bandwidth_bytes_s=math.inf,
    kv_transfer_latency_s=0.0,
    prefix_cache_blocks=4096,
)

DEFAULT_PROFILE = LLAMA_31_8B_H100.name

PROFILES: Mapping[str, SimProfile] = MappingProxyType(
    {p.name: p for p in (LLAMA_31_8B_H100, LLAMA_31_8B_A100, NULL)}
)


def get_profile(name: str) -> SimProfile:
    """A named profile, or one the roofline builds for ``MODEL@GPU[/tpN][/ppN]``
    (engine_shim/hardware.py)."""
    if name in PROFILES:
        return PROFILES[name]
    from pdgate.engine_shim.hardware import parse_hardware  # it builds on this module

    built = parse_hardware(name)
    if built is None:
        known = ", ".join(sorted(PROFILES))
        raise ValueError(
            f"unknown sim profile {name!r}; known profiles: {known}, or MODEL@GPU[/tpN][/ppN]"
        )
    return built
