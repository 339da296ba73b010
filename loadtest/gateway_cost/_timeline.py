"""Where a request's TTFT goes, hop by hop, on the stock engines.

The stock engines (stock.py) note when each leg arrived and answered, by a digest of its
prompt, on ``time.monotonic()``: the clock every process of the machine shares. With the
client's own start and first-token times, a concurrency-1 request's TTFT splits into five
consecutive parts that add up to it:

* ``to_prefill``: client sends -> the prefill leg reaches the engine (through the front, or
  straight from the client on the direct path);
* ``prefill``: the engine's prefill leg, arrival to answer;
* ``between_legs``: the prefill's answer -> the decode leg reaches the engine (the front reads
  the answer, picks a decode and sends it the leg);
* ``decode``: the decode leg's arrival -> its first event written;
* ``to_client``: that event written -> the client saw the first token (through the front).

The front's own share of the added TTFT is then visible where it is paid.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import aiohttp

from pdgate.loadtest.gateway_cost.stock import prompt_key
from pdgate.loadtest.lib.stats import percentile

__all__ = ["SEGMENTS", "Probe", "read_timeline", "segment_medians"]

SEGMENTS = ("to_prefill", "prefill", "between_legs", "decode", "to_client")
_EVENTS = ("prefill_in", "prefill_out", "decode_in", "first_out")


@dataclass(frozen=True, slots=True)
class Probe:
    front: str
    prompt: str
    start: float  # time.monotonic() when the client sent it
    ttft_s: float


async def read_timeline(
    session: aiohttp.ClientSession, urls: Sequence[str]
) -> dict[str, dict[str, float]]:
    """Every engine's leg events, by prompt key (the first of each event per key)."""

    async def one(url: str) -> list[list[object]]:
        async with session.get(url + "/_timeline", timeout=aiohttp.ClientTimeout(total=10)) as r:
            r.raise_for_status()
            rows: list[list[object]] = await r.json()
            return rows

    out: dict[str, dict[str, float]] = {}
    for rows in await asyncio.gather(*(one(u) for u in urls)):
        for key, event, at in rows:
            assert isinstance(at, float)
            out.setdefault(str(key), {}).setdefault(str(event), at)
    return out


def segment_medians(
    probes: Iterable[Probe], timeline: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    """p50 of each part (ms) per front, over the probes the engines saw both legs of."""
    parts: dict[str, dict[str, list[float]]] = {}
    for probe in probes:
        seen = timeline.get(prompt_key(probe.prompt), {})
        if not all(e in seen for e in _EVENTS):
            continue
        marks = [probe.start, *(seen[e] for e in _EVENTS), probe.start + probe.ttft_s]
        row = parts.setdefault(probe.front, {s: [] for s in SEGMENTS})
        for name, a, b in zip(SEGMENTS, marks[:-1], marks[1:], strict=True):
            row[name].append(1000 * (b - a))
    return {
        front: {name: percentile(values, 50) for name, values in row.items()}
        for front, row in parts.items()
    }
