"""What the servers under test say about themselves, read over HTTP: counters at both ends
of a measurement window (the run's numbers are the differences), the prefills' KV holds,
and waiting until a server answers or a gateway sees its instances.

* shims' ``/load``: ``prefix_cache_hit_tokens`` / ``prefix_cache_total_tokens`` (prefix hit
  rate) and ``rejected`` (429s answered by prefills), summed over the prefills; and the
  prefill's KV holds: ``kv_hold_max_s`` (the longest a KV, and its slot, stayed held after
  its prefill finished, since start), ``kv_hold_over_5s`` (how many holds lasted over 5 s,
  cumulative) and ``kv_held`` (held now). Older shims and other servers lack the hold keys:
  they read as NaN ("not reported"), never as 0;
* gateway ``/metrics``: ``pdgate_prefill_attempts_total{result}`` (accepted, rejected,
  failed), ``pdgate_prefill_abandoned_outcomes_total{outcome}`` (calls released unanswered,
  by what their prefill did with them: ``abandoned_admitted``, ..., summed over their
  result), ``pdgate_prefill_rejections`` (429s per placed request),
  ``pdgate_requests_total{outcome}``, the fleet's calls, and what tells one gateway's lot
  from another's: ``pdgate_early_drops_total``, ``pdgate_fleet_yields_total`` and
  ``pdgate_queue_sheds_total{reason}``, summed and also kept per gateway (``gwI_...``, I
  the gateway's place in the list read).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "ATTEMPT_KEYS",
    "LOOP_LAG",
    "PER_GATEWAY",
    "Counters",
    "HoldSnapshot",
    "bucket_quantile",
    "delta",
    "histogram_buckets",
    "holds_of",
    "parse_gateway_metrics",
    "read_counters",
    "read_histogram",
    "read_holds",
    "wait_http",
    "wait_instances",
    "wait_kv_released",
]

Counters = dict[str, float]
# The gateway's event-loop lag histogram (gateway/observe/metrics.py).
LOOP_LAG = "pdgate_event_loop_lag_seconds"

ATTEMPT_KEYS = tuple(f"attempts_{r}" for r in ("accepted", "rejected", "failed", "client_error"))
_LOAD_FIELDS = ("prefix_cache_hit_tokens", "prefix_cache_total_tokens", "rejected", "admitted")


def parse_gateway_metrics(text: str) -> Counters:
    """The counters of interest from the gateway's Prometheus exposition."""
    out: Counters = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "pdgate_prefill_attempts_total":
                out[f"attempts_{sample.labels['result']}"] = sample.value
            elif sample.name == "pdgate_prefill_abandoned_outcomes_total":
                key = f"abandoned_{sample.labels['outcome']}"
                out[key] = out.get(key, 0.0) + sample.value
            elif sample.name == "pdgate_requests_total":
                # Summed over the other labels (the scenario group).
                key = f"outcome_{sample.labels['outcome']}"
                out[key] = out.get(key, 0.0) + sample.value
            elif sample.name in (
                "pdgate_prefill_rejections_sum",
                "pdgate_prefill_rejections_count",
            ):
                out[sample.name.removeprefix("pdgate_")] = sample.value
            elif sample.name in ("pdgate_fleet_calls_total", "pdgate_fleet_call_seconds_total"):
                kind = "calls" if sample.name == "pdgate_fleet_calls_total" else "seconds"
                out[f"fleet_{kind}_{sample.labels['op']}"] = sample.value
            elif sample.name in ("pdgate_early_drops_total", "pdgate_fleet_yields_total"):
                out[sample.name.removeprefix("pdgate_").removesuffix("_total")] = sample.value
            elif sample.name == "pdgate_queue_sheds_total":
                out[f"queue_sheds_{sample.labels['reason']}"] = sample.value
    return out


def histogram_buckets(text: str, name: str) -> dict[float, float]:
    """The unlabelled histogram `name` in a Prometheus exposition: cumulative count by bucket
    bound (inf last); empty if it is not there."""
    out: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == name:
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    out[float(sample.labels["le"])] = sample.value
    return out


def bucket_quantile(buckets: Sequence[tuple[float, float]], q: float) -> float:
    """The smallest bucket bound holding the `q` quantile of a histogram given as cumulative
    (le, count) pairs (inf: above every finite bound; NaN: no observations)."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return math.nan
    return next(le for le, n in buckets if n >= q * total)


async def read_histogram(session: aiohttp.ClientSession, url: str, name: str) -> dict[float, float]:
    """`histogram_buckets` of the server at `url`'s ``/metrics`` now."""
    return histogram_buckets(str(await _get(session, url + "/metrics")), name)


