"""Time the connector's copies between one engine's paged KV cache and a buffer file.

    PYTHONPATH=<a folder holding pdgate/engine_shim> python3 kv_copy_bench.py [--device cuda]

For a Llama-3.1-8B-shaped cache (32 layers, 8 KV heads of 128, bfloat16, 16-token blocks,
FlashAttention's layout) and prompts of 1,024 and 4,096 tokens in scattered blocks: the time
to save a whole prompt into a fresh buffer (as a prefill's last step would, every layer) and
to load it into another cache (as the decode does), as token rows and as whole blocks, the
way the connector does: from a GPU through page-locked staging and ``pwrite``, and for
comparison (``mapped``) written into the file's mapping, as from host memory. The buffer
lives in /dev/shm where it has room, else in the temporary folder. Five runs each after a
warm-up; min / median / max. Prints a Markdown table.
``--threads N`` sets torch's CPU threads (a vLLM worker on a GPU runs with one).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pdgate.engine_shim._vllm_kv_buffer import (
    BufferFile,
    KvLayout,
    buffer_path,
    create_buffer,
    open_buffer,
)
from pdgate.engine_shim._vllm_kv_cache import (
    HostStaging,
    Span,
    load_blocks,
    load_rows,
    save_blocks,
    save_rows,
    stack_blocks,
    stack_rows,
)

LAYERS, HEADS, HEAD_SIZE, BLOCK = 32, 8, 128, 16
RUNS = 5


def _spool(nbytes: int) -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 3 * nbytes:
        return Path(tempfile.mkdtemp(dir=shm))
    return Path(tempfile.mkdtemp())


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    device = args.device
    if args.threads:
        torch.set_num_threads(args.threads)
    staging = HostStaging()
    dtype = torch.bfloat16
    print(f"device: {torch.cuda.get_device_name() if device.startswith('cuda') else 'cpu'}")
    print(
        f"torch {torch.__version__}; {LAYERS} layers x {HEADS} KV heads x {HEAD_SIZE}, {dtype};"
        f" torch CPU threads {torch.get_num_threads()}"
    )
    print()
    print("| form | prompt tokens | MiB | save ms min / med / max | load ms min / med / max |")
    print("|---|---|---|---|---|")
    for tokens in (1024, 4096):
        blocks = 2 * tokens // BLOCK + 8
        gen = torch.Generator().manual_seed(tokens)
        ids = torch.randperm(blocks, generator=gen)[: -(-tokens // BLOCK)].tolist()
        cache = [
            torch.randn(2, blocks, BLOCK, HEADS, HEAD_SIZE, dtype=dtype, device=device)
            for _ in range(LAYERS)
        ]
        other = [torch.zeros_like(c) for c in cache]
        forms = ("rows", "blocks")
        if device != "cpu":
            forms += ("rows, mapped", "blocks, mapped")
        for form in forms:
            staged = device != "cpu" and "mapped" not in form
            layout = (
                KvLayout(LAYERS, HEADS, HEAD_SIZE, "bfloat16", 2)
                if form.startswith("rows")
                else KvLayout(
                    LAYERS, HEADS, HEAD_SIZE, "bfloat16", 2, form="blocks:dev", block_tokens=BLOCK
                )
            )
            rows = form.startswith("rows")
            save, load = (save_rows, load_rows) if rows else (save_blocks, load_blocks)
            spool = _spool(layout.nbytes(tokens))
            saves, loads = [], []
            for run in range(RUNS + 1):
                path = buffer_path(spool, f"{run:032x}")
                _sync(device)
                began = time.perf_counter()
                span = Span(ids, 0, tokens, BLOCK)  # one per save, as the connector's
                if staged:
                    out = BufferFile(path, layout, tokens, create=True)
                    for layer in range(LAYERS):
                        first, data = (
                            (0, stack_rows(cache[layer], span))
                            if rows
                            else stack_blocks(cache[layer], span)
                        )
                        out.write(layer, first, staging.hold(data))
                    out.close()
                else:
                    buf = create_buffer(path, layout, tokens)
                    for layer in range(LAYERS):
                        save(cache[layer], buf[layer], span)
                    del buf
                _sync(device)
                saved = time.perf_counter()
                data, _ = open_buffer(path, layout, tokens)
                span = Span(ids, 0, tokens, BLOCK)
                _sync(device)
                began_load = time.perf_counter()
                for layer in range(LAYERS):
                    load(other[layer], data[layer], span)
                _sync(device)
                loaded = time.perf_counter()
                del data
                os.unlink(path)
                if run:  # the first is the warm-up
                    saves.append((saved - began) * 1e3)
                    loads.append((loaded - began_load) * 1e3)
            for layer in range(LAYERS):
                for b in ids:
                    assert torch.equal(other[layer][:, b], cache[layer][:, b])
            shutil.rmtree(spool)
            mib = layout.nbytes(tokens) / 2**20

            def spread(xs: list[float]) -> str:
                return f"{min(xs):.1f} / {statistics.median(xs):.1f} / {max(xs):.1f}"

            print(f"| {form} | {tokens} | {mib:.0f} | {spread(saves)} | {spread(loads)} |")
            for c in other:
                c.zero_()


if __name__ == "__main__":
    main()
