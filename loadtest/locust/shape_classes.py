"""Locust ``LoadTestShape`` wrappers of shapes.py, configured from the environment.

Environment: ``PDGATE_LOCUST_DURATION_S`` (60), ``PDGATE_LOCUST_MAX_USERS`` (32),
``PDGATE_LOCUST_MIN_USERS`` (1), ``PDGATE_LOCUST_STEP_USERS`` (4), ``PDGATE_LOCUST_STEP_S``
(10), ``PDGATE_LOCUST_SPAWN_RATE`` (users started or stopped per second, 50).
"""

from __future__ import annotations

import os
import time
from typing import ClassVar

from locust import LoadTestShape

from pdgate.loadtest.locust.shapes import ShapeParams, step_users, surge_users, tidal_users

__all__ = ["SHAPES", "StepShape", "SurgeShape", "TidalShape", "params_from_env"]


def params_from_env() -> tuple[ShapeParams, float]:
    env = os.environ
    params = ShapeParams(
        duration_s=float(env.get("PDGATE_LOCUST_DURATION_S", "60")),
        max_users=int(env.get("PDGATE_LOCUST_MAX_USERS", "32")),
        min_users=int(env.get("PDGATE_LOCUST_MIN_USERS", "1")),
        step_users=int(env.get("PDGATE_LOCUST_STEP_USERS", "4")),
        step_s=float(env.get("PDGATE_LOCUST_STEP_S", "10")),
    )
    return params, float(env.get("PDGATE_LOCUST_SPAWN_RATE", "50"))


class _Shape(LoadTestShape):
    abstract: ClassVar[bool] = True  # Locust skips abstract shapes; subclasses are concrete

    def __init__(self) -> None:
        # LoadTestShape.__init__ only stamps start_time (and is untyped): done here.
        self.start_time = time.perf_counter()
        self.params, self.spawn_rate = params_from_env()

    def users_at(self, t: float) -> int | None:
        raise NotImplementedError

    def tick(self) -> tuple[int, float] | None:
        users = self.users_at(time.perf_counter() - self.start_time)
        return None if users is None else (users, self.spawn_rate)


class StepShape(_Shape):
    def users_at(self, t: float) -> int | None:
        return step_users(t, self.params)


class SurgeShape(_Shape):
    def users_at(self, t: float) -> int | None:
        return surge_users(t, self.params)


class TidalShape(_Shape):
    def users_at(self, t: float) -> int | None:
        return tidal_users(t, self.params)


SHAPES: dict[str, type[_Shape]] = {"step": StepShape, "surge": SurgeShape, "tidal": TidalShape}
