"""Load shapes: the pure functions and the Locust classes' tick()."""

from __future__ import annotations

from pathlib import Path

import pytest

import pdgate.loadtest.locust
from pdgate.loadtest.locust.shapes import ShapeParams, step_users, surge_users, tidal_users

P = ShapeParams(duration_s=100.0, max_users=20, min_users=2, step_users=5, step_s=10.0)


def test_step_climbs_to_the_cap_then_stops() -> None:
    assert [step_users(t, P) for t in (0, 9.9, 10, 25, 39, 99)] == [5, 5, 10, 15, 20, 20]
    assert step_users(100, P) is None


def test_surge_is_base_peak_base() -> None:
    assert surge_users(0, P) == 2
    assert surge_users(39.9, P) == 2
    assert surge_users(40, P) == 20
    assert surge_users(59.9, P) == 20
    assert surge_users(60, P) == 2
    assert surge_users(100, P) is None


def test_tidal_day_is_quiet_at_night_and_busy_by_day() -> None:
    users = [tidal_users(t, P) for t in range(100)]
    assert all(u is not None and P.min_users <= u <= P.max_users for u in users)
    night = tidal_users(100 * 3.5 / 24, P)  # 03:30
    morning_peak = tidal_users(100 * 10 / 24, P)  # 10:00
    assert night == P.min_users + 1  # 5% of the range above the floor
    assert morning_peak == P.max_users
    assert tidal_users(100, P) is None


def test_bad_params_are_rejected() -> None:
    with pytest.raises(ValueError, match="positive"):
        ShapeParams(duration_s=0)
    with pytest.raises(ValueError, match="min_users"):
        ShapeParams(min_users=5, max_users=4)


def _import_locust(monkeypatch: pytest.MonkeyPatch) -> None:
    # Importing Locust runs gevent's monkey.patch_all() unless told not to; patched sockets
    # and threads would leak into every later test of this pytest process.
    monkeypatch.setenv("LOCUST_SKIP_MONKEY_PATCH", "1")
    pytest.importorskip("locust")


def test_locust_shape_classes_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    _import_locust(monkeypatch)
    from pdgate.loadtest.locust.shape_classes import SHAPES, StepShape

    monkeypatch.setenv("PDGATE_LOCUST_DURATION_S", "100")
    monkeypatch.setenv("PDGATE_LOCUST_MAX_USERS", "20")
    monkeypatch.setenv("PDGATE_LOCUST_STEP_USERS", "5")
    monkeypatch.setenv("PDGATE_LOCUST_SPAWN_RATE", "7")
    shape = StepShape()
    assert shape.tick() == (5, 7.0)
    shape.start_time -= 15  # 15 s into the run
    assert shape.tick() == (10, 7.0)
    shape.start_time -= 100
    assert shape.tick() is None
    for cls in SHAPES.values():
        assert not cls.abstract
        users, rate = cls().tick() or (None, None)
        assert users is not None and 1 <= users <= 20 and rate == 7.0


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ("surge", ["SurgeShape"]),
        ("tidal", ["TidalShape"]),
        ("", ["StepShape", "SurgeShape", "TidalShape"]),  # all, for --class-picker
    ],
)
def test_the_locustfile_binds_the_shape_asked_for(
    monkeypatch: pytest.MonkeyPatch, env: str, expected: list[str]
) -> None:
    _import_locust(monkeypatch)
    from locust.util.load_locustfile import load_locustfile

    monkeypatch.setenv("PDGATE_LOCUST_SHAPE", env)
    locustfile = Path(pdgate.loadtest.locust.__file__).with_name("locustfile.py")
    users, shapes = load_locustfile(str(locustfile))
    assert list(users) == ["OpenAIStreamUser"]
    assert sorted(type(s).__name__ for s in shapes) == expected
