"""The API-mix workload: each request goes to one of the four client APIs, and the benches'
clients time each API's stream (its own markers) through a real gateway."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import aiohttp
import pytest

from pdgate.loadtest.gateway_cost.load import API_PATHS, Front, Outcome, send
from pdgate.loadtest.lib.stats import RequestResult
from pdgate.loadtest.scheduling._load import send_completion
from pdgate.loadtest.scheduling.workload import APIS, SCENARIOS, Workload, workload_named
from tests._cluster import SIM_MODEL, ThreadedCluster


def test_api_mix_draws_every_api_and_the_other_workloads_draw_as_before() -> None:
    spec = workload_named("api-mix")
    rng = random.Random(1)
    mix = Workload(spec.scenarios, seed=3, apis=spec.apis)
    drawn = [mix.next_prompt(rng).api for _ in range(400)]
    assert set(drawn) == set(APIS)
    assert all(drawn.count(api) > 60 for api in APIS)
    # One API: no extra random draw, so a seed gives the requests it always gave.
    plain, chat = Workload(SCENARIOS, seed=3), Workload(SCENARIOS, seed=3, apis=("chat",))
    a, b = random.Random(2), random.Random(2)
    for _ in range(50):
        one, other = plain.next_prompt(a), chat.next_prompt(b)
        assert (one.text, one.api, other.api) == (other.text, "completions", "chat")
    with pytest.raises(ValueError, match="apis"):
        Workload(SCENARIOS, apis=("grpc",))


@pytest.fixture(scope="module")
def cluster() -> Iterator[ThreadedCluster]:
    with ThreadedCluster(prefills=1, decodes=1) as c:
        yield c


@pytest.mark.parametrize("api", APIS)
def test_each_apis_stream_is_timed_to_its_end(cluster: ThreadedCluster, api: str) -> None:
    workload = Workload(SCENARIOS, seed=0, apis=(api,))

    async def one() -> RequestResult:
        prompt = workload.next_prompt(random.Random(0))
        async with aiohttp.ClientSession() as session:
            return await send_completion(
                session, cluster.url + "/v1/completions", SIM_MODEL, prompt
            )

    result = asyncio.run(one())
    assert result.completed, result
    assert result.status == 200
    assert result.ttft_s is not None and result.ttft_s <= result.e2e_s
    assert result.tpot_s is not None


@pytest.mark.parametrize("api", APIS)
def test_the_gateway_benchs_fronts_speak_each_api(cluster: ThreadedCluster, api: str) -> None:
    front = Front(f"pdgate_{api}", url=cluster.url + API_PATHS[api], api=api)

    async def one() -> Outcome:
        async with aiohttp.ClientSession() as session:
            return await send(session, front, "bench prompt", 6)

    out = asyncio.run(one())
    assert out.ok
    # Token events: six, plus chat's opening role chunk.
    assert out.events == 6 + (api == "chat")
