"""Server-side counters read at both ends of a measurement window; the run's numbers are
the differences. Also: waiting until a gateway sees its instances.

* shims' ``/load``: ``prefix_cache_hit_tokens`` / ``prefix_cache_total_tokens`` (prefix hit
  rate) and ``rejected`` (429s answered by prefills), summed over the prefills;
* gateway ``/metrics``: ``pdgate_prefill_attempts_total{result}`` (accepted, rejected,
  failed), ``pdgate_prefill_rejections`` (429s per placed request) and
  ``pdgate_requests_total{outcome}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "ATTEMPT_KEYS",
    "Counters",
    "delta",
    "parse_gateway_metrics",
    "read_counters",
    "wait_instances",
]

Counters = dict[str, float]

ATTEMPT_KEYS = tuple(f"attempts_{r}" for r in ("accepted", "rejected", "failed", "client_error"))
_LOAD_FIELDS = ("prefix_cache_hit_tokens", "prefix_cache_total_tokens", "rejected", "admitted")


def parse_gateway_metrics(text: str) -> Counters:
    """The counters of interest from the gateway's Prometheus exposition."""
    out: Counters = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "pdgate_prefill_attempts_total":
                out[f"attempts_{sample.labels['result']}"] = sample.value
            elif sample.name == "pdgate_requests_total":
                out[f"outcome_{sample.labels['outcome']}"] = sample.value
            elif sample.name in (
                "pdgate_prefill_rejections_sum",
                "pdgate_prefill_rejections_count",
            ):
                out[sample.name.removeprefix("pdgate_")] = sample.value
    return out


async def _get(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
        resp.raise_for_status()
        if resp.content_type == "application/json":
            return await resp.json()
        return await resp.text()


async def read_counters(
    session: aiohttp.ClientSession, gateway_urls: Sequence[str], prefill_urls: Sequence[str]
) -> Counters:
    """One snapshot of every counter (cumulative since the cluster started), gateways' and
    prefills' each summed."""
    replies = await asyncio.gather(
        *(_get(session, url + "/metrics") for url in gateway_urls),
        *(_get(session, url + "/load") for url in prefill_urls),
    )
    # A counter that never moved has no sample yet: 0, not absent (absent = no gateway read).
    out: Counters = dict.fromkeys(ATTEMPT_KEYS, 0.0) if gateway_urls else {}
    for text in replies[: len(gateway_urls)]:
        for key, value in parse_gateway_metrics(str(text)).items():
            out[key] = out.get(key, 0.0) + value
    loads = replies[len(gateway_urls) :]
    for name in _LOAD_FIELDS:
        out[f"shim_{name}"] = float(sum(load.get(name, 0) for load in loads))
    return out


async def wait_instances(
    session: aiohttp.ClientSession, gateway: str, want: int, timeout_s: float = 30.0
) -> None:
    """Until `gateway` lists `want` ready instances (membership is eventually consistent);
    a gateway still starting up counts as seeing none."""
    deadline = time.monotonic() + timeout_s
    ready = 0
    while True:
        with contextlib.suppress(aiohttp.ClientError, OSError):
            async with session.get(gateway + "/admin/instances") as resp:
                rows = (await resp.json())["instances"]
                ready = sum(1 for r in rows if r["state"] == "ready")
        if ready >= want:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {ready} of {want} instances joined {gateway}")
        await asyncio.sleep(0.05)


def delta(before: Mapping[str, float], after: Mapping[str, float]) -> Counters:
    """after - before for every key (a key first seen in `after` started at 0)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}
