"""The tracker's view of what instances serve: each ready instance under its model and each
LoRA adapter its record lists, the smallest context length per name, and the side endpoints
(gateway/instances/tracker.py, gateway/instances/endpoints.py)."""

from __future__ import annotations

from dataclasses import replace

from pdgate.config.wire import Role
from pdgate.gateway.instances.endpoints import serving
from pdgate.gateway.instances.tracker import InstanceTracker
from pdgate.registry.base import InstanceRecord, InstanceState


def _record(
    instance_id: str,
    role: Role,
    *,
    model: str = "base",
    adapters: tuple[str, ...] = (),
    max_model_len: int = 0,
    endpoints: tuple[str, ...] = (),
    group: str = "default",
) -> InstanceRecord:
    return InstanceRecord(
        id=instance_id,
        role=role,
        url=f"http://{instance_id}.test:8000",
        model=model,
        group=group,
        capacity=4,
        max_model_len=max_model_len,
        adapters=adapters,
        endpoints=endpoints,
    )


def _tracker(*records: InstanceRecord) -> InstanceTracker:
    tracker = InstanceTracker()
    tracker.update_membership({r.id: r for r in records})
    return tracker


def _ids(tracker: InstanceTracker, role: Role, model: str, group: str | None = None) -> set[str]:
    return {c.id for c in tracker.loads(role, model, group)}


def test_an_adapter_is_served_only_by_the_instances_that_hold_it() -> None:
    tracker = _tracker(
        _record("p-lora", Role.PREFILL, adapters=("sql",)),
        _record("p-base", Role.PREFILL),
        _record("d-lora", Role.DECODE, adapters=("sql", "poet")),
        _record("d-base", Role.DECODE),
    )
    assert tracker.models() == ("base", "poet", "sql")
    assert _ids(tracker, Role.PREFILL, "sql") == {"p-lora"}
    assert _ids(tracker, Role.DECODE, "sql") == {"d-lora"}
    assert _ids(tracker, Role.DECODE, "poet") == {"d-lora"}
    assert _ids(tracker, Role.PREFILL, "poet") == set()  # no prefill holds it
    assert _ids(tracker, Role.PREFILL, "base") == {"p-lora", "p-base"}
    assert (tracker.parent("sql"), tracker.parent("base"), tracker.parent("other")) == (
        "base",
        None,
        None,
    )
    assert tracker.groups("sql") == {"default"}
    assert tracker.default_model() == "base"  # adapters aside, one model is served
    # One instance, one set of counts, whichever name a request used.
    lease = tracker.begin("p-lora")
    assert [c.inflight for c in tracker.loads(Role.PREFILL, "sql")] == [1]
    assert {c.id: c.inflight for c in tracker.loads(Role.PREFILL, "base")}["p-lora"] == 1
    lease.release()


def test_adapters_follow_membership_and_a_draining_instance_serves_none() -> None:
    holder = _record("a1", Role.AGGREGATED, adapters=("sql",))
    tracker = _tracker(holder)
    assert tracker.aggregated("sql", None)
    tracker.update_membership({"a1": replace(holder, adapters=())})  # unloaded at run time
    assert tracker.models() == ("base",) and tracker.parent("sql") is None
    assert _ids(tracker, Role.AGGREGATED, "sql") == set()
    draining = replace(holder, state=InstanceState.DRAINING)
    tracker.update_membership({"a1": draining})
    assert tracker.models() == ()


def test_the_context_is_the_smallest_any_ready_instance_reports() -> None:
    tracker = _tracker(
        _record("p1", Role.PREFILL, max_model_len=8192, adapters=("sql",)),
        _record("p2", Role.PREFILL, max_model_len=4096),
        _record("d1", Role.DECODE),  # reports none: unknown, not zero
        _record("x1", Role.AGGREGATED, model="other"),
    )
    assert tracker.max_model_len("base") == 4096
    assert tracker.max_model_len("sql") == 8192  # its only holder's
    assert tracker.max_model_len("other") is None
    assert tracker.max_model_len("nobody") is None
    assert tracker.default_model() is None  # two models: a request must name one


def test_a_name_one_instance_serves_as_its_model_is_no_adapter() -> None:
    tracker = _tracker(
        _record("a1", Role.AGGREGATED, adapters=("shared",)),
        _record("a2", Role.AGGREGATED, model="shared"),
    )
    assert tracker.parent("shared") is None
    assert _ids(tracker, Role.AGGREGATED, "shared") == {"a1", "a2"}


def test_side_endpoints_go_to_the_least_loaded_instance_that_declares_them() -> None:
    tokenize = ("/tokenize", "/detokenize")
    tracker = _tracker(
        _record("p1", Role.PREFILL, endpoints=tokenize),
        _record("d1", Role.DECODE, endpoints=tokenize),
        _record("d2", Role.DECODE),  # a server whose OpenAPI document could not be read
        _record("e1", Role.AGGREGATED, model="embed", endpoints=("/v1/embeddings",)),
    )
    busy = [tracker.begin("p1"), tracker.begin("p1")]
    assert [c.id for c in serving(tracker, "base", "/tokenize")] == ["d1", "p1"]
    assert serving(tracker, "base", "/v1/embeddings") == []
    assert [c.id for c in serving(tracker, "embed", "/v1/embeddings", (Role.AGGREGATED,))] == ["e1"]
    assert serving(tracker, "embed", "/v1/embeddings", (Role.PREFILL,)) == []
    for lease in busy:
        lease.release()
