"""CPU time and memory of processes, read from ``/proc`` (Linux), so the load generator's
own cost can be told apart from what it measures."""

from __future__ import annotations

import contextlib
import math
import os
import resource

__all__ = ["cpu_s", "host_busy_s", "open_fds", "own_cpu_s", "rss_bytes", "rss_kib"]

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        # The command name (field 2) may hold spaces and parentheses: split after its end.
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime, stime


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of `pid` and of its live children, recursively (a ``--workers``
    supervisor's workers count towards the gateway's cost)."""
    total = cpu_s(pid)
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except OSError:
        return total
    for child in children:
        with contextlib.suppress(OSError):  # it exited just now
            total += tree_cpu_s(child)
    return total


def rss_kib(pid: int) -> int:
    """Resident set size of `pid` in KiB (``VmRSS`` of /proc/PID/status: anonymous, file
    and shared pages together, what ``ps`` and ``top`` show)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise ProcessLookupError(f"process {pid} has no VmRSS (a zombie?)")


def rss_bytes(pid: int) -> int:
    return 1024 * rss_kib(pid)


def open_fds(pid: int) -> int:
    """The process's open file descriptors (sockets included)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def own_cpu_s() -> float:
    """CPU seconds of this process (the load generator)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def host_busy_s() -> float:
    """CPU seconds the whole machine spent busy (all processes, all cores), from /proc/stat:
    other jobs on a shared two-core box show up as busy time no measured process accounts
    for. NaN where /proc/stat is missing."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return math.nan
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / _CLK_TCK
