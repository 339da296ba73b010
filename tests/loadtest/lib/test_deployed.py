"""A cluster as deployed: every shim and gateway its own `pdgate` process, a private Redis.
It starts, serves through each gateway, and leaves no process behind."""

from __future__ import annotations

import aiohttp
import orjson
import pytest

from pdgate.loadtest.lib.deployed import DeployedCluster, Deployment, settings_env
from pdgate.loadtest.lib.probes import wait_instances
from pdgate.loadtest.lib.sse import post_stream
from tests.loadtest._procs import marked, needs_redis, wait_gone


def test_settings_reach_the_servers_as_pdgate_environment() -> None:
    env = settings_env("shim", {"capacity": 2, "admission": "reject", "sim_kv_wire_fraction": 0.5,
                                "sim_prefix_cache_blocks": None, "vllm_engine_args": {"a": 1},
                                "vllm_enforce_eager": False})  # fmt: skip
    assert env == {
        "PDGATE_SHIM_CAPACITY": "2",
        "PDGATE_SHIM_ADMISSION": "reject",  # a string as it is, not JSON-quoted
        "PDGATE_SHIM_SIM_KV_WIRE_FRACTION": "0.5",
        "PDGATE_SHIM_SIM_PREFIX_CACHE_BLOCKS": "null",
        "PDGATE_SHIM_VLLM_ENGINE_ARGS": '{"a":1}',
        "PDGATE_SHIM_VLLM_ENFORCE_EAGER": "false",
    }


async def test_a_deployed_cluster_serves_through_every_gateway_and_stops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    needs_redis()
    deployment = Deployment(
        prefills=1,
        decodes=1,
        gateways=2,
        prefill_settings={"sim_profile": "null", "capacity": 2, "sim_prefix_cache_blocks": 0},
        decode_settings={"sim_profile": "null", "capacity": 8},
        gateway_settings={"prefill_policy": "least_sse"},
        key_prefix="pdgate-test-deployed",
    )
    with marked(monkeypatch):
        async with DeployedCluster(deployment) as cluster, aiohttp.ClientSession() as session:
            pids = [c.pid for c in cluster.children()]
            assert len(set(pids)) == 4 and len(set(cluster.gateway_urls)) == 2
            for gateway in cluster.gateway_urls:
                await wait_instances(session, gateway, 2)
                body = {
                    "model": "sim-llama-3.1-8b",
                    "prompt": "hello",
                    "max_tokens": 4,
                    "stream": True,
                }
                out = await post_stream(session, gateway + "/v1/completions", orjson.dumps(body))
                assert out.completed and out.events >= 4, out
            # The shims got their settings from the environment (a 0-block prefix cache).
            async with session.get(cluster.prefill_urls[0] + "/load") as resp:
                load = await resp.json()
            assert load["capacity"] == 2, load
            cluster.check_alive()
        assert wait_gone(pids) == []
