"""Partial disaggregation: rolling activation keeps sending to one instance while EcoServe's
check passes there, then moves on in the macro instance's order; and a cluster of phase-
alternating instances serves the openai client with every count back to zero."""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from pdgate.config import GatewaySettings
from pdgate.config.wire import Role
from pdgate.gateway.placement.partial import Mitosis, PhaseView, RollingActivation, macro_sizes
from pdgate.loadtest.lib.deployed import DeployedCluster, Deployment
from pdgate.policies.base import InstanceLoad
from tests._cluster import (
    SIM_MODEL,
    ThreadedCluster,
    assert_serves_openai,
    counts_released,
    shim_load,
)
from tests.gateway._fakes import info
from tests.loadtest._procs import needs_redis


def _inst(name: str, *, tokens: int = 0, inflight: int = 0, busy: bool = False) -> InstanceLoad:
    return InstanceLoad(
        name, f"http://{name}", "g", 8, inflight, inflight, busy, Role.AGGREGATED, tokens
    )


class _Stream:
    """What the view reads of a placement."""

    __slots__ = ("__weakref__", "closed", "first_token_at", "tokens")

    def __init__(self, tokens: int, first_token_at: float) -> None:
        self.tokens = tokens
        self.first_token_at = first_token_at
        self.closed = False


def test_the_previous_instance_first_while_it_passes_then_the_next_in_order() -> None:
    view = PhaseView(tpot_slo_s=0.1, seconds_per_token=1e-3)
    rolling = RollingActivation(view, ttft_slo_s=1.0)
    a, b, c = _inst("a"), _inst("b"), _inst("c")
    assert [x.id for x in rolling.rank(info("p", 400), [c, a, b])] == ["a", "b", "c"]
    view.last["a"] = "b"  # the macro instance, by its oldest member: b took the previous one
    assert [x.id for x in rolling.rank(info("p", 400), [a, b, c])] == ["b", "c", "a"]
    # b has 900 tokens pending: with this prompt's 101 that is 1.0 s > the TTFT SLO.
    b = _inst("b", tokens=900)
    assert [x.id for x in rolling.rank(info("p", 400), [a, b, c])] == ["c", "a", "b"]
    # A busy (429) or full instance is not ranked at all.
    assert [x.id for x in rolling.rank(info("p", 400), [a, _inst("b", busy=True), c])] == [
        "c",
        "a",
    ]
    # The last one left: the first after it in order.
    view.last["a"] = "bb"
    assert [x.id for x in rolling.rank(info("p", 400), [a, c])] == ["c", "a"]


def test_an_instance_whose_decodes_cannot_afford_the_prefill_is_passed_over() -> None:
    view = PhaseView(tpot_slo_s=0.05, seconds_per_token=1e-3)
    rolling = RollingActivation(view, ttft_slo_s=5.0)
    now = time.monotonic()
    behind = _Stream(tokens=10, first_token_at=now - 1.0)  # 10 x 0.05 - 1.0: 0.5 s behind
    view._streams["a"] = weakref.WeakSet()
    view._streams["a"].add(behind)  # type: ignore[arg-type]
    assert view.saved_tpot_s("a", now) == pytest.approx(-0.5)
    a, b = _inst("a"), _inst("b")
    view.last["a"] = "a"
    assert [x.id for x in rolling.rank(info("p", 400), [a, b])] == ["b", "a"]
    ahead = _Stream(tokens=100, first_token_at=now - 1.0)  # 4 s saved: the mean is 1.75 s
    view._streams["a"].add(ahead)  # type: ignore[arg-type]
    assert [x.id for x in rolling.rank(info("p", 400), [a, b])] == ["a", "b"]
    del behind, ahead  # gone streams leave the view with their placements
    assert view.saved_tpot_s("a") is None
    # A request that tightened its TPOT SLO is held to its own in the mean.
    strict = _Stream(tokens=10, first_token_at=now - 0.1)
    view.routed("a", strict, 0.02)  # type: ignore[arg-type]
    assert view.saved_tpot_s("a", now) == pytest.approx(10 * 0.02 - 0.1)


@pytest.fixture(scope="module")
def cluster() -> Iterator[ThreadedCluster]:
    with ThreadedCluster(prefills=1, decodes=2, strategy="partial") as c:
        yield c


def test_a_partial_cluster_serves_the_openai_client_in_phases(cluster: ThreadedCluster) -> None:
    assert cluster.info is not None
    urls = cluster.info.aggregated_urls
    assert len(urls) == 3
    assert_serves_openai(cluster.url, "about phases")
    queues = httpx.get(cluster.url + "/admin/queues", timeout=5).json()["queues"]
    assert [(q["role"], q["policy"]) for q in queues] == [("aggregated", "rolling_activation")]
    loads: list[dict[str, Any]] = [shim_load(u) for u in urls]
    assert all(x["phase"] in ("prefill", "decode") for x in loads)
    assert sum(x["phase_switches"] for x in loads) >= 1
    assert all(x["pending_prefills"] == 0 for x in loads)
    cluster.wait_for(lambda: counts_released(cluster.url), what="every count back to zero")


