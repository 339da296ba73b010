"""The packed KV buffer of one prompt: P/D-Serve's contiguous transfer unit, as a file.

A prefill's paged KV blocks are scattered over the engine's cache; P/D-Serve (section 3.6)
gathers a request's blocks into one contiguous buffer, sends it whole, and scatters it into the
decode's own blocks on arrival (RecvScatter). Here the buffer is one file in a spool directory
on tmpfs (``/dev/shm``), shared by three processes: vLLM's worker writes it (prefill) or reads
it (decode), and the shim streams it over HTTP (``GET /v1/kv/{id}``) or receives it into it.

A 128-byte header names the model's attention shape, the dtype and the **form** of the data:

* ``rows``, layout-neutral: ``[layers, tokens, 2, kv heads, head size]``, every prompt token's
  key (0) and value (1) rows in prompt order. Written by an engine whose block interior the
  connector can read (`vllm_connector`); any such decode scatters them into its own paged
  layout, whatever its block size, and casts them to its cache dtype (seed 002's layout
  alignment, section III-B).
* ``blocks:<interior>``: ``[layers, kernel blocks, block]``, the engine's own kernel blocks
  copied whole, for an interior the connector cannot read as rows: only a decode with the
  same interior, kernel block size and dtype may load them (a scheduler block size of its
  own is fine: kernel block k holds prompt tokens from k x its size on either side).

A decode serving another model (layers, heads, head size) rejects any buffer instead of
loading garbage, and one that cannot take the form recomputes the prompt.

This module needs torch but not vLLM, and it never reads the files' paths from
the network: names are checked against `NAME_RE` and joined to the spool directory.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import struct
import threading
from dataclasses import dataclass
from hashlib import blake2b
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = [
    "HEADER_BYTES",
    "NAME_RE",
    "ROWS",
    "BufferFile",
    "KvBufferError",
    "KvLayout",
    "blocks_form",
    "buffer_path",
    "create_buffer",
    "open_buffer",
]

MAGIC = b"PDGATEKV"
VERSION = 2
HEADER_BYTES = 128
# magic, version, layers, tokens, KV heads, head size, tokens per kernel block (0: rows),
# element bytes, dtype name, form (16 ascii bytes each)
_HEADER = struct.Struct("<8sIIIIIII16s16s")
NAME_RE = re.compile(r"[0-9a-f]{32}")
_FORM_BYTES = 16
SUFFIX = ".kv"
ROWS = "rows"


class KvBufferError(Exception):
    """A buffer is missing, truncated, or does not match this engine's KV layout."""


