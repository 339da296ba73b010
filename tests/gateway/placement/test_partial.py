"""Partial disaggregation: rolling activation keeps sending to one instance while EcoServe's
check passes there, then moves on in the macro instance's order; and a cluster of phase-
alternating instances serves the openai client with every count back to zero."""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from pdgate.config.wire import Role
from pdgate.gateway.placement.partial import PhaseView, RollingActivation
from pdgate.policies.base import InstanceLoad
from tests._cluster import SIM_MODEL, ThreadedCluster, counts_released, shim_load
from tests.gateway._fakes import info


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
    view.last = "b"
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
    view.last = "bb"
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
    view.last = "a"
    assert [x.id for x in rolling.rank(info("p", 400), [a, b])] == ["b", "a"]
    ahead = _Stream(tokens=100, first_token_at=now - 1.0)  # 4 s saved: the mean is 1.75 s
    view._streams["a"].add(ahead)  # type: ignore[arg-type]
    assert [x.id for x in rolling.rank(info("p", 400), [a, b])] == ["a", "b"]
    del behind, ahead  # gone streams leave the view with their placements
    assert view.saved_tpot_s("a") is None


@pytest.fixture(scope="module")
def cluster() -> Iterator[ThreadedCluster]:
    with ThreadedCluster(prefills=1, decodes=2, strategy="partial") as c:
        yield c


def test_a_partial_cluster_serves_the_openai_client_in_phases(cluster: ThreadedCluster) -> None:
    assert cluster.info is not None
    urls = cluster.info.aggregated_urls
    assert len(urls) == 3
    client = openai.OpenAI(
        base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=30
    )
    whole = client.completions.create(model=SIM_MODEL, prompt="about phases", max_tokens=6)
    assert whole.usage is not None and whole.usage.completion_tokens == 6
    chunks = client.chat.completions.create(
        model=SIM_MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=6,
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    queues = httpx.get(cluster.url + "/admin/queues", timeout=5).json()["queues"]
    assert [(q["role"], q["policy"]) for q in queues] == [("aggregated", "rolling_activation")]
    loads: list[dict[str, Any]] = [shim_load(u) for u in urls]
    assert all(x["phase"] in ("prefill", "decode") for x in loads)
    assert sum(x["phase_switches"] for x in loads) >= 1
    assert all(x["pending_prefills"] == 0 for x in loads)
    cluster.wait_for(lambda: counts_released(cluster.url), what="every count back to zero")
