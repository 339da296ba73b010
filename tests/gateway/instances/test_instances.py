from __future__ import annotations

import time

from pdgate.config import Role
from pdgate.gateway.instances.tracker import InstanceTracker
from pdgate.registry.base import InstanceRecord, InstanceState


def rec(
    i: str, role: Role = Role.PREFILL, state: InstanceState = InstanceState.READY
) -> InstanceRecord:
    return InstanceRecord(id=i, role=role, url=f"http://{i}", model="m", capacity=2, state=state)


async def test_leases_release_exactly_once() -> None:
    t = InstanceTracker()
    t.update_membership({"p": rec("p")})
    a, b = t.open_stream("p"), t.begin("p")
    assert t.totals() == (1, 1)
    for _ in range(3):
        a.release()
        b.release()
    assert t.totals() == (0, 0)


async def test_rejoined_instance_is_not_driven_negative_by_old_leases() -> None:
    t = InstanceTracker()
    t.update_membership({"p": rec("p")})
    old = t.open_stream("p")
    t.update_membership({}, {"p"})
    t.update_membership({"p": rec("p")})
    old.release()
    loads = t.loads(Role.PREFILL, "m")
    assert loads[0].open_streams == 0


async def test_snapshot_filters_role_model_and_draining() -> None:
    t = InstanceTracker()
    t.update_membership(
        {
            "p": rec("p"),
            "d": rec("d", Role.DECODE),
            "x": rec("x", state=InstanceState.DRAINING),
        }
    )
    assert [x.id for x in t.loads(Role.PREFILL, "m")] == ["p"]
    assert [x.id for x in t.loads(Role.DECODE, "m")] == ["d"]
    assert t.loads(Role.PREFILL, "other") == []


async def test_rejection_marks_busy_until_a_release() -> None:
    t = InstanceTracker(reject_hold_s=60)
    t.update_membership({"p": rec("p")})
    lease = t.begin("p")
    t.rejected("p")
    assert t.loads(Role.PREFILL, "m")[0].busy
    lease.release()
    assert not t.loads(Role.PREFILL, "m")[0].busy


async def test_state_of_departed_instances_is_dropped() -> None:
    t = InstanceTracker()
    t.update_membership({str(i): rec(str(i)) for i in range(100)})
    for i in range(100):
        t.rejected(str(i))
    t.update_membership({"0": rec("0")}, {str(i) for i in range(1, 100)})
    assert len(list(t.describe())) == 1
    assert len(t._counters) == 1


def test_models_follow_membership_and_readiness() -> None:
    t = InstanceTracker()
    assert t.models() == ()
    b = InstanceRecord(id="b", role=Role.DECODE, url="http://b", model="beta", capacity=2)
    t.update_membership({"p": rec("p"), "b": b})
    assert t.models() == ("beta", "m")
    t.update_membership({"p": rec("p", state=InstanceState.DRAINING), "b": b})
    assert t.models() == ("beta",)
    t.update_membership({}, {"p", "b"})
    assert t.models() == ()


async def test_a_snapshot_carries_every_count_in_its_own_field() -> None:
    # loads() builds InstanceLoad positionally (its hot path): each field from its own count.
    t = InstanceTracker(reject_hold_s=60)
    record = InstanceRecord(id="p", role=Role.PREFILL, url="http://p", model="m",
                            capacity=8, group="g", hardware="l40s")  # fmt: skip
    t.update_membership({"p": record})
    held = [t.begin("p"), t.begin("p"), t.open_stream("p"), t.work("p", 120), t.computing("p")]
    t.set_others({"p": 5}, {"p": 300}, {"p": 3}, {"p": 2})
    t.rejected("p")
    t.set_speeds("m", "g", {"h100": 2.0, "l40s": 0.5})
    t.set_speeds("m", "other", {})  # another group's queue measured none: no effect here
    (load,) = t.loads(Role.PREFILL, "m", "g")
    assert load._asdict() == {
        "id": "p", "url": "http://p", "group": "g", "capacity": 8, "open_streams": 6,
        "inflight": 5, "busy": True, "role": Role.PREFILL, "inflight_tokens": 420,
        "ejected": False, "own_inflight": 2, "computing": 3, "speed": 0.5,
    }  # fmt: skip
    t.set_speeds("m", "g", {})
    assert t.loads(Role.PREFILL, "m", "g")[0].speed == 1.0  # no speeds measured: alike
    t.set_speeds("m", None, {"l40s": 0.25})  # the queue for any group's
    assert t.loads(Role.PREFILL, "m", "g")[0].speed == 0.25
    assert t.hardware("p") == "l40s" and t.hardware("gone") == ""
    t.eject("p", until=time.monotonic() + 60)
    (load,) = t.loads(Role.PREFILL, None)
    assert load.ejected and load.capacity == 6  # half-open: room for the probe only
    assert t.loads(Role.PREFILL, "m", "other") == [] and t.loads(Role.DECODE, "m") == []
    for lease in held:
        lease.release()
