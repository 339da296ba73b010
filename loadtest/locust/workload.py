"""The Locust workload file (workload.json, beside this module): a model and a few weighted
prompts.

The file is small on purpose: Locust measures the gateway's serving path, while prompt-mix
experiments live in loadtest/scheduling/workload.py. ``PDGATE_LOCUST_WORKLOAD`` names
another file and ``PDGATE_LOCUST_MODEL`` overrides its model.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path

import orjson

__all__ = ["DEFAULT_WORKLOAD", "LocustRequest", "LocustWorkload", "load_workload"]

DEFAULT_WORKLOAD = Path(__file__).with_name("workload.json")
_MAX_REQUESTS = 1000  # a workload file is a handful of prompts, not a trace


@dataclass(frozen=True, slots=True)
class LocustRequest:
    name: str  # reported as the Locust request name; the prompt itself is never reported
    prompt: str
    max_tokens: int
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class LocustWorkload:
    model: str
    requests: tuple[LocustRequest, ...]

    def pick(self, rng: random.Random) -> LocustRequest:
        return rng.choices(self.requests, weights=[r.weight for r in self.requests])[0]


def load_workload(path: Path | None = None, model: str | None = None) -> LocustWorkload:
    path = path or Path(os.environ.get("PDGATE_LOCUST_WORKLOAD", DEFAULT_WORKLOAD))
    data = orjson.loads(path.read_bytes())
    rows = data["requests"]
    if not 0 < len(rows) <= _MAX_REQUESTS:
        raise ValueError(f"{path}: needs 1..{_MAX_REQUESTS} requests, got {len(rows)}")
    requests = tuple(
        LocustRequest(
            name=str(r["name"]),
            prompt=str(r["prompt"]),
            max_tokens=int(r["max_tokens"]),
            weight=float(r.get("weight", 1.0)),
        )
        for r in rows
    )
    if any(r.max_tokens <= 0 or r.weight <= 0 for r in requests):
        raise ValueError(f"{path}: max_tokens and weight must be positive")
    return LocustWorkload(
        model=model or os.environ.get("PDGATE_LOCUST_MODEL") or str(data["model"]),
        requests=requests,
    )
