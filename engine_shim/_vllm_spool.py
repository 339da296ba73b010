"""The shim's side of the packed KV buffers: a spool directory, and buffers as KvSource/KvSink.

vLLM's worker process writes (prefill) or reads (decode) a request's packed KV buffer as a
file in the spool directory (see `_vllm_kv_buffer` and `vllm_connector`); the shim process
serves that file over ``GET /v1/kv/{id}`` (`FileKvSource`) or receives a pulled buffer into it
(`FileKvSink`). The directory lives on tmpfs (``/dev/shm``) when there is one, so a buffer is
memory shared between the processes, never a disk write.

Every file is owned by exactly one object that unlinks it; `Spool.sweep` removes files older
than a bound anyway (an aborted prefill step can still write a buffer after its request was
withdrawn), and `Spool.close` removes the directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from hashlib import blake2b
from pathlib import Path
from typing import BinaryIO

__all__ = ["FileKvSink", "FileKvSource", "Spool"]

_DIGEST_CHUNK = 1 << 20
_SHM = Path("/dev/shm")


def _default_root() -> str:
    if _SHM.is_dir() and os.access(_SHM, os.W_OK):
        return str(_SHM)
    return tempfile.gettempdir()


class Spool:
    """A private directory of KV buffer files, named by 32 hex digits."""

    def __init__(self, root: str | None = None) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="pdgate-kv-", dir=root or _default_root()))

    def new_name(self) -> str:
        return uuid.uuid4().hex

    def file(self, name: str) -> Path:
        # Same rule as _vllm_kv_buffer.buffer_path; the names here are always generated.
        return self.path / (name + ".kv")

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.file(name))

    def sweep(self, max_age_s: float) -> int:
        """Remove buffers older than `max_age_s` (orphans); returns how many."""
        cutoff = time.time() - max_age_s
        removed = 0
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.path):
                with contextlib.suppress(FileNotFoundError):
                    if entry.stat().st_mtime < cutoff:
                        os.unlink(entry.path)
                        removed += 1
        return removed

    def count(self) -> int:
        with contextlib.suppress(FileNotFoundError):
            return sum(1 for _ in os.scandir(self.path))
        return 0

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def _digest(path: Path) -> tuple[str, int]:
    h = blake2b(digest_size=16)
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_DIGEST_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


class FileKvSource:
    """`KvSource` over a finished buffer file; `release` unlinks it."""

    __slots__ = ("_path", "_released", "digest", "nbytes", "tokens")

    def __init__(self, path: Path, tokens: int, nbytes: int, digest: str) -> None:
        self._path = path
        self.tokens = tokens
        self.nbytes = nbytes
        self.digest = digest
        self._released = False

    @classmethod
    async def open(cls, path: Path, tokens: int) -> FileKvSource:
        """The buffer at `path`, its digest computed off the event loop (it may be large)."""
        digest, nbytes = await asyncio.to_thread(_digest, path)
        return cls(path, tokens, nbytes, digest)

    async def chunks(self, chunk_bytes: int) -> AsyncIterator[bytes]:
        # tmpfs reads are memory copies: small enough to do on the loop, chunk by chunk.
        with open(self._path, "rb") as f:  # noqa: ASYNC230
            remaining = self.nbytes
            while remaining > 0:
                chunk = f.read(min(chunk_bytes, remaining))
                if not chunk:
                    raise OSError("KV buffer shrank while being sent")
                remaining -= len(chunk)
                yield chunk

    def release(self) -> None:
        if not self._released:
            self._released = True
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)


class FileKvSink:
    """`KvSink` writing a pulled buffer into the spool; the decode engine loads it by `name`."""

    __slots__ = ("_file", "_path", "committed", "expected", "name", "received", "tokens")

    def __init__(self, spool: Spool, tokens: int, nbytes: int) -> None:
        self.name = spool.new_name()
        self.tokens = tokens
        self.expected = nbytes
        self.received = 0
        self.committed = False
        self._path = spool.file(self.name)
        self._file: BinaryIO | None = open(self._path, "wb")  # noqa: SIM115 - closed in commit/discard

    def write(self, chunk: bytes) -> None:
        if self._file is None:
            raise RuntimeError("KV sink is closed")
        self.received += len(chunk)
        if self.received > self.expected:
            raise ValueError(f"more KV bytes than announced ({self.expected})")
        self._file.write(chunk)

    async def commit(self) -> None:
        if self._file is None:
            raise RuntimeError("KV sink was discarded")
        self._file.close()
        self._file = None
        if self.received != self.expected:
            self.discard()
            raise ValueError(f"received {self.received} KV bytes, expected {self.expected}")
        self.committed = True

    def discard(self) -> None:
        """Drop the buffer (transfer failed, or the engine has loaded it). Idempotent."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self.committed = False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)
