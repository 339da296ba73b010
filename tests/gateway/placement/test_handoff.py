"""Each connector's legs as `StockLeg` builds them, against what vLLM 0.32's proxies send
(their files named per test); through real processes: test_stock_connectors.py."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from pdgate.config import Role
from pdgate.config.wire import prefill_kv_request
from pdgate.gateway.placement.handoff import Handoffs, StockLeg
from pdgate.gateway.upstream.mock import Call, MockUpstream, Reply
from pdgate.policies.base import InstanceLoad
from pdgate.registry.base import InstanceRecord

PREFILL = InstanceRecord(id="p", role=Role.PREFILL, url="http://p:8000", model="m")
BODY = {
    "model": "m",
    "prompt": "hello",
    "max_tokens": 1,
    "stream": False,
    "min_tokens": 3,
    "temperature": 0,
    "kv_transfer_params": prefill_kv_request(),
}
# What NixlPullConnectorScheduler.request_finished answers (pull_scheduler.py).
NIXL_ANSWER: dict[str, Any] = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[0, 1]],
    "remote_engine_id": "engine-p",
    "remote_request_id": "cmpl-r1-0-abcd1234",
    "remote_host": "10.0.0.5",
    "remote_port": 5600,
    "tp_size": 2,
    "dcp_size": 1,
    "pp_size": 1,
    "remote_num_tokens": 20,
    "remote_blocks_expiry_time": None,
    "transfer_mode": "pull",
}


def test_a_nixl_pull_leg_is_toy_proxy_servers() -> None:
    """toy_proxy_server.py send_request_to_service: the six params, min_tokens popped; the
    decode gets the answer's params unchanged, under the same request id."""
    leg = StockLeg("nixl", "r1", replace(PREFILL, connector="nixl"))
    body = leg.prefill_body(BODY)
    assert body["kv_transfer_params"] == prefill_kv_request()
    assert "min_tokens" not in body and body["temperature"] == 0 and body["max_tokens"] == 1
    assert leg.prefill_headers() == {}
    assert leg.decode_params(NIXL_ANSWER) == NIXL_ANSWER
    # ExampleConnector answers null: the decode leg goes without params.
    assert leg.decode_params({}) is None
    assert leg.release_params(NIXL_ANSWER) == NIXL_ANSWER
    assert leg.release_params(None) is None


def test_a_push_decode_leg_is_toy_push_proxy_servers() -> None:
    push = {**NIXL_ANSWER, "transfer_mode": "push"}
    push.pop("remote_blocks_expiry_time")
    leg = StockLeg("nixl_push", "r1-abc", replace(PREFILL, connector="nixl_push"))
    assert leg.prefill_body(BODY)["kv_transfer_params"] == prefill_kv_request()
    assert leg.decode_params(push) == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "engine-p",
        "remote_request_id": "cmpl-r1-0-abcd1234",
        "remote_host": "10.0.0.5",
        "remote_port": 5600,
        "tp_size": 2,
    }
    assert leg.release_params(push) is None  # only its lease frees a push prefill's blocks


def test_a_mooncake_leg_is_mooncake_connector_proxys() -> None:
    record = replace(
        PREFILL, connector="mooncake", kv_bootstrap="http://p:8998", kv_engines=("e0", "e1")
    )
    leg = StockLeg("mooncake", "r1-abc", record, rank=1)
    body = leg.prefill_body({**BODY, "stream_options": {"include_usage": True}})
    assert body["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": "xfer-r1-abc",
    }
    assert "stream_options" not in body
    assert leg.prefill_headers() == {"X-data-parallel-rank": "1"}
    expected = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_bootstrap_addr": "http://p:8998",
        "remote_engine_id": "e1",
        "transfer_id": "xfer-r1-abc",
    }
    assert leg.decode_params(None) == expected  # MooncakeConnector answers no params
    assert leg.release_params(None) == expected


