"""The Locust workload file."""

from __future__ import annotations

import random
from pathlib import Path

import orjson
import pytest

from pdgate.loadtest.locust.workload import DEFAULT_WORKLOAD, load_workload


def test_the_shipped_workload_loads_and_picks_by_weight() -> None:
    workload = load_workload(DEFAULT_WORKLOAD, model="m")
    assert workload.model == "m"
    assert 1 <= len(workload.requests) <= 10  # small on purpose
    rng = random.Random(0)
    names = [workload.pick(rng).name for _ in range(1000)]
    assert names.count("chat") > names.count("rag")


def test_bad_workloads_are_rejected(tmp_path: Path) -> None:
    path = tmp_path / "w.json"
    path.write_bytes(orjson.dumps({"model": "m", "requests": []}))
    with pytest.raises(ValueError, match="requests"):
        load_workload(path)
    path.write_bytes(
        orjson.dumps({"model": "m", "requests": [{"name": "a", "prompt": "p", "max_tokens": 0}]})
    )
    with pytest.raises(ValueError, match="positive"):
        load_workload(path)
