"""`pdgate bench stages` times a lone request's steps by wrapping the gateway's methods
(docs/results/performance/README.md, "A lone request, step by step"). Its table holds only
while every step it names is still on the request's path: run as a user runs it (in a process
of its own: it wraps classes), every request must meet every step, in order."""

from __future__ import annotations

import subprocess
import sys

import pytest

_ONE_SHORT_ROUND = ("--rounds", "1", "--requests", "50", "--warmup", "10")


def test_every_step_is_on_a_lone_requests_path() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pdgate.loadtest.bench", "stages", *_ONE_SHORT_ROUND],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {
        cells[0]: float(cells[-1].split(" / ")[1])
        for line in done.stdout.splitlines()
        if line.startswith("| ") and not line.startswith("| step")
        for cells in [[c.strip().strip("*") for c in line.strip("|").split("|")]]
    }
    steps = ["read", "parsed", "described", "relaying", "dispatched", "queued", "woken", "turn",
             "candidates", "reserving", "reserved", "attempting", "prefill_call", "decode_call",
             "first_event", "ended"]  # fmt: skip
    assert [k for k in rows if k in steps] == steps
    assert all(rows[step] >= 0 for step in steps)
    to_prefill = sum(rows[s] for s in steps[: steps.index("prefill_call") + 1])
    # The table's figures are rounded to 0.1 us: thirteen of them sum to within 0.7.
    assert rows["to the prefill call"] == pytest.approx(to_prefill, abs=0.7)
    assert 0 < rows["to the prefill call"] < rows["whole request"]
