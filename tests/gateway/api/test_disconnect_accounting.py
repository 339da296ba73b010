"""A storm of clients that leave at random moments (queued, while their prefill computes,
mid-stream): afterwards the gateway's count of prefill calls and the prefills' own agree
exactly. The gateway counts a call accepted or rejected when it read the answer (its client
gone or not); a call it cut off unanswered (the client left first) it counts by what the
prefill answered to the call's release: admitted, rejected, or unseen (the prefill never
counts it: a call that arrives after its release is refused, withdrawn)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import httpx
import pytest

from pdgate.loadtest.lib.probes import parse_gateway_metrics
from tests._cluster import SIM_MODEL, ThreadedCluster, counts_released, shim_load

CLIENTS = 60
WAVES = 4


async def _leaving_client(client: httpx.AsyncClient, url: str, n: int, rng: random.Random) -> None:
    body = {
        "model": SIM_MODEL,
        "prompt": f"storm {n} " * rng.randint(5, 400),
        "max_tokens": 20,
        "stream": True,
    }
    # Leaves after a random time: before, during or after its prefill.
    with_patience = rng.uniform(0.0, 0.4)
    try:
        async with asyncio.timeout(with_patience):
            async with client.stream("POST", url + "/v1/completions", json=body) as resp:
                async for _ in resp.aiter_bytes():
                    pass
    except (TimeoutError, httpx.HTTPError):
        pass


async def _storm(url: str) -> None:
    rng = random.Random(7)
    # One client, a connection per caller: a client each would spend the patience of most
    # on setting itself up, and few calls would reach a prefill.
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(timeout=10, limits=limits) as client:
        for wave in range(WAVES):
            await asyncio.gather(
                *(_leaving_client(client, url, wave * CLIENTS + i, rng) for i in range(CLIENTS))
            )


# The forwarder (queue, retries) and the paper's baseline (one try, the prefill's own queue).
@pytest.mark.parametrize(
    ("gateway", "shim"),
    [({}, {"capacity": 2}), ({"dispatch": "direct"}, {"capacity": 2, "admission": "queue"})],
    ids=["forwarded", "direct"],
)
def test_after_a_disconnect_storm_the_gateway_and_the_prefills_count_the_same_calls(
    gateway: dict[str, Any], shim: dict[str, Any]
) -> None:
    with ThreadedCluster(prefills=2, decodes=2, shim=shim, gateway=gateway) as c:
        assert c.info is not None
        asyncio.run(_storm(c.url))
        # Calls whose clients left still end at their prefill's answer: wait for them all.
        c.wait_for(lambda: counts_released(c.url), timeout=30, what="every call ended")
        c.wait_for(
            lambda: all(shim_load(u)["used"] == 0 for u in c.info.prefill_urls),  # type: ignore[union-attr]
            timeout=30,
            what="prefill slots free",
        )
        counted = parse_gateway_metrics(httpx.get(c.url + "/metrics", timeout=5).text)
        loads = [shim_load(u) for u in c.info.prefill_urls]
        admitted = sum(load["admitted"] for load in loads)
        rejected = sum(load["rejected"] for load in loads)
        assert admitted > 0, "no call reached a prefill: nothing was tested"
        assert counted.get("attempts_abandoned", 0) > 0, "no call was cut off: nothing was tested"
        said = {k: counted.get(f"abandoned_{k}", 0) for k in ("admitted", "rejected", "unseen")}
        assert counted.get("abandoned_unknown", 0) == 0, (counted, loads)
        # Each call released unanswered is counted once, by what its prefill said.
        unanswered = sum(counted.get(f"attempts_{r}", 0) for r in ("abandoned", "deadline"))
        assert sum(said.values()) == unanswered, (counted, loads)
        assert counted.get("attempts_accepted", 0) + said["admitted"] == admitted, (counted, loads)
        assert counted.get("attempts_rejected", 0) + said["rejected"] == rejected, (counted, loads)
        # Nothing else ended a call: each is one of the three.
        others = {k: v for k, v in counted.items() if k.startswith("attempts_") and v}
        assert set(others) <= {"attempts_accepted", "attempts_rejected", "attempts_abandoned"}
