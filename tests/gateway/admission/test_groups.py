"""Scenario groups: rules map requests to groups (model, key, header, prompt length), each
group served by its own instances with its own deadline; a real gateway server in front of
`MockUpstream` instances in two groups."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx

from pdgate.config import GatewaySettings, RegistrySettings, Role, ScenarioGroup
from pdgate.config.server import bind_socket, bound_port, serving
from pdgate.gateway.app import build_gateway_app
from pdgate.gateway.upstream.mock import MockUpstream
from pdgate.registry import InstanceRecord, MemoryRegistry
from tests.gateway._fakes import FakeCluster

GROUPS = [
    ScenarioGroup(name="chat", max_prompt_chars=100, ttft_timeout_s=2.0),
    ScenarioGroup(name="docs", min_prompt_chars=101, queue_size=8),
    ScenarioGroup(name="vip", api_keys=["vip"]),
]


@asynccontextmanager
async def gateway(**settings: Any) -> AsyncIterator[str]:
    registry = MemoryRegistry()
    for group in ("chat", "docs", "vip"):
        for role, tag in ((Role.PREFILL, "p"), (Role.DECODE, "d")):
            record = InstanceRecord(
                id=f"{tag}-{group}", role=role, url=f"http://{tag}-{group}", model="m",
                group=group, capacity=4,
            )  # fmt: skip
            await registry.put(record, ttl_s=60)
    app = build_gateway_app(
        GatewaySettings(port=0, **settings), registry, RegistrySettings(),
        upstream=MockUpstream(FakeCluster()),
    )  # fmt: skip
    sock = bind_socket("127.0.0.1", 0)
    async with serving(app, sock):
        yield f"http://127.0.0.1:{bound_port(sock)}"


def poster(client: httpx.AsyncClient, url: str) -> Callable[..., Any]:
    async def post(prompt: str, **headers: str) -> httpx.Response:
        return await client.post(
            url + "/v1/completions",
            json={"model": "m", "prompt": prompt, "max_tokens": 2},
            headers=headers,
        )

    return post


async def test_rules_route_by_prompt_length_and_key() -> None:
    keys = ["sk-vip name=vip", "sk-std name=std"]
    async with gateway(groups=GROUPS, api_keys=keys) as url, httpx.AsyncClient() as client:
        post = poster(client, url)
        std = {"authorization": "Bearer sk-std"}
        short = await post("hi", **std)
        assert short.headers["x-pdgate-prefill"] == "p-chat"
        assert short.headers["x-pdgate-decode"] == "d-chat"
        long = await post("x" * 500, **std)
        assert long.headers["x-pdgate-prefill"] == "p-docs"
        vip = await post("hi", authorization="Bearer sk-vip")
        assert vip.headers["x-pdgate-prefill"] == "p-chat"  # first match wins: chat
        metrics = (await client.get(url + "/metrics")).text
        assert 'pdgate_requests_total{group="chat",outcome="ok"} 2.0' in metrics
        assert 'pdgate_requests_total{group="docs",outcome="ok"} 1.0' in metrics


async def test_the_header_names_a_group_when_no_rule_matches() -> None:
    async with gateway(groups=[GROUPS[2]]) as url, httpx.AsyncClient() as client:
        post = poster(client, url)
        resp = await post("hi", **{"x-pdgate-group": "docs"})
        assert resp.headers["x-pdgate-prefill"] == "p-docs"
        typo = await post("hi", **{"x-pdgate-group": "doc"})
        assert typo.status_code == 400 and typo.json()["error"]["param"] == "x-pdgate-group"


async def test_unmatched_requests_go_to_the_default_group_or_are_refused() -> None:
    async with (
        gateway(groups=[GROUPS[2]], default_group="docs") as url,
        httpx.AsyncClient() as client,
    ):
        resp = await poster(client, url)("hi")
        assert resp.headers["x-pdgate-prefill"] == "p-docs"
    async with (
        gateway(groups=[GROUPS[2]], reject_unmatched=True) as url,
        httpx.AsyncClient() as client,
    ):
        resp = await poster(client, url)("hi")
        assert resp.status_code == 400
        assert "no scenario group" in resp.json()["error"]["message"]


async def test_a_group_without_instances_is_a_503_not_a_wait() -> None:
    rules = [ScenarioGroup(name="empty", models=["m"])]
    async with gateway(groups=rules) as url, httpx.AsyncClient() as client:
        resp = await poster(client, url)("hi")
        assert resp.status_code == 503
        assert "Retry-After" in resp.headers
