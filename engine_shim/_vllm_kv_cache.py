"""One attention layer's paged KV cache as vLLM hands it to a connector, read and written as
token rows or as whole kernel blocks. Needs torch, not vLLM, so it is tested on any device.

vLLM's backends give a layer's cache in one of three logical shapes (a tensor whose strides
may be permuted, as FlashInfer's ``HND`` layout does; indexing follows the logical shape):

* ``[2, blocks, block size, KV heads, head size]``: FlashAttention (keys at 0, values at 1);
* ``[blocks, 2, block size, KV heads, head size]``: FlashInfer and Triton attention;
* ``[blocks, KV heads, block size, 2 x head size]``: the CPU attention backend's view. Its
  vector kernels (ISA ``vec``, ``vec16``) keep, per kernel block and KV head, the keys
  column-major (``[head size, block size]``) and then the values row-major (``[block size,
  head size]``): vLLM's csrc/cpu/cpu_attn_vec.hpp, ``reshape_and_cache``. Whether a CPU
  cache is of that kind is the caller's to decide (`vllm_connector`); read as rows here,
  it is assumed to be.

A kernel block may be smaller than the scheduler's block (the CPU kernel keeps 32-token
kernel blocks under 128-token scheduler blocks): scheduler block b is kernel blocks
``[b*r, b*r + r)``, ``r`` = scheduler block size / kernel block size.

Under tensor parallelism each rank's cache holds some of the model's KV heads
(`rank_heads`): it writes and reads only those columns of a buffer's token rows, which hold
every head, so a prefill and a decode need not split the heads alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = [
    "CacheShapeError",
    "HostStaging",
    "Span",
    "heads",
    "kernel_block_tokens",
    "kernel_blocks",
    "load_blocks",
    "load_rows",
    "rank_heads",
    "save_blocks",
    "save_rows",
    "stack_blocks",
    "stack_rows",
    "token_slots",
    "token_views",
]


class CacheShapeError(ValueError):
    """A layer's cache is in no shape this module knows."""


def _kv_axis(kv: torch.Tensor) -> int | None:
    """The axis that splits keys from values in a 5-dimensional cache; None for the CPU
    backend's 4-dimensional view."""
    if kv.dim() == 4 and kv.shape[3] % 2 == 0:
        return None
    if kv.dim() == 5:
        if kv.shape[0] == 2 and kv.shape[1] != 2:
            return 0
        if kv.shape[1] == 2 and kv.shape[0] != 2:
            return 1
    # A 5-dimensional cache of exactly two blocks cannot be told apart, nor can MLA's
    # 3-dimensional latent cache be read as keys and values.
    raise CacheShapeError(f"KV cache layout {tuple(kv.shape)} not supported")


