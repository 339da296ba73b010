"""What the closed and the open loop share: sending one request, the measurement window and
stopping.

The caller opens and closes a measurement window; requests *issued* inside it are the
sample, each followed to its end even after the window closed, so slow and failed requests
are counted as fully as fast ones.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import aiohttp
import orjson

from pdgate.config.aio import finish_or_cancel
from pdgate.loadtest.lib.sse import (
    MESSAGES,
    OPENAI,
    PRIORITY_HEADER,
    RESPONSES,
    TENANT_HEADER,
    TTFT_HEADER,
    post_stream,
    tpot_s,
)
from pdgate.loadtest.lib.stats import RequestResult
from pdgate.loadtest.scheduling.workload import Prompt, Workload

__all__ = ["LoadGenerator", "send_completion"]

COMPLETIONS_PATH = "/v1/completions"
_PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}


async def send_completion(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    prompt: Prompt,
    *,
    gateway: int = 0,
    slack_s: float = 30.0,
) -> RequestResult:
    """POST one streaming request to `url` (…/v1/completions, or the path of the prompt's
    other API beside it) and time it.

    The request asks the gateway for the scenario's TTFT deadline; the client itself only
    gives up `slack_s` after it, so every failure is the server's verdict, not a client
    timeout. A prompt with a tenant carries its name and priority class as headers.
    """
    scenario = prompt.scenario
    dialect = OPENAI
    if prompt.api == "completions":
        request = {"model": model, "prompt": prompt.text, "max_tokens": scenario.max_tokens}
    else:
        url = url.removesuffix(COMPLETIONS_PATH) + _PATHS[prompt.api]
        if prompt.api == "responses":
            request = {
                "model": model,
                "input": prompt.text,
                "max_output_tokens": scenario.max_tokens,
            }
            dialect = RESPONSES
        else:
            messages = [{"role": "user", "content": prompt.text}]
            request = {"model": model, "messages": messages, "max_tokens": scenario.max_tokens}
            dialect = MESSAGES if prompt.api == "messages" else OPENAI
    body = orjson.dumps({**request, "temperature": 0, "stream": True})
    headers = {TTFT_HEADER: str(round(scenario.ttft_deadline_s * 1000))}
    tenant = prompt.tenant
    if tenant is not None:
        headers[TENANT_HEADER] = tenant.name
        headers[PRIORITY_HEADER] = tenant.priority
    start = time.monotonic()
    out = await post_stream(
        session,
        url,
        body,
        headers=headers,
        client_timeout=aiohttp.ClientTimeout(total=scenario.ttft_deadline_s + slack_s),
        dialect=dialect,
    )
    e2e = out.end - start
    return RequestResult(
        scenario=scenario.name,
        deadline_s=scenario.ttft_deadline_s,
        status=out.status,
        ttft_s=out.ttft_s,
        e2e_s=e2e,
        completed=out.completed,
        gateway=gateway,
        tenant="" if tenant is None else tenant.name,
        # The stream is not parsed: each data event but [DONE] carries one piece of text.
        tpot_s=tpot_s(e2e, out.ttft_s, out.events),
        tpot_slo_s=scenario.tpot_slo_s,
        retry_after_s=out.retry_after_s,
        prefill=out.prefill,
    )


@dataclass(eq=False)
class LoadGenerator:
    """Tasks that issue requests of `workload` to `completions_urls` (one per gateway), a
    measurement window, and a bounded stop. Subclasses add what drives their load as
    fields, and create their tasks in `start` (adding them to ``self._tasks``)."""

    session: aiohttp.ClientSession
    completions_urls: Sequence[str]
    model: str
    workload: Workload
    results: list[RequestResult] = field(default_factory=list, init=False)
    issued: int = field(default=0, init=False)  # every request issued, in the window or not
    _tasks: set[asyncio.Task[None]] = field(default_factory=set, init=False, repr=False)
    _stopping: bool = field(default=False, init=False, repr=False)
    _window: tuple[float, float] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.completions_urls:
            raise ValueError("gateway URLs must not be empty")

    def start(self) -> None:
        raise NotImplementedError

    def open_window(self) -> None:
        self._window = (time.monotonic(), float("inf"))

    def close_window(self) -> float:
        """Stop sampling new requests; returns the window's length in seconds."""
        if self._window is None:
            raise RuntimeError("the window was never opened")
        start = self._window[0]
        self._window = (start, time.monotonic())
        return self._window[1] - start

    def _in_window(self, t: float) -> bool:
        return self._window is not None and self._window[0] <= t < self._window[1]

    def _record(self, issued: float, result: RequestResult) -> None:
        """Keep `result` in the sample if it was issued inside the window, with when."""
        if self._window is not None and self._in_window(issued):
            self.results.append(replace(result, issued_s=issued - self._window[0]))

    def _halt(self) -> None:
        """Stop issuing at once (beyond the `_stopping` flag); a hook for subclasses."""

    async def stop(self, timeout_s: float) -> int:
        """Stop issuing; wait up to `timeout_s` for requests in flight to end. Returns how
        many were still running and had to be cancelled (0 unless something hung)."""
        self._stopping = True
        self._halt()
        # A timeout of 0 stops at once (a failed point).
        return await finish_or_cancel(set(self._tasks), timeout_s)
