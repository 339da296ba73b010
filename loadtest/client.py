"""One streaming completion, timed from the client: as little work per byte as possible.

The load generator shares two cores with the cluster, so the SSE stream is not parsed: the
client only looks for the first token event (``data: {"id"`` in OpenAI's chunk layout,
which an in-band error ``data: {"error"`` is not), an in-band error and ``data: [DONE]``,
carrying a few bytes across chunk boundaries so a marker split between two reads is found.
"""

from __future__ import annotations

import time

import aiohttp
import orjson

from loadtest.stats import RequestResult
from loadtest.workload import Prompt

__all__ = ["TTFT_HEADER", "send_completion"]

TTFT_HEADER = "x-pdgate-ttft-timeout-ms"  # the gateway may only shorten its deadline by it

_TOKEN = b'data: {"id"'
_ERROR = b'data: {"error"'
_DONE = b"data: [DONE]"
_CARRY = max(len(_TOKEN), len(_ERROR), len(_DONE)) - 1
_HEADERS = {"content-type": "application/json"}


async def send_completion(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    prompt: Prompt,
    *,
    slack_s: float = 30.0,
) -> RequestResult:
    """POST one streaming request to `url` (…/v1/completions) and time it.

    The request asks the gateway for the scenario's TTFT deadline; the client itself only
    gives up `slack_s` after it, so every failure is the server's verdict, not a client
    timeout.
    """
    scenario = prompt.scenario
    body = orjson.dumps(
        {
            "model": model,
            "prompt": prompt.text,
            "max_tokens": scenario.max_tokens,
            "temperature": 0,
            "stream": True,
        }
    )
    headers = {**_HEADERS, TTFT_HEADER: str(round(scenario.ttft_deadline_s * 1000))}
    start = time.monotonic()
    ttft: float | None = None
    completed = False
    status = 0
    try:
        async with session.post(
            url,
            data=body,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=scenario.ttft_deadline_s + slack_s),
        ) as resp:
            status = resp.status
            if status != 200:
                await resp.read()
            else:
                tail = b""
                errored = False
                async for chunk in resp.content.iter_any():
                    window = tail + chunk
                    if ttft is None and _TOKEN in window:
                        ttft = time.monotonic() - start
                    if _ERROR in window:
                        errored = True
                    tail = window[-_CARRY:]
                    if _DONE in window:
                        completed = not errored
    except (aiohttp.ClientError, TimeoutError, OSError):
        completed = False
    return RequestResult(
        scenario=scenario.name,
        deadline_s=scenario.ttft_deadline_s,
        status=status,
        ttft_s=ttft,
        e2e_s=time.monotonic() - start,
        completed=completed,
    )