def rank_heads(rank: int, ranks: int, total: int, held: int) -> tuple[slice, bool]:
    """The KV heads of a model's `total` that tensor-parallel rank `rank` of `ranks` holds,
    as a slice of them, and whether it writes them; `held`, the heads its cache has, is
    checked against vLLM's split: ``total // ranks`` each, or, with fewer heads than ranks,
    one each, a head on ``ranks // total`` ranks in a row (vLLM replicates it), of which
    only the first writes it (the others hold the same values)."""
    if not 0 <= rank < ranks or total < 1 or max(1, total // ranks) != held:
        raise CacheShapeError(
            f"rank {rank} of {ranks} holds {held} of {total} KV heads: not vLLM's split"
        )
    if (total % ranks if total >= ranks else ranks % total) != 0:
        raise CacheShapeError(f"{total} KV heads do not split evenly over {ranks} ranks")
    first = rank * total // ranks
    return slice(first, first + held), rank * total % ranks < total


def kernel_block_tokens(kv: torch.Tensor) -> int:
    _kv_axis(kv)
    return int(kv.shape[2])


def heads(kv: torch.Tensor) -> tuple[int, int]:
    """(KV heads, head size) of a layer's cache."""
    if _kv_axis(kv) is None:
        return int(kv.shape[1]), int(kv.shape[3]) // 2
    return int(kv.shape[3]), int(kv.shape[4])


def token_views(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values, each ``[kernel blocks, kernel block size, KV heads, head size]``:
    views, so writing into them writes the cache."""
    axis = _kv_axis(kv)
    if axis == 0:
        return kv[0], kv[1]
    if axis == 1:
        return kv[:, 0], kv[:, 1]
    blocks, kv_heads, size, content = kv.shape
    halves = kv.view(blocks, kv_heads, 2, size * content // 2)
    keys = halves[:, :, 0].unflatten(-1, (content // 2, size)).permute(0, 3, 1, 2)
    values = halves[:, :, 1].unflatten(-1, (size, content // 2)).permute(0, 2, 1, 3)
    return keys, values


def _block_view(kv: torch.Tensor) -> torch.Tensor:
    """The cache with kernel blocks first (a view)."""
    return kv.transpose(0, 1) if _kv_axis(kv) == 0 else kv


@dataclass(frozen=True, slots=True)
class Span:
    """Prompt tokens [start, end) of one request, whose KV lives in the engine's scheduler
    blocks `block_ids` (of `block_size` tokens each), in the prompt's order.

    Where the tokens (and their kernel blocks) live is worked out once per kernel block size
    and device and kept: every layer of a model has the same, and a save or load goes
    through all of them."""

    block_ids: Sequence[int]
    start: int
    end: int
    block_size: int
    _slots: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _blocks: dict[tuple[int, torch.device], torch.Tensor] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def kernel_of(self, positions: torch.Tensor, size: int) -> torch.Tensor:
        """The kernel block (of `size` tokens) holding each prompt position."""
        ids = torch.tensor(list(self.block_ids), dtype=torch.long)
        ratio = self.block_size // size
        return ids[positions // self.block_size] * ratio + (positions % self.block_size) // size


def token_slots(kv: torch.Tensor, span: Span) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the span's tokens live in `kv`: each one's kernel block and its place there, on
    the cache's device."""
    size = kernel_block_tokens(kv)
    key = (size, kv.device)
    slots = span._slots.get(key)
    if slots is None:
        tokens = torch.arange(span.start, span.end)
        kernel = span.kernel_of(tokens, size).to(kv.device)
        slots = span._slots[key] = (kernel, (tokens % size).to(kv.device))
    return slots


def kernel_blocks(kv: torch.Tensor, span: Span) -> tuple[int, int, torch.Tensor]:
    """The kernel blocks holding the span's tokens: their positions among the prompt's
    kernel blocks (first, last), which are the buffer's, and their ids in `kv`."""
    size = kernel_block_tokens(kv)
    first, last = span.start // size, -(-span.end // size)
    key = (size, kv.device)
    kernel = span._blocks.get(key)
    if kernel is None:
        kernel = span.kernel_of(torch.arange(first, last) * size, size).to(kv.device)
        span._blocks[key] = kernel
    return first, last, kernel


def save_rows(kv: torch.Tensor, held: torch.Tensor, span: Span) -> None:
    """Copy the keys and values of the span's tokens from the cache into `held`, a
    buffer's layer of token rows ``[tokens, 2, KV heads, head size]`` (on any device)."""
    kernel, slot = token_slots(kv, span)
    keys, values = token_views(kv)
    held[span.start : span.end, 0] = keys[kernel, slot]
    held[span.start : span.end, 1] = values[kernel, slot]


def stack_rows(kv: torch.Tensor, span: Span) -> torch.Tensor:
    """The span's tokens as token rows ``[tokens, 2, KV heads, head size]``, a new tensor on
    the cache's device."""
    kernel, slot = token_slots(kv, span)
    keys, values = token_views(kv)
    return torch.stack((keys[kernel, slot], values[kernel, slot]), 1)


def stack_blocks(kv: torch.Tensor, span: Span) -> tuple[int, torch.Tensor]:
    """The whole kernel blocks holding the span's tokens, ``[blocks, block elements]``, a
    new tensor on the cache's device, and the first one's position among the prompt's."""
    first, last, ids = kernel_blocks(kv, span)
    return first, _block_view(kv)[ids].reshape(last - first, -1)


class HostStaging:
    """One reused page-locked host tensor that a layer's rows or blocks from a GPU cross
    into, whole: one contiguous copy into page-locked memory runs at the bus's speed, while
    the same data written into a file's mapping goes at a fraction of it. It grows to the
    largest span staged (one request's chunk in a step, at most the engine's batched
    tokens) and is kept for the worker's life."""

    __slots__ = ("_raw",)

    def __init__(self) -> None:
        self._raw: torch.Tensor | None = None

    def hold(self, data: torch.Tensor) -> torch.Tensor:
        """`data` copied into host memory: valid until the next call."""
        nbytes = data.numel() * data.element_size()
        if self._raw is None or self._raw.numel() < nbytes:
            pin = data.device.type != "cpu"
            self._raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        held = self._raw[:nbytes].view(data.dtype).view(data.shape)
        held.copy_(data)  # synchronous: the data is in host memory on return
        return held


def load_rows(kv: torch.Tensor, held: torch.Tensor, span: Span) -> None:
    """Write the span's tokens of `held` (token rows, any device and dtype: cast to
    the cache's) into the cache."""
    kernel, slot = token_slots(kv, span)
    rows = held[span.start : span.end].to(device=kv.device, dtype=kv.dtype)
    keys, values = token_views(kv)
    keys[kernel, slot] = rows[:, 0]
    values[kernel, slot] = rows[:, 1]


def save_blocks(kv: torch.Tensor, held: torch.Tensor, span: Span) -> None:
    """Copy the whole kernel blocks holding the span's tokens into `held`, a
    buffer's layer of the prompt's kernel blocks ``[kernel blocks, block elements]``."""
    first, blocks = stack_blocks(kv, span)
    held[first : first + len(blocks)] = blocks


def load_blocks(kv: torch.Tensor, held: torch.Tensor, span: Span) -> None:
    """Write the whole kernel blocks holding the span's tokens from `held` (as
    `save_blocks` wrote them) into the cache."""
    first, last, ids = kernel_blocks(kv, span)
    view = _block_view(kv)
    view[ids] = held[first:last].reshape(len(ids), *view.shape[1:]).to(kv.device)
