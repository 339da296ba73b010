"""The packed KV buffer of one prompt: P/D-Serve's contiguous transfer unit, as a file.

A prefill's paged KV blocks are scattered over the engine's cache; P/D-Serve (section 3.6)
gathers a request's blocks into one contiguous buffer, sends it whole, and scatters it into the
decode's own blocks on arrival (RecvScatter). Here the buffer is one file in a spool directory
on tmpfs (``/dev/shm``), shared by three processes: vLLM's worker writes it (prefill) or reads
it (decode), and the shim streams it over HTTP (``GET /v1/kv/{id}``) or receives it into it.

Layout: a 64-byte header, then ``[layers, blocks, block]`` elements of the cache dtype: the
prompt's KV blocks, whole, in prompt order, for every attention layer. Whole blocks, not
token rows, because how a block stores its tokens is the attention backend's business (the
CPU backend keeps all K rows of a block before all V rows, GPU backends interleave them):
copying blocks is right for any backend as long as both sides run the same one. The last block
may be partly filled; the decode recomputes the last prompt token and overwrites the rest. The
header names the shape and dtype, so a decode whose model, dtype or block size differs
rejects the buffer instead of loading garbage.

This module needs torch but not vLLM, and it never reads the files' paths from
the network: names are checked against `NAME_RE` and joined to the spool directory.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = [
    "HEADER_BYTES",
    "NAME_RE",
    "KvBufferError",
    "KvLayout",
    "buffer_path",
    "create_buffer",
    "open_buffer",
]

MAGIC = b"PDGATEKV"
VERSION = 1
HEADER_BYTES = 64
# magic, version, layers, tokens, tokens per block, elements per block, element bytes,
# dtype name (16 bytes, ascii)
_HEADER = struct.Struct("<8sIIIIII16s")
NAME_RE = re.compile(r"[0-9a-f]{32}")
SUFFIX = ".kv"


class KvBufferError(Exception):
    """A buffer is missing, truncated, or does not match this engine's KV layout."""


@dataclass(frozen=True, slots=True)
class KvLayout:
    """One engine's KV blocks: `layers` layers of blocks of `block_tokens` tokens, each block
    `block_elems` elements of `dtype`."""

    layers: int
    block_tokens: int
    block_elems: int
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    element_bytes: int

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def nbytes(self, tokens: int) -> int:
        data = self.layers * self.blocks(tokens) * self.block_elems * self.element_bytes
        return HEADER_BYTES + data


def buffer_path(spool_dir: str | Path, name: str) -> Path:
    """The file of buffer `name`; raises `KvBufferError` for a name that is not 32 hex digits
    (names come inside kv_transfer_params, so they must never be able to name another file)."""
    if not isinstance(name, str) or NAME_RE.fullmatch(name) is None:
        raise KvBufferError("invalid KV buffer name")
    return Path(spool_dir) / (name + SUFFIX)


def _header(layout: KvLayout, tokens: int) -> bytes:
    packed = _HEADER.pack(
        MAGIC,
        VERSION,
        layout.layers,
        tokens,
        layout.block_tokens,
        layout.block_elems,
        layout.element_bytes,
        layout.dtype.encode("ascii"),
    )
    return packed.ljust(HEADER_BYTES, b"\0")


def _map(path: Path, writable: bool, layout: KvLayout, tokens: int) -> torch.Tensor:
    import torch

    nbytes = layout.nbytes(tokens)
    # shared=True maps the file (MAP_SHARED): writes go straight to it. Readers get a private
    # mapping, so a reader can never change a buffer.
    raw = torch.from_file(str(path), shared=writable, size=nbytes, dtype=torch.uint8)
    # uint8 storage viewed as the cache dtype: works for dtypes numpy lacks (bfloat16, fp8).
    dtype = getattr(torch, layout.dtype)
    shape = (layout.layers, layout.blocks(tokens), layout.block_elems)
    return raw[HEADER_BYTES:].view(dtype).view(shape)


def create_buffer(path: Path, layout: KvLayout, tokens: int) -> torch.Tensor:
    """Create (or truncate) the buffer file for `tokens` tokens; returns its writable
    ``[layers, blocks, block]`` view, backed by the file."""
    with open(path, "wb") as f:
        f.write(_header(layout, tokens))
        f.truncate(layout.nbytes(tokens))
    return _map(path, True, layout, tokens)


def open_buffer(
    path: Path, layout: KvLayout, min_tokens: int, *, writable: bool = False
) -> torch.Tensor:
    """Map an existing buffer after checking it holds `layout` and at least `min_tokens`
    tokens; returns its ``[layers, blocks, block]`` view (written through to the file only when
    `writable`)."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
            size = f.seek(0, 2)
    except OSError as exc:
        raise KvBufferError(f"KV buffer unreadable: {exc.strerror}") from None
    if len(head) < HEADER_BYTES:
        raise KvBufferError("KV buffer truncated (no header)")
    magic, version, layers, tokens, block_tokens, block, elem, dtype = _HEADER.unpack_from(head)
    if magic != MAGIC or version != VERSION:
        raise KvBufferError("not a pdgate KV buffer (bad magic or version)")
    theirs = (layers, block_tokens, block, elem, dtype.rstrip(b"\0").decode("ascii", "replace"))
    ours = (
        layout.layers,
        layout.block_tokens,
        layout.block_elems,
        layout.element_bytes,
        layout.dtype,
    )
    if theirs != ours:
        raise KvBufferError(
            f"KV layout mismatch: buffer has (layers, block tokens, block elements, element "
            f"bytes, dtype)={theirs}, "
            f"this engine {ours}: prefill and decode must serve the same model and dtype"
        )
    if tokens < min_tokens:
        raise KvBufferError(f"KV buffer holds {tokens} tokens, {min_tokens} needed")
    if size < layout.nbytes(tokens):
        raise KvBufferError("KV buffer truncated")
    return _map(path, writable, layout, tokens)
