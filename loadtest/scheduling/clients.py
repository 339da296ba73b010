"""How a closed loop's user sends a request and what it does when it is refused: the
``--client`` of ``pdgate bench scheduling``.

- ``instant``: whatever the answer, its next request at once. Nobody runs clients so, but
  it is the stress case: refusals come back as fast as they go out.
- ``honour``: refused with a Retry-After (429, 503), it waits that long (read as the OpenAI
  clients read it: ``retry-after-ms`` first, at most `RETRY_AFTER_MAX_S`) and sends the same
  request again, up to `MAX_RETRIES` times, the official clients' default.
- ``openai``: the official openai client (`AsyncOpenAI`, one per user) with its own policy:
  `MAX_RETRIES` retries of 408, 409, 429, 5xx and broken connections, each after the
  server's Retry-After if it gives one of at most two minutes, else its exponential
  back-off from 0.5 s with jitter. Anthropic Messages requests (the API mix) go as
  ``honour`` sends them: that client is not the openai one.

Each request is one result, its attempts counted (`RequestResult.attempts`) and the rest
its last try's, timed from that try's start: the gateway's verdict on the try that ended
it, so that TTFT keeps meaning the server's. The summary's share of retried requests that
succeeded on their first retry says whether the Retry-After told the truth.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

import aiohttp
import openai

from pdgate.loadtest.lib.sse import (
    PREFILL_HEADER,
    PRIORITY_HEADER,
    TENANT_HEADER,
    TTFT_HEADER,
    retry_after_s,
)
from pdgate.loadtest.lib.stats import RequestResult
from pdgate.loadtest.scheduling._load import COMPLETIONS_PATH, send_completion
from pdgate.loadtest.scheduling.workload import Prompt

__all__ = ["CLIENTS", "MAX_RETRIES", "RETRY_AFTER_MAX_S", "OpenAIUser", "send_honouring"]

CLIENTS = ("instant", "honour", "openai")
# The official clients' defaults: two retries, and a Retry-After honoured up to two minutes.
MAX_RETRIES = 2
RETRY_AFTER_MAX_S = 120.0
_REFUSED = frozenset({429, 503})
# Past its TTFT deadline, how long a client still waits for an answer: every failure is then
# the server's verdict, not a client timeout.
_SLACK_S = 30.0


async def send_honouring(
    session: aiohttp.ClientSession, url: str, model: str, prompt: Prompt, *, gateway: int
) -> RequestResult:
    """Send `prompt`; refused with a Retry-After, wait it and send it again (at most
    `MAX_RETRIES` times)."""
    attempts = 1
    result = await send_completion(session, url, model, prompt, gateway=gateway)
    while (
        attempts <= MAX_RETRIES
        and result.status in _REFUSED
        and result.retry_after_s is not None
        and result.retry_after_s <= RETRY_AFTER_MAX_S
    ):
        await asyncio.sleep(result.retry_after_s)
        attempts += 1
        result = await send_completion(session, url, model, prompt, gateway=gateway)
    return replace(result, attempts=attempts)


class OpenAIUser:
    """One user's official openai client towards `completions_url`'s API: its own
    connections and retry policy, with hooks that count its tries and time the last."""

    def __init__(self, completions_url: str, model: str) -> None:
        self._model = model
        self._starts: list[float] = []  # when each try of the current request went out
        http = openai.DefaultAsyncHttpxClient(event_hooks={"request": [self._sent]})
        self._client = openai.AsyncOpenAI(
            base_url=completions_url.removesuffix(COMPLETIONS_PATH) + "/v1",
            api_key="unused",
            max_retries=MAX_RETRIES,
            http_client=http,
        )

    async def _sent(self, request: Any) -> None:
        self._starts.append(time.monotonic())

    async def aclose(self) -> None:
        await self._client.close()

    async def send(self, prompt: Prompt, *, gateway: int) -> RequestResult:
        scenario = prompt.scenario
        headers = {TTFT_HEADER: str(round(scenario.ttft_deadline_s * 1000))}
        if prompt.tenant is not None:
            headers[TENANT_HEADER] = prompt.tenant.name
            headers[PRIORITY_HEADER] = prompt.tenant.priority
        self._starts.clear()
        began = time.monotonic()
        status, ttft, pieces, completed, told, prefill = 0, None, 0, False, None, ""
        try:
            stream = await self._open(prompt, headers, scenario.ttft_deadline_s + _SLACK_S)
            status = 200
            prefill = stream.response.headers.get(PREFILL_HEADER, "")
            async for event in stream:
                if _has_text(prompt.api, event):
                    pieces += 1
                    if ttft is None:
                        ttft = time.monotonic() - self._starts[-1]
            completed = True
        except openai.APIStatusError as exc:
            status, told = exc.status_code, retry_after_s(exc.response.headers)
        except openai.APIError:
            pass  # broken connection, timeout or in-band error: not completed
        end = time.monotonic()
        start = self._starts[-1] if self._starts else began
        e2e = end - start
        return RequestResult(
            scenario=scenario.name,
            deadline_s=scenario.ttft_deadline_s,
            status=status,
            ttft_s=ttft,
            e2e_s=e2e,
            completed=completed,
            gateway=gateway,
            tenant="" if prompt.tenant is None else prompt.tenant.name,
            tpot_s=None if ttft is None or pieces < 2 else (e2e - ttft) / (pieces - 1),
            tpot_slo_s=scenario.tpot_slo_s,
            retry_after_s=told,
            attempts=max(1, len(self._starts)),
            prefill=prefill,
        )

    async def _open(self, prompt: Prompt, headers: dict[str, str], timeout_s: float) -> Any:
        common: dict[str, Any] = {
            "model": self._model,
            "stream": True,
            "extra_headers": headers,
            "timeout": timeout_s,
        }
        tokens = prompt.scenario.max_tokens
        if prompt.api == "completions":
            return await self._client.completions.create(
                prompt=prompt.text, max_tokens=tokens, temperature=0, **common
            )
        if prompt.api == "chat":
            messages: Any = [{"role": "user", "content": prompt.text}]
            return await self._client.chat.completions.create(
                messages=messages, max_tokens=tokens, temperature=0, **common
            )
        return await self._client.responses.create(
            input=prompt.text, max_output_tokens=tokens, temperature=0, **common
        )


def _has_text(api: str, event: Any) -> bool:
    """Whether a stream event carries a piece of the answer."""
    if api == "responses":
        return getattr(event, "type", "") == "response.output_text.delta"
    choices = getattr(event, "choices", None)
    if not choices:
        return False
    if api == "chat":
        return bool(choices[0].delta.content)
    return bool(choices[0].text)