# Counters also kept per gateway by `read_counters` (the rest are only summed).
PER_GATEWAY = ("early_drops", "fleet_yields", "queue_sheds_drain", "queue_sheds_full")


async def _get(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
        resp.raise_for_status()
        if resp.content_type == "application/json":
            return await resp.json()
        return await resp.text()


# /load fields summed over every instance (`read_counters`' `instance_urls`), not only the
# prefills: the phase-switching waits are recorded where the decode steps run.
_INSTANCE_FIELDS = ("phase_switch_waits", "phase_switch_wait_s")


async def read_counters(
    session: aiohttp.ClientSession,
    gateway_urls: Sequence[str],
    prefill_urls: Sequence[str],
    instance_urls: Sequence[str] = (),
) -> Counters:
    """One snapshot of every counter (cumulative since the cluster started), gateways' and
    prefills' each summed; with `instance_urls` (every shim) also `_INSTANCE_FIELDS`."""
    replies = await asyncio.gather(
        *(_get(session, url + "/metrics") for url in gateway_urls),
        *(_get(session, url + "/load") for url in (*prefill_urls, *instance_urls)),
    )
    # A counter that never moved has no sample yet: 0, not absent (absent = no gateway read).
    out: Counters = dict.fromkeys(ATTEMPT_KEYS, 0.0) if gateway_urls else {}
    for i, text in enumerate(replies[: len(gateway_urls)]):
        for key, value in parse_gateway_metrics(str(text)).items():
            out[key] = out.get(key, 0.0) + value
            if key in PER_GATEWAY:
                out[f"gw{i}_{key}"] = value
    loads = replies[len(gateway_urls) : len(gateway_urls) + len(prefill_urls)]
    for name in _LOAD_FIELDS:
        out[f"shim_{name}"] = float(sum(load.get(name, 0) for load in loads))
    if instance_urls:
        everyone = replies[len(gateway_urls) + len(prefill_urls) :]
        for name in _INSTANCE_FIELDS:
            out[f"shim_{name}"] = float(sum(load.get(name, 0) for load in everyone))
    return out


@dataclass(frozen=True, slots=True)
class HoldSnapshot:
    """The prefills' KV holds at one moment, over every prefill (NaN: not reported)."""

    max_s: float  # the longest hold any prefill has seen since it started
    over_5s: float  # holds over 5 s, summed over the prefills, since they started
    held: float  # KV held right now, summed


_HOLD_MAX, _HOLD_LONG = "kv_hold_max_s", "kv_hold_over_5s"


def holds_of(loads: Sequence[Mapping[str, Any]]) -> HoldSnapshot:
    """The snapshot from the prefills' ``/load`` bodies; a key one prefill lacks is NaN for
    all (a sum or maximum over part of the prefills would look like a measurement)."""

    def every(key: str) -> list[float] | None:
        values = [load.get(key) for load in loads]
        numbers = [float(v) for v in values if isinstance(v, int | float)]
        return numbers if loads and len(numbers) == len(values) else None

    longest, over, held = every(_HOLD_MAX), every(_HOLD_LONG), every("kv_held")
    return HoldSnapshot(
        max_s=max(longest) if longest else math.nan,
        over_5s=sum(over) if over else math.nan,
        held=sum(held) if held else math.nan,
    )


async def read_holds(session: aiohttp.ClientSession, prefill_urls: Sequence[str]) -> HoldSnapshot:
    loads = await asyncio.gather(*(_get(session, url + "/load") for url in prefill_urls))
    return holds_of([load if isinstance(load, dict) else {} for load in loads])


async def wait_kv_released(
    session: aiohttp.ClientSession, prefill_urls: Sequence[str], timeout_s: float
) -> HoldSnapshot:
    """Until no prefill holds KV or `timeout_s` passed; the last snapshot. Called once every
    request has ended: what is still held then was stranded (nobody will fetch it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        snap = await read_holds(session, prefill_urls)
        if not snap.held or math.isnan(snap.held) or time.monotonic() >= deadline:
            return snap
        await asyncio.sleep(0.1)


async def wait_http(session: aiohttp.ClientSession, url: str, timeout_s: float = 30.0) -> None:
    """Until GET `url` answers 200."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(aiohttp.ClientError, OSError):
            async with session.get(url) as resp:
                if resp.status == 200:
                    return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer 200 in {timeout_s:g} s")
        await asyncio.sleep(0.1)


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
