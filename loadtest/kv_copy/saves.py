"""``pdgate bench kv-copy save-paths`` and ``buffer-pages``: a 4,096-token prompt saved as
token rows from scattered blocks of the engine's cache (cache.py), in several ways.

``save-paths``: each time into a new buffer file in /dev/shm (as the connector does), by:

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

``buffer-pages``: where a save's time goes, the file's pages or the copy. The connector's
save (`save_rows`) into:

* ``fresh``: a new buffer file each time, as the connector does now;
* ``reused``: one file written again, its pages already in memory;
* ``reused, pinned``: the same, its mapping page-locked for the GPU (``cudaHostRegister``,
  timed with the save) and unlocked after;
* ``pinned tensor``: page-locked host memory, no file: the copy alone.

And, as an experiment outside the buffer format: the rows' keys and values kept apart,
``[layers, 2, tokens, heads, head size]`` (the format interleaves them per token, so each
half is a strided write), into the reused file and into a pinned tensor.

``--threads N`` sets torch's CPU threads first: a vLLM worker on a GPU serves with one
(``set_torch_threads_for_runtime``), and torch spreads a CPU-side copy over its threads.
Each prints a Markdown table.
"""

from __future__ import annotations

import ctypes
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from pdgate.engine_shim import _vllm_kv_buffer as kv_buffer
from pdgate.engine_shim._vllm_kv_buffer import HEADER_BYTES, KvLayout, create_buffer, open_buffer
from pdgate.engine_shim._vllm_kv_cache import Span, save_rows, token_slots, token_views
from pdgate.loadtest.kv_copy import cache as kv_cache
from pdgate.loadtest.kv_copy.cache import BLOCK, HEAD_SIZE, HEADS, LAYERS, TOKENS

__all__ = ["buffer_pages", "save_paths"]

MADV_POPULATE_WRITE = 23  # Linux 5.14
_Case = Callable[[], None]


class _Prompt:
    """The prompt's blocks in one engine's cache, its buffers' layout, and a folder (in
    /dev/shm where there is one) with one buffer file written once, its pages allocated."""

    def __init__(self, device: str, threads: int) -> None:
        kv_cache.set_threads(threads)
        self.device = device
        self.cuda = device.startswith("cuda")
        blocks = 2 * TOKENS // BLOCK + 8
        self._ids = torch.randperm(blocks, generator=torch.Generator().manual_seed(0))
        self.cache = kv_cache.engine_cache(blocks, device)
        self.layout = KvLayout(LAYERS, HEADS, HEAD_SIZE, "bfloat16", 2)
        self.spool = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
        self.reused = kv_buffer.buffer_path(self.spool, "0" * 32)
        create_buffer(self.reused, self.layout, TOKENS)  # its pages allocated once, here
        self._counter = iter(range(1, 1_000_000))
        self.sync = kv_cache.synchronizer(device)

    def span(self) -> Span:
        return Span(self._ids[: TOKENS // BLOCK].tolist(), 0, TOKENS, BLOCK)

    def fresh_path(self) -> Path:
        return kv_buffer.buffer_path(self.spool, f"{next(self._counter):032x}")

    def table(self, about: str, columns: str, cases: list[tuple[str, _Case]]) -> None:
        """Print the header lines and one row a case; then remove the folder."""
        print(f"{kv_cache.device_line(self.device)}; torch {torch.__version__}")
        print(f"save of {TOKENS} tokens, {self.layout.nbytes(TOKENS) / 2**20:.0f} MiB, {about}")
        print()
        print(f"| {columns} |")
        print("|---|---|")
        for name, case in cases:
            try:
                took = kv_cache.timed(case, self.sync)
            except OSError as exc:  # MADV_POPULATE_WRITE needs Linux 5.14
                print(f"| {name} | failed: {exc} |")
                continue
            print(f"| {name} | {kv_cache.spread(took)} |")
        self.reused.unlink()
        self.spool.rmdir()


def buffer_pages(device: str, threads: int) -> None:
    prompt = _Prompt(device, threads)
    cuda, cache, layout, sync = prompt.cuda, prompt.cache, prompt.layout, prompt.sync
    span = prompt.span()

    def fill(buf: torch.Tensor) -> None:
        for layer in range(LAYERS):
            save_rows(cache[layer], buf[layer], span)

    def fresh() -> None:
        path = prompt.fresh_path()
        fill(create_buffer(path, layout, TOKENS))
        path.unlink()

    def again() -> None:
        fill(open_buffer(prompt.reused, layout, TOKENS, writable=True)[0])

    def again_pinned() -> None:
        buf = open_buffer(prompt.reused, layout, TOKENS, writable=True)[0]
        cudart = torch.cuda.cudart()
        mapping = buf.untyped_storage()  # the whole file, header included
        assert int(cudart.cudaHostRegister(mapping.data_ptr(), mapping.nbytes(), 0)) == 0
        fill(buf)
        sync()
        assert int(cudart.cudaHostUnregister(mapping.data_ptr())) == 0

    pinned = torch.empty(layout.shape(TOKENS), dtype=torch.bfloat16, pin_memory=cuda)

    def tensor() -> None:
        fill(pinned)

    apart_shape = (LAYERS, 2, TOKENS, HEADS, HEAD_SIZE)

    def fill_apart(buf: torch.Tensor) -> None:
        for layer in range(LAYERS):
            kernel, slot = token_slots(cache[layer], span)
            keys, values = token_views(cache[layer])
            buf[layer, 0] = keys[kernel, slot]
            buf[layer, 1] = values[kernel, slot]

    def again_apart() -> None:
        raw = torch.from_file(
            str(prompt.reused), shared=True, size=layout.nbytes(TOKENS), dtype=torch.uint8
        )
        fill_apart(raw[HEADER_BYTES:].view(torch.bfloat16).view(apart_shape))

    pinned_apart = torch.empty(apart_shape, dtype=torch.bfloat16, pin_memory=cuda)

    def tensor_apart() -> None:
        fill_apart(pinned_apart)

    cases: list[tuple[str, Callable[[], None]]] = [("fresh", fresh), ("reused", again)]
    if cuda:
        cases.append(("reused, pinned", again_pinned))
    cases.append(("pinned tensor" if cuda else "tensor", tensor))
    cases.append(("reused, keys and values apart", again_apart))
    cases.append(
        ("pinned tensor, keys and values apart" if cuda else "tensor, apart", tensor_apart)
    )
    prompt.table("as token rows", "buffer | save ms min / med / max", cases)


def save_paths(device: str, threads: int) -> None:
    prompt = _Prompt(device, threads)
    cuda, cache, layout, sync = prompt.cuda, prompt.cache, prompt.layout, prompt.sync
    nbytes = layout.nbytes(TOKENS)
    libc = ctypes.CDLL(None, use_errno=True)
    staging = torch.empty(layout.shape(TOKENS)[1:], dtype=torch.bfloat16, pin_memory=cuda)

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
        path = prompt.fresh_path()
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
        s = prompt.span()
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
        s = prompt.span()
        for layer in range(LAYERS):
            stacked(cache[layer], staging, s)
        sync()

    def staged_pwrite() -> None:
        path = prompt.fresh_path()
        create_buffer(path, layout, TOKENS)
        fd = os.open(path, os.O_RDWR)
        s = prompt.span()
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
        buf = open_buffer(prompt.reused, layout, TOKENS, writable=True)[0]
        s = prompt.span()
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
    threads_now = torch.get_num_threads()
    about = f"as token rows, fresh files; torch CPU threads: {threads_now}"
    prompt.table(about, "save | ms min / med / max", cases)
