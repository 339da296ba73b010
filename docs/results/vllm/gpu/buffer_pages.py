"""Where a save's time goes: the buffer file's pages or the copy.

    PYTHONPATH=<a folder holding pdgate/engine_shim> python3 buffer_pages.py [--device cuda]

The connector's save (`save_rows`) of a 4,096-token Llama-3.1-8B prompt (32 layers, 8 KV
heads of 128, bfloat16, FlashAttention's layout, scattered 16-token blocks) into:

* ``fresh``: a new buffer file each time, as the connector does now;
* ``reused``: one file written again, its pages already in memory;
* ``reused, pinned``: the same, its mapping page-locked for the GPU (``cudaHostRegister``,
  timed with the save) and unlocked after;
* ``pinned tensor``: page-locked host memory, no file: the copy alone.

And, as an experiment outside the buffer format: the rows' keys and values kept apart,
``[layers, 2, tokens, heads, head size]`` (the format interleaves them per token, so each
half is a strided write), into the reused file and into a pinned tensor.

Five runs each after a warm-up; min / median / max ms. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    device = parser.parse_args().device
    cuda = device.startswith("cuda")
    blocks = 2 * TOKENS // BLOCK + 8
    ids = torch.randperm(blocks, generator=torch.Generator().manual_seed(0))
    span = Span(ids[: TOKENS // BLOCK].tolist(), 0, TOKENS, BLOCK)
    cache = [
        torch.randn(2, blocks, BLOCK, HEADS, HEAD_SIZE, dtype=torch.bfloat16, device=device)
        for _ in range(LAYERS)
    ]
    layout = KvLayout(LAYERS, HEADS, HEAD_SIZE, "bfloat16", 2)
    spool = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    reused = buffer_path(spool, "0" * 32)
    create_buffer(reused, layout, TOKENS)  # its pages allocated once, here
    counter = iter(range(1, 1_000_000))

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def fill(buf: torch.Tensor) -> None:
        for layer in range(LAYERS):
            save_rows(cache[layer], buf[layer], span)

    def fresh() -> None:
        path = buffer_path(spool, f"{next(counter):032x}")
        fill(create_buffer(path, layout, TOKENS))
        path.unlink()

    def again() -> None:
        fill(open_buffer(reused, layout, TOKENS, writable=True)[0])

    def again_pinned() -> None:
        buf = open_buffer(reused, layout, TOKENS, writable=True)[0]
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
            str(reused), shared=True, size=layout.nbytes(TOKENS), dtype=torch.uint8
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
    print(f"device: {torch.cuda.get_device_name() if cuda else 'cpu'}; torch {torch.__version__}")
    print(f"save of {TOKENS} tokens, {layout.nbytes(TOKENS) / 2**20:.0f} MiB, as token rows")
    print()
    print("| buffer | save ms min / med / max |")
    print("|---|---|")
    for name, case in cases:
        took = []
        for run in range(RUNS + 1):
            sync()
            began = time.perf_counter()
            case()
            sync()
            if run:
                took.append((time.perf_counter() - began) * 1e3)
        print(f"| {name} | {min(took):.1f} / {statistics.median(took):.1f} / {max(took):.1f} |")
    reused.unlink()
    spool.rmdir()


if __name__ == "__main__":
    main()
