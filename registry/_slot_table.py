"""Prefill slots shared by the worker processes of one node, without Redis.

``pdgate gateway --workers N`` with an in-memory registry has no Redis to lease slots from,
yet the workers front the same prefills: a stock prefill that queues must never hold more
requests than its declared slots, whichever worker sent them. The supervisor creates one
`SlotTable` (an unlinked file, mapped shared) and hands its descriptor to every worker; a
worker leases whole slots from it, so any worker may use any free slot (an instance with
fewer slots than workers is fully usable, and a burst that lands on one worker is not held
to a fraction of the capacity).

Layout: a header, then `rows` 16-byte keys (a digest of the instance id; all zero: never
used), then `rows` x `workers` int32 counts (slots each worker holds on that instance), and a
generation counter bumped by every release (workers poll it to learn that a slot freed).
Open addressing with linear probing; a row whose counts are all zero is reused for a new
instance, so the table is bounded by the instances holding slots at once, not by every id
ever seen. Every change happens under an exclusive POSIX record lock (``lockf``: per
process, so it excludes the other workers; the critical sections are a few microseconds).

A worker that dies holds nothing: the supervisor zeroes its column when it exits, and a
worker zeroes its own column when it starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import struct
import tempfile
from collections.abc import Iterator, Sequence
from typing import IO

__all__ = ["ROWS", "SlotTable"]

ROWS = 4096  # instances holding slots at once (the registry's max_instances default)
_MAGIC = b"pdgslot1"
_HEADER = struct.Struct("<8sIIQ")  # magic, rows, workers, generation
_KEY = 16
_EMPTY = bytes(_KEY)


def _key(instance_id: str) -> bytes:
    return hashlib.blake2b(instance_id.encode(), digest_size=_KEY).digest()


class SlotTable:
    """One mapping of the shared table; `worker` is this process's column (-1: the
    supervisor, which only clears columns)."""

    def __init__(self, fd: int, worker: int, *, owner: IO[bytes] | None = None) -> None:
        size = os.fstat(fd).st_size
        if size < _HEADER.size:
            raise ValueError(f"fd {fd} is not a slot table")
        self._fd = fd
        self._owner = owner  # the supervisor keeps the file open
        self._map = mmap.mmap(fd, size)
        magic, rows, workers, _ = _HEADER.unpack_from(self._map, 0)
        self.rows, self.workers = int(rows), int(workers)
        if magic != _MAGIC or size != _size(self.rows, self.workers):
            self._map.close()
            raise ValueError(f"fd {fd} is not a slot table")
        if not -1 <= worker < self.workers:
            self._map.close()
            raise ValueError(f"worker {worker} is not in 0..{self.workers - 1}")
        self.worker = worker
        keys_at = _HEADER.size
        self._keys = memoryview(self._map)[keys_at : keys_at + self.rows * _KEY]
        counts_at = keys_at + self.rows * _KEY
        self._counts = memoryview(self._map)[counts_at:].cast("i")
        if worker >= 0:
            self.clear_worker(worker)  # a restarted worker inherits nothing

    @classmethod
    def create(cls, workers: int, rows: int = ROWS) -> SlotTable:
        """A new table (the supervisor's handle); pass `fd` to the workers."""
        if workers < 1 or rows < 1:
            raise ValueError("workers and rows must be positive")
        # Unlinked: it goes when the last process holding it exits. Kept open by the handle.
        owner = tempfile.TemporaryFile()  # noqa: SIM115
        owner.truncate(_size(rows, workers))
        owner.write(_HEADER.pack(_MAGIC, rows, workers, 0))
        owner.flush()
        return cls(owner.fileno(), -1, owner=owner)

    @property
    def fd(self) -> int:
        return self._fd

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.lockf(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN)

    def _row(self, instance_id: str, *, insert: bool) -> int | None:
        key = _key(instance_id)
        start = int.from_bytes(key[:8], "little") % self.rows
        reusable: int | None = None
        for step in range(self.rows):
            row = (start + step) % self.rows
            found = self._keys[row * _KEY : (row + 1) * _KEY]
            if found == key:
                return row
            if found == _EMPTY:
                if not insert:
                    return None
                row = row if reusable is None else reusable
                break
            if insert and reusable is None and not any(self._column_sums(row)):
                reusable = row
        else:
            if reusable is None:
                return None  # every row holds slots: no room to count one more instance
            row = reusable
        self._keys[row * _KEY : (row + 1) * _KEY] = key
        return row

    def _column_sums(self, row: int) -> memoryview:
        return self._counts[row * self.workers : (row + 1) * self.workers]

    def used(self, instance_id: str) -> int:
        """Slots all workers hold on the instance."""
        with self._locked():
            row = self._row(instance_id, insert=False)
            return 0 if row is None else sum(self._column_sums(row))

    def acquire(self, candidates: Sequence[tuple[str, int]], want: int) -> tuple[int, int]:
        """Up to `want` slots on the first ``(instance_id, capacity)`` with room: (its index
        in `candidates`, slots granted), or (-1, 0)."""
        if self.worker < 0:
            raise RuntimeError("the supervisor's handle holds no slots")
        with self._locked():
            for i, (instance_id, capacity) in enumerate(candidates):
                row = self._row(instance_id, insert=True)
                if row is None:
                    continue
                free = capacity - sum(self._column_sums(row))
                if free > 0:
                    granted = min(free, want)
                    self._counts[row * self.workers + self.worker] += granted
                    return i, granted
        return -1, 0

    def release(self, instance_id: str, n: int = 1) -> None:
        with self._locked():
            row = self._row(instance_id, insert=False)
            if row is not None:
                cell = row * self.workers + self.worker
                self._counts[cell] = max(0, self._counts[cell] - n)
            self._bump()

    def clear_worker(self, worker: int) -> None:
        """Give back every slot `worker` holds (it died, or is starting afresh)."""
        with self._locked():
            for row in range(self.rows):
                self._counts[row * self.workers + worker] = 0
            self._bump()

    def _bump(self) -> None:
        magic, rows, workers, generation = _HEADER.unpack_from(self._map, 0)
        _HEADER.pack_into(self._map, 0, magic, rows, workers, (generation + 1) % (1 << 63))

    def generation(self) -> int:
        """Changes whenever a slot frees (read without the lock: a torn read only means one
        more or one fewer wake-up)."""
        return int(_HEADER.unpack_from(self._map, 0)[3])

    def close(self) -> None:
        self._keys.release()
        self._counts.release()
        self._map.close()
        if self._owner is not None:
            self._owner.close()


def _size(rows: int, workers: int) -> int:
    return _HEADER.size + rows * _KEY + rows * workers * 4