def _handoffs(records: dict[str, InstanceRecord], upstream: MockUpstream | None = None) -> Handoffs:
    def loads(role: Role, model: str, group: str | None) -> list[InstanceLoad]:
        return [
            InstanceLoad(r.id, r.url, r.group, r.capacity, 0, 0, role=r.role)
            for r in records.values()
            if r.role is role and r.model == model
        ]

    async def refuse(call: Call) -> Reply:
        return Reply(status=400, json={"error": {"message": "no"}})

    return Handoffs(lambda: records, loads, upstream or MockUpstream(refuse))


def test_stock_legs_only_for_stock_prefills_with_a_new_id_where_it_must_be() -> None:
    records = {
        "shim": replace(PREFILL, id="shim", extensions=("batch_prefill",)),
        "old-shim": replace(PREFILL, id="old-shim", connector="pdgate"),
        "stock": replace(PREFILL, id="stock"),
        "push": replace(PREFILL, id="push", connector="nixl_push"),
        "moon": replace(PREFILL, id="moon", connector="mooncake", kv_engines=("e0",)),
    }
    handoffs = _handoffs(records)
    assert handoffs.stock_leg("shim", "r") is None
    assert handoffs.stock_leg("old-shim", "r") is None
    assert handoffs.stock_leg("gone", "r") is None
    stock = handoffs.stock_leg("stock", "r")
    assert stock is not None and (stock.connector, stock.leg_id) == ("", "r")
    # Push and Mooncake key the prefill's blocks by the leg id: one per attempt.
    ids = {leg.leg_id for leg in (handoffs.stock_leg("push", "r"), handoffs.stock_leg("push", "r"))
           if leg is not None}  # fmt: skip
    assert len(ids) == 2 and all(i.startswith("r-") for i in ids)
    moon = handoffs.stock_leg("moon", "r")
    assert moon is not None and moon.rank == 0 and moon.leg_id != "r"


def test_a_push_prefills_coordinates_are_learned_from_its_answers_until_it_restarts() -> None:
    record = replace(PREFILL, connector="nixl_push", started_at=100.0)
    records = {"p": record}
    handoffs = _handoffs(records)
    leg = handoffs.stock_leg("p", "r")
    assert leg is not None and handoffs.push_params(leg) is None  # never answered yet
    handoffs.learn(leg, {**NIXL_ANSWER, "transfer_mode": "push"})
    assert handoffs.push_params(leg) == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "engine-p",
        "remote_host": "10.0.0.5",
        "remote_port": 5600,
        "tp_size": 2,
    }
    records["p"] = replace(record, started_at=200.0)  # restarted: a new engine id, maybe
    again = handoffs.stock_leg("p", "r")
    assert again is not None and handoffs.push_params(again) is None


@pytest.mark.parametrize("connector", ["nixl", "mooncake", "nixl_push"])
async def test_a_release_leg_goes_to_a_decode_of_the_connector_that_refuses_it(
    connector: str,
) -> None:
    calls: list[Call] = []

    async def refuse(call: Call) -> Reply:
        calls.append(call)
        return Reply(status=400, json={"error": {"message": "beam search"}})

    records = {
        "p": replace(PREFILL, connector=connector, kv_bootstrap="http://p:1", kv_engines=("e",)),
        "d-shim": InstanceRecord(
            id="d-shim", role=Role.DECODE, url="http://s", model="m", extensions=("continuation",)
        ),
        "d": InstanceRecord(
            id="d", role=Role.DECODE, url="http://d", model="m", connector=connector
        ),
    }
    handoffs = _handoffs(records, MockUpstream(refuse))
    leg = handoffs.stock_leg("p", "r")
    assert leg is not None
    await handoffs.release(leg, None if connector == "mooncake" else NIXL_ANSWER)
    if connector == "nixl_push":
        assert calls == []
        return
    (call,) = calls
    assert (call.url, call.path, call.request_id) == ("http://d", "/v1/completions", leg.leg_id)
    assert call.body is not None
    assert call.body["stream"] is True and call.body["use_beam_search"] is True
    assert call.body["kv_transfer_params"] == leg.release_params(NIXL_ANSWER)
