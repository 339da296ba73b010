"""A storm of clients that leave at random moments (queued, while their prefill computes,
mid-stream): afterwards every call the prefills admitted or rejected is in the gateway's
count, as accepted or rejected when it read the answer (its client gone or not), as
abandoned when it cut the call off (the client left first, the prefill aborts it); and
every call it counts accepted or rejected, the prefills counted too."""

from __future__ import annotations

import asyncio
import random

import httpx

from pdgate.loadtest.lib.probes import parse_gateway_metrics
from tests._cluster import SIM_MODEL, ThreadedCluster, counts_released, shim_load

CLIENTS = 60
WAVES = 4


async def _leaving_client(url: str, n: int, rng: random.Random) -> None:
    body = {
        "model": SIM_MODEL,
        "prompt": f"storm {n} " * rng.randint(5, 400),
        "max_tokens": 20,
        "stream": True,
    }
    # Leaves after a random time: before, during or after its prefill.
    with_patience = rng.uniform(0.0, 0.4)
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            async with asyncio.timeout(with_patience):
                async with client.stream("POST", url + "/v1/completions", json=body) as resp:
                    async for _ in resp.aiter_bytes():
                        pass
    except (TimeoutError, httpx.HTTPError):
        pass


async def _storm(url: str) -> None:
    rng = random.Random(7)
    for wave in range(WAVES):
        await asyncio.gather(
            *(_leaving_client(url, wave * CLIENTS + i, rng) for i in range(CLIENTS))
        )


def test_after_a_disconnect_storm_every_call_the_prefills_counted_is_the_gateway_s() -> None:
    with ThreadedCluster(prefills=2, decodes=2, shim={"capacity": 2}) as c:
        assert c.info is not None
        asyncio.run(_storm(c.url))
        # Calls whose clients left still end at their prefill's answer: wait for them all.
        c.wait_for(lambda: counts_released(c.url), timeout=30, what="every call ended")
        c.wait_for(
            lambda: all(shim_load(u)["used"] == 0 for u in c.info.prefill_urls),  # type: ignore[union-attr]
            timeout=30,
            what="prefill slots free",
        )
        gateway = parse_gateway_metrics(httpx.get(c.url + "/metrics", timeout=5).text)
        loads = [shim_load(u) for u in c.info.prefill_urls]
        shims = sum(load["admitted"] + load["rejected"] for load in loads)
        answered = gateway.get("attempts_accepted", 0) + gateway.get("attempts_rejected", 0)
        abandoned = gateway.get("attempts_abandoned", 0)
        assert shims > 0, "no call reached a prefill: nothing was tested"
        assert answered <= shims <= answered + abandoned, (gateway, loads)
        # Nothing else ended a call: each is one of the three.
        others = {k: v for k, v in gateway.items() if k.startswith("attempts_") and v}
        assert set(others) <= {"attempts_accepted", "attempts_rejected", "attempts_abandoned"}
