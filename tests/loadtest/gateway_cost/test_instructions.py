"""`pdgate bench instructions` counts, under valgrind, a process that runs `pdgate bench
hotpath`'s driver by this file's path. Without valgrind: that process runs and serves every
request in this build, and the command line is wired."""

from __future__ import annotations

import subprocess
import sys

from pdgate.loadtest.gateway_cost.instructions import counted_argv


def test_the_counted_process_serves_its_requests() -> None:
    done = subprocess.run(counted_argv(20), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == ""  # valgrind's count is the whole report


def test_the_command_parses_its_options() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pdgate.loadtest.bench", "instructions", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "--same-mock" in done.stdout
    assert "--no-drain" in done.stdout