@dataclass(frozen=True, slots=True)
class KvLayout:
    """One engine's KV in a buffer: `layers` layers of `kv_heads` heads of `head_size`
    elements of `dtype`, as token rows (`form` ``rows``) or as kernel blocks of
    `block_tokens` tokens (``blocks:<interior>``)."""

    layers: int
    kv_heads: int
    head_size: int
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    element_bytes: int
    form: str = ROWS
    block_tokens: int = 0  # blocks form only

    def __post_init__(self) -> None:
        if (self.form == ROWS) != (self.block_tokens == 0) or len(self.form) > 16:
            raise ValueError("rows take no block size; a blocks form names one")

    @property
    def rows(self) -> bool:
        return self.form == ROWS

    def shape(self, tokens: int) -> tuple[int, ...]:
        if self.rows:
            return (self.layers, tokens, 2, self.kv_heads, self.head_size)
        blocks = -(-tokens // self.block_tokens)
        return (self.layers, blocks, self.block_tokens * 2 * self.kv_heads * self.head_size)

    def nbytes(self, tokens: int) -> int:
        return HEADER_BYTES + math.prod(self.shape(tokens)) * self.element_bytes

    def model(self) -> tuple[int, int, int]:
        """What must agree between prefill and decode: the model's attention shape."""
        return (self.layers, self.kv_heads, self.head_size)


def blocks_form(interior: str) -> str:
    """The form of whole kernel blocks of `interior` (how one engine lays out a block, e.g.
    ``cpu-amx`` or ``device-fp8_e5m2``): ``blocks:<interior>``, or a digest of the interior
    where the header's 16 bytes cannot hold it, so that two engines agree on a form exactly
    when their interiors are the same (cut short, ``fp8_e4m3`` and ``fp8_e5m2`` would not
    differ)."""
    form = f"blocks:{interior}"
    if len(form) <= _FORM_BYTES:
        return form
    return "blocks:" + blake2b(interior.encode(), digest_size=4).hexdigest()


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
        layout.kv_heads,
        layout.head_size,
        layout.block_tokens,
        layout.element_bytes,
        layout.dtype.encode("ascii"),
        layout.form.encode("ascii"),
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
    return raw[HEADER_BYTES:].view(dtype).view(layout.shape(tokens))


def _create(path: Path, layout: KvLayout, tokens: int) -> None:
    """Create the buffer once: the ranks of a tensor-parallel engine each create the buffer
    of a prompt's first chunk, for their own heads. The file is made whole under a name of
    its own and linked in; where one is there already, it is written into, never truncated
    under another rank's rows."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(_header(layout, tokens))
            f.truncate(layout.nbytes(tokens))
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def create_buffer(path: Path, layout: KvLayout, tokens: int) -> torch.Tensor:
    """Create the buffer file for `tokens` tokens (or take the one another rank created,
    checked as `open_buffer` checks a writer's); returns its writable view
    (`KvLayout.shape`), backed by the file."""
    _create(path, layout, tokens)
    _check(path, layout, tokens, True)
    return _map(path, True, layout, tokens)


def open_buffer(
    path: Path, layout: KvLayout, min_tokens: int, *, writable: bool = False
) -> tuple[torch.Tensor, KvLayout]:
    """Map an existing buffer after checking that `layout`'s engine can load it (the same
    model; token rows, or else exactly its own layout) and that it holds at least
    `min_tokens` tokens; returns its view in its own dtype and its layout. Written through
    to the file only when `writable`, which needs exactly `layout` (a save appends)."""
    theirs, tokens = _check(path, layout, min_tokens, writable)
    return _map(path, writable, theirs, tokens), theirs


class BufferFile:
    """A buffer written with ``pwrite`` rather than through a mapping, for data that comes
    from a GPU through page-locked memory (`_vllm_kv_cache.HostStaging`). The device's copy
    into a file's mapping goes through the driver's own bounce buffer, one page fault at a
    time: with the one CPU thread a vLLM worker on a GPU runs, about twice as long as into
    page-locked memory and then ``pwrite`` (docs/vllm.md, "GPU"). The caller closes it."""

    __slots__ = ("_fd", "_unit_bytes", "_units")

    def __init__(self, path: Path, layout: KvLayout, tokens: int, *, create: bool) -> None:
        """Create the buffer for `tokens` tokens (`create`), or open one that a previous
        chunk created, after the checks of `open_buffer` for a writer."""
        if create:
            _create(path, layout, tokens)
        _check(path, layout, tokens, True)
        self._fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        # A layer holds `_units` token rows or kernel blocks, each `_unit_bytes` long.
        _, self._units, *unit = layout.shape(tokens)
        self._unit_bytes = math.prod(unit) * layout.element_bytes

    def write(self, layer: int, first: int, data: torch.Tensor) -> None:
        """Write `data` (contiguous, host memory, the layout's dtype: token rows or kernel
        blocks, as `KvLayout.shape` without its first two axes) as layer `layer`'s units
        from `first` on."""
        import torch

        if not data.is_contiguous() or data.device.type != "cpu":
            raise ValueError("data must be contiguous host memory")
        raw = memoryview(data.view(-1).view(torch.uint8).numpy())
        if len(raw) % self._unit_bytes or first + len(raw) // self._unit_bytes > self._units:
            raise ValueError("data past the buffer's end or not whole rows or blocks")
        offset = HEADER_BYTES + (layer * self._units + first) * self._unit_bytes
        while raw:
            written = os.pwrite(self._fd, raw, offset)
            raw, offset = raw[written:], offset + written

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _check(path: Path, layout: KvLayout, min_tokens: int, writable: bool) -> tuple[KvLayout, int]:
    """The layout and tokens of the buffer at `path`, checked as `open_buffer` says."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
            size = f.seek(0, 2)
    except OSError as exc:
        raise KvBufferError(f"KV buffer unreadable: {exc.strerror}") from None
    if len(head) < HEADER_BYTES:
        raise KvBufferError("KV buffer truncated (no header)")
    magic, version, layers, tokens, heads, head_size, block, elem, dtype, form = (
        _HEADER.unpack_from(head)
    )
    if magic != MAGIC or version != VERSION:
        raise KvBufferError("not a pdgate KV buffer of this version (bad magic or version)")
    try:
        theirs = KvLayout(layers, heads, head_size, _text(dtype), elem, _text(form), block)
    except ValueError as exc:
        raise KvBufferError(f"KV buffer header invalid: {exc}") from None
    if theirs.model() != layout.model():
        raise KvBufferError(
            f"KV layout mismatch: the buffer's (layers, KV heads, head size) is "
            f"{theirs.model()}, this engine's {layout.model()}: prefill and decode must "
            "serve the same model"
        )
    if (writable or not theirs.rows) and theirs != layout:
        raise KvBufferError(
            f"KV layout mismatch: the buffer holds {theirs.form} of {theirs.block_tokens} "
            f"tokens in {theirs.dtype}, this engine needs {layout.form} of "
            f"{layout.block_tokens} in {layout.dtype}"
        )
    if not _known_dtype(theirs.dtype, elem):
        raise KvBufferError(f"KV buffer dtype {theirs.dtype!r} unknown here")
    if tokens < min_tokens:
        raise KvBufferError(f"KV buffer holds {tokens} tokens, {min_tokens} needed")
    if size < theirs.nbytes(tokens):
        raise KvBufferError("KV buffer truncated")
    return theirs, tokens


def _text(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode("ascii", "replace")


def _known_dtype(name: str, element_bytes: int) -> bool:
    import torch

    dtype = getattr(torch, name, None)
    return isinstance(dtype, torch.dtype) and dtype.itemsize == element_bytes
