"""What the kv-copy cases share: a Llama-3.1-8B-shaped paged cache, the clock, the table rows.

The cache: 32 layers, 8 KV heads of 128, bfloat16, 16-token blocks in FlashAttention's
layout, each layer ``[2, blocks, 16, heads, head size]`` (keys and values on the first axis).
Every case runs `RUNS` timed repetitions after one warm-up, the device synchronised around
each, and reports min / median / max milliseconds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

__all__ = [
    "BLOCK",
    "HEADS",
    "HEAD_SIZE",
    "LAYERS",
    "RUNS",
    "TOKENS",
    "device_line",
    "engine_cache",
    "set_threads",
    "spread",
    "synchronizer",
    "timed",
]

LAYERS, HEADS, HEAD_SIZE, BLOCK = 32, 8, 128, 16
TOKENS = 4096  # the prompt of the cases that time one size
RUNS = 5


def set_threads(threads: int) -> None:
    """torch's CPU threads (0: its default); a vLLM worker on a GPU serves with one."""
    if threads:
        torch.set_num_threads(threads)


def device_line(device: str) -> str:
    return f"device: {torch.cuda.get_device_name() if device.startswith('cuda') else 'cpu'}"


def engine_cache(blocks: int, device: str) -> list[torch.Tensor]:
    """One engine's cache of `blocks` blocks a layer, random contents."""
    shape = (2, blocks, BLOCK, HEADS, HEAD_SIZE)
    return [torch.randn(*shape, dtype=torch.bfloat16, device=device) for _ in range(LAYERS)]


def synchronizer(device: str) -> Callable[[], None]:
    """Waits for the device's queued work (nothing to wait for on the CPU)."""

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    return sync


def timed(case: Callable[[], None], sync: Callable[[], None]) -> list[float]:
    """`case`'s milliseconds, `RUNS` times after a warm-up."""
    took = []
    for run in range(RUNS + 1):
        sync()
        began = time.perf_counter()
        case()
        sync()
        if run:  # the first is the warm-up
            took.append((time.perf_counter() - began) * 1e3)
    return took


def spread(xs: list[float]) -> str:
    return f"{min(xs):.1f} / {statistics.median(xs):.1f} / {max(xs):.1f}"
