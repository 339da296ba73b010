"""``pdgate bench kv-copy copies``: the connector's copies between one engine's paged KV cache
and a buffer file.

For prompts of 1,024 and 4,096 tokens in scattered blocks of the cache (cache.py): the time
to save a whole prompt into a fresh buffer (as a prefill's last step would, every layer) and
to load it into another cache (as the decode does), as token rows and as whole blocks, the
way the connector does: from a GPU through page-locked staging and ``pwrite``, and for
comparison (``mapped``) written into the file's mapping, as from host memory. The buffer
lives in /dev/shm where it has room, else in the temporary folder. Prints a Markdown table;
every load is checked against the cache it came from.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from pdgate.engine_shim import _vllm_kv_buffer as kv_buffer
from pdgate.engine_shim import _vllm_kv_cache as paged
from pdgate.engine_shim._vllm_kv_buffer import KvLayout
from pdgate.loadtest.kv_copy.cache import (
    BLOCK,
    HEAD_SIZE,
    HEADS,
    LAYERS,
    RUNS,
    device_line,
    engine_cache,
    set_threads,
    spread,
    synchronizer,
)

__all__ = ["run"]


def _spool(nbytes: int) -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 3 * nbytes:
        return Path(tempfile.mkdtemp(dir=shm))
    return Path(tempfile.mkdtemp())


def run(device: str, threads: int) -> None:
    set_threads(threads)
    staging = paged.HostStaging()
    sync = synchronizer(device)
    print(device_line(device))
    print(
        f"torch {torch.__version__}; {LAYERS} layers x {HEADS} KV heads x {HEAD_SIZE}, "
        f"{torch.bfloat16}; torch CPU threads {torch.get_num_threads()}"
    )
    print()
    print("| form | prompt tokens | MiB | save ms min / med / max | load ms min / med / max |")
    print("|---|---|---|---|---|")
    for tokens in (1024, 4096):
        blocks = 2 * tokens // BLOCK + 8
        gen = torch.Generator().manual_seed(tokens)
        ids = torch.randperm(blocks, generator=gen)[: -(-tokens // BLOCK)].tolist()
        cache = engine_cache(blocks, device)
        other = [torch.zeros_like(c) for c in cache]
        forms: tuple[str, ...] = ("rows", "blocks")
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
            save, load = (
                (paged.save_rows, paged.load_rows)
                if rows
                else (paged.save_blocks, paged.load_blocks)
            )
            spool = _spool(layout.nbytes(tokens))
            saves, loads = [], []
            for repetition in range(RUNS + 1):
                path = kv_buffer.buffer_path(spool, f"{repetition:032x}")
                sync()
                began = time.perf_counter()
                span = paged.Span(ids, 0, tokens, BLOCK)  # one per save, as the connector's
                if staged:
                    out = kv_buffer.BufferFile(path, layout, tokens, create=True)
                    for layer in range(LAYERS):
                        first, data = (
                            (0, paged.stack_rows(cache[layer], span))
                            if rows
                            else paged.stack_blocks(cache[layer], span)
                        )
                        out.write(layer, first, staging.hold(data))
                    out.close()
                else:
                    buf = kv_buffer.create_buffer(path, layout, tokens)
                    for layer in range(LAYERS):
                        save(cache[layer], buf[layer], span)
                    del buf
                sync()
                saved = time.perf_counter()
                data, _ = kv_buffer.open_buffer(path, layout, tokens)
                span = paged.Span(ids, 0, tokens, BLOCK)
                sync()
                began_load = time.perf_counter()
                for layer in range(LAYERS):
                    load(other[layer], data[layer], span)
                sync()
                loaded = time.perf_counter()
                del data
                os.unlink(path)
                if repetition:  # the first is the warm-up
                    saves.append((saved - began) * 1e3)
                    loads.append((loaded - began_load) * 1e3)
            for layer in range(LAYERS):
                for b in ids:
                    if not torch.equal(other[layer][:, b], cache[layer][:, b]):
                        raise RuntimeError(f"{form}: block {b} of layer {layer} loaded wrong")
            shutil.rmtree(spool)
            mib = layout.nbytes(tokens) / 2**20
            print(f"| {form} | {tokens} | {mib:.0f} | {spread(saves)} | {spread(loads)} |")
            for c in other:
                c.zero_()
