"""P/D ratio advice (eq. 1): the arithmetic on known inputs, and live through a gateway."""

from __future__ import annotations

import math
import time
from dataclasses import replace

import httpx
import pytest

from pdgate.config import Role
from pdgate.gateway.observe.ratio import RatioAdvisor
from pdgate.registry import InstanceRecord
from tests._cluster import ThreadedCluster


def _records(prefills: int, p_slots: int, decodes: int, d_slots: int) -> dict[str, InstanceRecord]:
    out = {}
    for role, n, slots in ((Role.PREFILL, prefills, p_slots), (Role.DECODE, decodes, d_slots)):
        for i in range(n):
            rid = f"{role.value}{i}"
            out[rid] = InstanceRecord(id=rid, role=role, url="u", model="m", capacity=slots)
    return out


def test_eq1_on_known_inputs() -> None:
    advisor = RatioAdvisor(window_s=10, min_samples=5, target_utilization=0.8)
    for _ in range(100):  # 10 requests/s over the 10 s window
        advisor.arrival("default")
    for _ in range(20):
        advisor.prefill("default", 0.5)  # T_p
        advisor.decode("default", xi_s=0.01, tokens=100, tpot_s=0.02)  # T_d = 2.01 s
    (a,) = list(advisor.advise(_records(2, 4, 2, 8)))
    assert a.demand_rps == pytest.approx(10)
    assert a.t_prefill_s == pytest.approx(0.5) and a.t_decode_s == pytest.approx(2.01)
    assert a.prefill_capacity_rps == pytest.approx(2 * 4 / 0.5)  # n_p b_p / T_p = 16
    assert a.decode_capacity_rps == pytest.approx(2 * 8 / 2.01)  # about 7.96
    assert a.bottleneck == "decode"
    # Balance: n_p/n_d = (T_p/b_p) / (T_d/b_d)
    assert a.ratio == pytest.approx((0.5 / 4) / (2.01 / 8))
    assert a.desired_prefills == pytest.approx(10 / (4 / 0.5) / 0.8)
    assert a.desired_decodes == pytest.approx(10 / (8 / 2.01) / 0.8)
    assert math.ceil(a.desired_decodes or 0) == 4


def test_advice_per_hardware_type_from_each_types_own_samples() -> None:
    """Prefills on two GPU types, decodes on one: each type's time per request and eq. 1's
    ratio for every pair of types, from the samples of that type's instances."""
    records = _records(2, 1, 1, 8)
    records["prefill0"] = replace(records["prefill0"], hardware="l40s")
    records["prefill1"] = replace(records["prefill1"], hardware="h100")
    records["decode0"] = replace(records["decode0"], hardware="h100")
    advisor = RatioAdvisor(window_s=10, min_samples=5)
    for _ in range(10):
        advisor.prefill("default", 0.6, "l40s")
        advisor.prefill("default", 0.2, "h100")
        advisor.decode("default", xi_s=0.0, tokens=100, tpot_s=0.02, hardware="h100")  # 2 s
    (a,) = list(advisor.advise(records))
    hw = a.by_hardware
    assert hw is not None
    assert hw["prefill"]["l40s"]["seconds_per_request"] == pytest.approx(0.6)
    assert hw["prefill"]["h100"]["per_instance_rps"] == pytest.approx(5.0)
    assert hw["decode"]["h100"]["per_instance_rps"] == pytest.approx(4.0)  # 8 slots / 2 s
    # n_p / n_d per pair: an H100 decode needs 0.8 H100 prefills, or 2.4 L40S ones.
    assert hw["ratio"] == {"h100:h100": pytest.approx(0.8), "l40s:h100": pytest.approx(2.4)}
    assert a.t_prefill_s == pytest.approx(0.4)  # the group's own figures stay as they were
    # Without declared hardware there is no breakdown.
    (plain,) = list(advisor.advise(_records(2, 1, 1, 8)))
    assert plain.by_hardware is None


def test_demand_is_counted_at_any_rate_in_bounded_memory() -> None:
    # 50 requests/s over the default 120 s window: 6,000 arrivals. A window that kept one
    # sample per request up to a cap saw at most the cap (2,048: 17 requests/s) and told an
    # autoscaler a third of the traffic.
    advisor = RatioAdvisor(min_samples=5)
    for _ in range(6000):
        advisor.arrival("default")
    for _ in range(5000):
        advisor.prefill("default", 0.25)
        advisor.decode("default", xi_s=0.01, tokens=10, tpot_s=0.02)
    (a,) = list(advisor.advise(_records(1, 4, 1, 8)))
    assert a.demand_rps == pytest.approx(50)
    assert a.samples == 5000
    assert a.t_prefill_s == pytest.approx(0.25) and a.t_decode_s == pytest.approx(0.21)
    group = advisor._groups["default"]
    assert max(map(len, (group.arrivals, group.prefills, group.decodes))) <= 120  # buckets


def test_samples_older_than_the_window_leave_it() -> None:
    advisor = RatioAdvisor(window_s=0.24, min_samples=1)
    for _ in range(30):
        advisor.arrival("default")
        advisor.prefill("default", 1.0)
    time.sleep(0.3)
    advisor.arrival("default")
    advisor.prefill("default", 3.0)
    (a,) = list(advisor.advise(_records(1, 4, 1, 8)))
    assert a.demand_rps == pytest.approx(1 / 0.24)
    assert a.t_prefill_s == pytest.approx(3.0)


def test_too_few_samples_say_so() -> None:
    advisor = RatioAdvisor(min_samples=5)
    advisor.prefill("default", 0.5)
    (a,) = list(advisor.advise(_records(1, 4, 1, 8)))
    assert a.bottleneck == "insufficient_data" and a.desired_prefills is None


def test_a_gateway_serves_its_advice_as_json_and_gauges() -> None:
    with ThreadedCluster(prefills=1, decodes=1, gateway={"admin_token": "adm"}) as c:
        for i in range(25):
            resp = httpx.post(
                c.url + "/v1/completions",
                json={"model": "sim-llama-3.1-8b", "prompt": f"ratio {i}", "max_tokens": 8,
                      "stream": i % 2 == 0},
                timeout=10,
            )  # fmt: skip
            assert resp.status_code == 200
        auth = {"authorization": "Bearer adm"}
        body = httpx.get(c.url + "/admin/ratio", headers=auth).json()
        (group,) = body["groups"]
        assert group["group"] == "default" and group["prefills"] == 1 and group["decodes"] == 1
        assert group["bottleneck"] in ("prefill", "decode", "balanced")
        assert group["tokens"] == pytest.approx(8, abs=1.5)
        assert group["t_prefill_s"] > 0 and group["desired_prefills"] > 0
        metrics = httpx.get(c.url + "/metrics").text
        assert 'pdgate_ratio_desired_instances{group="default",role="prefill"}' in metrics
        assert 'pdgate_ratio_current_instances{group="default",role="decode"} 1.0' in metrics
        series = httpx.get(c.url + "/admin/series", headers=auth).json()
        assert sum(b["ok"] for b in series["buckets"]) == 25
        assert httpx.get(c.url + "/admin/queues", headers=auth).status_code == 200
