"""The scheduling report over several seeds and deployments: medians, spread, tables."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from pdgate.loadtest.lib.stats import RequestResult, summarize
from pdgate.loadtest.scheduling.capacity import Capacity, CapacityPlan
from pdgate.loadtest.scheduling.command import describe
from pdgate.loadtest.scheduling.experiment import Plan, Result
from pdgate.loadtest.scheduling.modes import mode_named
from pdgate.loadtest.scheduling.report import (
    capacity_table,
    markdown_table,
    spread_table,
    summary_json,
)
from pdgate.loadtest.scheduling.runner import Holds, Point


def _point(seed: int, ok: int, hold: float, gateways: int = 2) -> Point:
    rows = [
        RequestResult("chat", 1.0, 200, 0.1, 0.5, True, gateway=i % gateways) for i in range(ok)
    ]
    rows += [RequestResult("chat", 1.0, 503, None, 1.0, False, gateway=1)] * (10 - ok)
    return Point("least_sse", 4, summarize(rows, 1.0), {}, 0.1, 0.1, 0.2, {}, 2.0,
                 holds=Holds(hold, 0.0, 0.0), seed=seed)  # fmt: skip


def _result() -> Result:
    plan = Plan(
        gateways=(2,),
        deploys=("processes",),
        seeds=(0, 1, 2),
        modes=(mode_named("least_sse"),),
        multiples=(1,),
        base_users=4,
    )
    points = {"least_sse": {"1": [_point(0, 10, 0.1), _point(1, 8, 31.0), _point(2, 9, 0.2)]}}
    return Result(plan, 4, [], points, wall_s=1.0)


def test_json_has_medians_worst_holds_spread_and_gateways() -> None:
    data = summary_json(_result())
    assert data["success"] == {"least_sse": {"1": pytest.approx(0.9)}}  # median of 1, .8, .9
    assert data["goodput"]["least_sse"]["1"] == pytest.approx(9.0)
    assert data["kv_hold_max_s"] == {"least_sse": {"1": 31.0}}  # the worst seed: a leak shows
    spread = data["spread"]["success"]["least_sse"]["1"]
    assert spread == {"min": pytest.approx(0.8), "median": pytest.approx(0.9), "max": 1.0}
    # gateway 1 got the failures: its median success is the lower one
    g0, g1 = data["success_by_gateway"]["least_sse"]["1"]
    assert g0 == 1.0 and g1 < 1.0
    assert data["seeds"] == [0, 1, 2] and data["gateways"] == 2


def test_tables_have_a_row_per_seed_and_the_spread() -> None:
    result = _result()
    table = markdown_table(result)
    assert table.count("| least_sse | 1A |") == 3
    assert "| seed |" in table and "| success per gateway |" in table
    assert "31.00 / 0 / 0" in table  # KV hold max / >5 s / stranded
    spread = spread_table(result)
    assert "| least_sse | 1A | 3 | 80.0% / 90.0% / 100.0% | 8.00 / 9.00 / 10.00 | 31.00 |" in spread


def test_one_seed_no_spread_and_unknown_holds_read_na() -> None:
    result = _result()
    result.plan = Plan(modes=(mode_named("least_sse"),), multiples=(1,), base_users=4)
    old_shims = replace(_point(0, 10, 0.0, gateways=1), holds=Holds())  # no hold keys
    result.points = {"least_sse": {"1": [old_shims]}}
    data = summary_json(result)
    assert spread_table(result) == ""
    assert "spread" not in data and "success_by_gateway" not in data
    assert "n/a / n/a / n/a" in markdown_table(result)
    assert math.isnan(data["kv_hold_max_s"]["least_sse"]["1"])  # null in the JSON line


def test_describe_names_the_deployment() -> None:
    assert "one event loop" in describe(Plan())
    both = describe(Plan(deploys=("inprocess", "processes")))
    assert "@inprocess" in both and "@processes: every shim and gateway its own process" in both


def _tenant_point(load_fraction: float) -> Point:
    ok = RequestResult("chat", 1.0, 200, 0.1, 0.5, True, tenant="heavy")
    light_ok = RequestResult("chat", 1.0, 200, 0.1, 0.5, True, tenant="light-a")
    light_late = RequestResult("chat", 1.0, 200, 1.5, 2.0, True, tenant="light-a")
    rows = [ok] * 6 + [light_ok] * 3 + [light_late]
    return replace(
        Point("least_sse", 8, summarize(rows, 2.0), {"shim_rejected": 5.0}, 0.1, 0.1, 0.2, {}, 2.0),
        load_fraction=load_fraction,
    )


def test_capacity_load_fraction_and_tenants() -> None:
    capacity = Capacity(rps=10.0, user_rps=1.25)
    plan = Plan(
        workload="tenants",
        modes=(mode_named("least_sse"),),
        multiples=(2,),
        base_users=4,
        capacity=CapacityPlan(how="fixed", fixed=capacity),
    )
    result = Result(plan, 4, [], {"least_sse": {"2": [_tenant_point(1.0)]}}, capacity=capacity)
    data = summary_json(result)
    assert data["capacity"] == capacity.as_json() and data["workload"] == "tenants"
    assert data["load_fraction"] == {"2": pytest.approx(1.0)}  # 2 x 4 users x 1.25 / 10
    assert data["goodput_fraction"] == {"least_sse": {"2": pytest.approx(4.5 / 10)}}
    assert data["success_by_tenant"] == {"least_sse": {"2": {"heavy": 1.0, "light-a": 0.75}}}
    assert data["rejections_per_request"] == {"least_sse": {"2": pytest.approx(0.5)}}
    table = markdown_table(result)
    assert "| load / capacity |" in table and "| success per tenant |" in table
    assert "| least_sse | 2A | 100.0% |" in table and "heavy 100.0% / light-a 75.0%" in table
    assert "given, not measured" in capacity_table(result)


def test_capacity_sweep_table() -> None:
    sweep = [
        replace(_point(0, 10, 0.1, gateways=1), users=u, summary=summarize(rows, 1.0))
        for u, rows in (
            (2, [RequestResult("chat", 1.0, 200, 0.1, 0.5, True)] * 3),
            (4, [RequestResult("chat", 1.0, 200, 0.1, 0.5, True)] * 5),
        )
    ]
    capacity = Capacity(rps=5.0, user_rps=1.5, source="measured", users=4, mode="least_sse",
                        plateau=False)  # fmt: skip
    result = replace(_result(), capacity=capacity, capacity_sweep=sweep)
    table = capacity_table(result)
    assert "| least_sse users |" in table and "| 4 | 5 | 100.0% | 5.00 | 1.250 |" in table
    assert "Capacity = 5.00 successful req/s (at 4 users)" in table and "may be higher" in table
    assert summary_json(result)["capacity"]["plateau"] is False
