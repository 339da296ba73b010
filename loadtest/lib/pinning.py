"""Front ends on a CPU of their own, for benchmarks that compare their CPU per request.

On a small machine a gateway shares its cores with the engines and the load client, and its
CPU per request moves with theirs: unpinned ratios moved by ±0.15 between runs on two cores
(docs/results/structure/README.md). `pinned` keeps the last CPU this process may use for
the fronts (each started through ``taskset``) and moves this process, and so everything it
starts otherwise (engines, Redis, the load), to the others. Linux only; two CPUs or more.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Pinning", "pinned"]


@dataclass(frozen=True, slots=True)
class Pinning:
    taskset: str
    front_cpu: int
    others: frozenset[int]

    def prefix(self) -> list[str]:
        """What runs a command on the fronts' CPU."""
        return [self.taskset, "-c", str(self.front_cpu)]

    def wrap(self, argv: list[str]) -> list[str]:
        """`argv` run on the fronts' CPU."""
        return [*self.prefix(), *argv]

    def describe(self, pids: dict[str, int]) -> str:
        where = ", ".join(f"{name} (pid {pid})" for name, pid in pids.items())
        others = ",".join(map(str, sorted(self.others)))
        return f"pinned: {where} on CPU {self.front_cpu}; the rest on CPUs {others}"


@contextlib.contextmanager
def pinned(pin: bool) -> Iterator[Pinning | None]:
    """With `pin`: this process on all of its CPUs but the last, kept for the fronts; its own
    affinity is given back after. Without: None."""
    if not pin:
        yield None
        return
    taskset = shutil.which("taskset")
    if taskset is None or not hasattr(os, "sched_setaffinity"):
        raise RuntimeError("--pin needs Linux's taskset (util-linux)")
    before = os.sched_getaffinity(0)
    if len(before) < 2:
        raise RuntimeError(f"--pin needs two CPUs or more; this process may use {len(before)}")
    front_cpu = max(before)
    others = frozenset(before - {front_cpu})
    os.sched_setaffinity(0, others)
    try:
        yield Pinning(taskset, front_cpu, others)
    finally:
        os.sched_setaffinity(0, before)