def test_mitosis_splits_past_the_upper_bound_and_merges_back() -> None:
    """EcoServe's Figure 7 with a lower bound of 2 and an upper of 4: the newest two split
    off, the first fills up to 4, then the new one grows; shrinking mirrors it."""
    shapes = [macro_sizes(n, 2, 4) for n in range(0, 11)]
    assert shapes == [
        [], [1], [2], [3], [4], [3, 2], [4, 2], [4, 3], [4, 4], [4, 3, 2], [4, 4, 2]
    ]  # fmt: skip
    mitosis = Mitosis(2, 3)
    assert mitosis.split(["a", "b", "c"]) == [("a", "b", "c")]
    assert mitosis.split(["a", "b", "c", "d"]) == [("a", "b"), ("c", "d")]  # c moved
    with pytest.raises(ValueError, match="2 x lower - 1"):
        Mitosis(3, 4)
    with pytest.raises(ValueError, match="macro_max_instances"):
        GatewaySettings(macro_min_instances=3, macro_max_instances=4)


def test_each_macro_instance_rolls_on_its_own_and_the_roomier_goes_first() -> None:
    view = PhaseView(tpot_slo_s=0.1, seconds_per_token=1e-3, mitosis=Mitosis(2, 3))
    members = ["a", "b", "c", "d"]  # oldest first: macro instances (a, b) and (c, d)
    rolling = RollingActivation(view, ttft_slo_s=1.0, members=lambda: members)
    a, b, c, d = _inst("a"), _inst("b"), _inst("c", inflight=1), _inst("d")
    assert [x.id for x in rolling.rank(info("p", 400), [a, b, c, d])] == ["a", "b", "c", "d"]
    assert view.macros == [("a", "b"), ("c", "d")]
    assert rolling.describe()["macro_instances"] == [["a", "b"], ["c", "d"]]
    view.last.update({"a": "b", "c": "d"})  # each its own previous instance
    c = _inst("c")
    a = _inst("a", inflight=2)  # (c, d) has more room now
    assert [x.id for x in rolling.rank(info("p", 400), [a, b, c, d])] == ["d", "c", "b", "a"]
    # Down to three: one macro instance again, its rolling position kept under its key.
    members = ["a", "b", "c"]
    assert [x.id for x in rolling.rank(info("p", 400), [a, b, c])] == ["b", "c", "a"]
    assert view.macros == [("a", "b", "c")] and view.last == {"a": "b"}


async def test_a_macro_instance_grows_splits_and_merges_back_while_streams_run() -> None:
    """Real processes on a private Redis: a partial group of 2 grows to 4 (one macro instance
    of 3, then two of 2) and shrinks back to 2, instances joining and draining while clients
    stream through the gateway: no stream fails and every count ends at zero."""
    needs_redis()
    deployment = Deployment(
        prefills=4,
        decodes=0,
        prefill_role="aggregated",
        prefill_settings={"phases": True, "capacity": 8, "drain_timeout_s": 30},
        gateway_settings={"macro_min_instances": 2, "macro_max_instances": 3},
        key_prefix="pdgate-test-mitosis",
    )
    async with DeployedCluster(deployment) as cluster, httpx.AsyncClient(timeout=10) as http:
        gateway = cluster.gateway_urls[0]
        client = openai.AsyncOpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0)
        for place in (2, 3):  # start from two
            assert await cluster.stop_member("prefill", place, timeout_s=30) == 0
        seen: list[list[list[str]]] = []

        async def macros(count: int) -> list[list[str]]:
            """The gateway's macro instances once it sees `count` ready instances."""
            for _ in range(200):
                rows = (await http.get(gateway + "/admin/instances")).json()["instances"]
                queues = (await http.get(gateway + "/admin/queues")).json()["queues"]
                found = [q["macro_instances"] for q in queues if "macro_instances" in q]
                ready = sum(r["state"] == "ready" for r in rows)
                if ready == count and found and sum(len(m) for m in found[0]) == count:
                    seen.append(found[0])
                    return list(found[0])
                await asyncio.sleep(0.05)
            raise AssertionError(f"the gateway never showed {count} instances in macros")

        failures: list[str] = []
        done = 0
        stop = asyncio.Event()

        async def user(i: int) -> None:
            nonlocal done
            while not stop.is_set():
                try:
                    stream = await client.completions.create(
                        model=SIM_MODEL, prompt=f"user {i} streams on", max_tokens=40,
                        stream=True,
                    )  # fmt: skip
                    text = "".join([c.choices[0].text async for c in stream if c.choices])
                    if not text:
                        failures.append("empty stream")
                    done += 1
                except openai.APIError as exc:
                    failures.append(repr(exc))

        users = [asyncio.create_task(user(i)) for i in range(6)]
        try:
            assert len(await macros(2)) == 1
            await cluster.start_member("prefill", 2)
            assert [len(m) for m in await macros(3)] == [3]  # grown
            await cluster.start_member("prefill", 3)
            split = await macros(4)
            assert [len(m) for m in split] == [2, 2]  # split: the newest two
            assert await cluster.stop_member("prefill", 3, timeout_s=30) == 0  # drained
            assert [len(m) for m in await macros(3)] == [3]  # merged
            assert await cluster.stop_member("prefill", 2, timeout_s=30) == 0
            assert [len(m) for m in await macros(2)] == [2]
            await asyncio.sleep(0.5)
        finally:
            stop.set()
            await asyncio.gather(*users)
        assert failures == [] and done > 20
        # The instance that moved from the first macro instance to the second kept serving.
        assert seen[1][0][2] == split[1][0]
        for _ in range(100):
            rows = (await http.get(gateway + "/admin/instances")).json()["instances"]
            if all(r["open_streams"] == 0 and r["inflight"] == 0 for r in rows):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"counts left at the gateway: {rows}")
