"""Ways to save a prompt's KV rows from the engine's cache into a fresh buffer file.

    PYTHONPATH=<a folder holding pdgate/engine_shim> python3 save_paths.py [--device cuda]

The save of a 4,096-token Llama-3.1-8B prompt (32 layers, 8 KV heads of 128, bfloat16,
FlashAttention's layout, scattered 16-token blocks) as token rows, each time into a new
buffer file in /dev/shm (as the connector does), by:

* ``halves``: keys and values each written into the interleaved rows (strided writes):
  `save_rows`;
* ``stacked``: the rows put together on the cache's device, then one contiguous copy;
* ``fallocate``: into a file whose pages were allocated at its creation
  (``posix_fallocate``); ``populate``: into a mapping populated at once
  (``MADV_POPULATE_WRITE``, Linux 5.14);
* ``staged``: first into a reused page-locked staging tensor, then into the mapped file
  (``copy``) or with ``pwrite`` (no mapping); ``staged only``: the staging copy alone,
  which is what a step would pay if the file were written off it;
* ``reused file``: into one file whose pages are already allocated: the bound.

``--threads N`` sets torch's CPU threads first: a vLLM worker on a GPU serves with one
(``set_torch_threads_for_runtime``), and torch spreads a CPU-side copy over its threads.

Five runs each after a warm-up; min / median / max ms. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pdgate.engine_shim._vllm_kv_buffer import (
    HEADER_BYTES,
    KvLayout,
    buffer_path,
    create_buffer,
    open_buffer,
)
from pdgate.engine_shim._vllm_kv_cache import Span, save_rows, token_slots, token_views

LAYERS, HEADS, HEAD_SIZE, BLOCK, TOKENS = 32, 8, 128, 16, 4096
RUNS = 5
MADV_POPULATE_WRITE = 23  # Linux 5.14


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    device = args.device
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = device.startswith("cuda")
    blocks = 2 * TOKENS // BLOCK + 8
    ids = torch.randperm(blocks, generator=torch.Generator().manual_seed(0))
    cache = [
        torch.randn(2, blocks, BLOCK, HEADS, HEAD_SIZE, dtype=torch.bfloat16, device=device)
        for _ in range(LAYERS)
    ]
    layout = KvLayout(LAYERS, HEADS, HEAD_SIZE, "bfloat16", 2)
    nbytes = layout.nbytes(TOKENS)
    spool = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    reused = buffer_path(spool, "0" * 32)
    create_buffer(reused, layout, TOKENS)  # its pages allocated once, here
    counter = iter(range(1, 1_000_000))
    libc = ctypes.CDLL(None, use_errno=True)
    staging = torch.empty(layout.shape(TOKENS)[1:], dtype=torch.bfloat16, pin_memory=cuda)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def span() -> Span:  # one per save, as the connector makes one per step
        return Span(ids[: TOKENS // BLOCK].tolist(), 0, TOKENS, BLOCK)

    def halves(kv: torch.Tensor, held: torch.Tensor, s: Span) -> None:
        kernel, slot = token_slots(kv, s)
        keys, values = token_views(kv)
        held[s.start : s.end, 0] = keys[kernel, slot]
        held[s.start : s.end, 1] = values[kernel, slot]

    def stacked(kv: torch.Tensor, held: torch.Tensor, s: Span) -> None:
        kernel, slot = token_slots(kv, s)
        keys, values = token_views(kv)
        held[s.start : s.end] = torch.stack((keys[kernel, slot], values[kernel, slot]), 1)

    def fresh(save: Callable[[torch.Tensor, torch.Tensor, Span], None], how: str) -> None:
        path = buffer_path(spool, f"{next(counter):032x}")
        if "fallocate" in how:
            create_buffer(path, layout, TOKENS)
            fd = os.open(path, os.O_RDWR)
            os.posix_fallocate(fd, 0, nbytes)
            os.close(fd)
            buf = open_buffer(path, layout, TOKENS, writable=True)[0]
        else:
            buf = create_buffer(path, layout, TOKENS)
        if "populate" in how:
            storage = buf.untyped_storage()
            ptr, size = ctypes.c_void_p(storage.data_ptr()), ctypes.c_size_t(storage.nbytes())
            if libc.madvise(ptr, size, ctypes.c_int(MADV_POPULATE_WRITE)):
                raise OSError(ctypes.get_errno(), "madvise")
        s = span()
        for layer in range(LAYERS):
            if "staged" in how:
                save(cache[layer], staging, s)
                sync()
                buf[layer].copy_(staging)
            else:
                save(cache[layer], buf[layer], s)
        sync()
        path.unlink()

    def staged_only() -> None:
        s = span()
        for layer in range(LAYERS):
            stacked(cache[layer], staging, s)
        sync()

    def staged_pwrite() -> None:
        path = buffer_path(spool, f"{next(counter):032x}")
        create_buffer(path, layout, TOKENS)
        fd = os.open(path, os.O_RDWR)
        s = span()
        row_bytes = nbytes - HEADER_BYTES
        layer_bytes = row_bytes // LAYERS
        view = memoryview(staging.view(torch.uint8).numpy()) if not cuda else None
        for layer in range(LAYERS):
            stacked(cache[layer], staging, s)
            sync()
            data = view if view is not None else memoryview(staging.view(torch.uint8).numpy())
            os.pwrite(fd, data, HEADER_BYTES + layer * layer_bytes)
        os.close(fd)
        path.unlink()

    def reused_file() -> None:
        buf = open_buffer(reused, layout, TOKENS, writable=True)[0]
        s = span()
        for layer in range(LAYERS):
            halves(cache[layer], buf[layer], s)

    cases: list[tuple[str, Callable[[], None]]] = [
        ("halves (save_rows)", lambda: fresh(save_rows, "")),
        ("halves, fallocate", lambda: fresh(halves, "fallocate")),
        ("halves, populate", lambda: fresh(halves, "populate")),
        ("stacked", lambda: fresh(stacked, "")),
        ("stacked, populate", lambda: fresh(stacked, "populate")),
        ("stacked, staged, copy", lambda: fresh(stacked, "staged")),
        ("stacked, staged, copy, populate", lambda: fresh(stacked, "staged populate")),
        ("stacked, staged, pwrite", staged_pwrite),
        ("stacked, staged only (no file)", staged_only),
        ("halves, reused file", reused_file),
    ]
    print(f"device: {torch.cuda.get_device_name() if cuda else 'cpu'}; torch {torch.__version__}")
    print(
        f"save of {TOKENS} tokens, {nbytes / 2**20:.0f} MiB, as token rows, fresh files;"
        f" torch CPU threads: {torch.get_num_threads()}"
    )
    print()
    print("| save | ms min / med / max |")
    print("|---|---|")
    for name, case in cases:
        took = []
        try:
            for run in range(RUNS + 1):
                sync()
                began = time.perf_counter()
                case()
                sync()
                if run:
                    took.append((time.perf_counter() - began) * 1e3)
        except OSError as exc:  # MADV_POPULATE_WRITE needs Linux 5.14
            print(f"| {name} | failed: {exc} |")
            continue
        print(f"| {name} | {min(took):.1f} / {statistics.median(took):.1f} / {max(took):.1f} |")
    reused.unlink()
    spool.rmdir()


if __name__ == "__main__":
    main()
