"""Locust: OpenAI streaming users against ``/v1/completions`` (pdgate or any vLLM-compatible
endpoint), with TTFT, inter-token latency, TPOT and E2E reported as their own Locust rows.

    locust -f loadtest/locust/locustfile.py --host http://127.0.0.1:8000 --headless \
        --run-time 60s --stop-timeout 30 --csv docs/results/loadtest/step \
        --html docs/results/loadtest/step.html

Why ``HttpUser`` (requests) with ``stream=True`` and ``iter_lines(chunk_size=None)``: each
line must be timed when it arrives. ``FastHttpUser.iter_lines`` reads 1 KiB blocks, so small
SSE events wait for the next ones and TTFT/ITL come out late; requests with
``chunk_size=None`` hands over each HTTP chunk as soon as it is read.

Rows: ``POST /v1/completions`` (Locust's own timing: response headers; its failures are the
stream's verdict: non-200, in-band ``{"error": ...}``, no ``data: [DONE]``), and ``SSE TTFT``,
``SSE ITL`` (one sample per gap between text events), ``SSE TPOT``, ``SSE E2E`` for
successful streams, in milliseconds.

The load shape comes from ``PDGATE_LOCUST_SHAPE`` (step, surge or tidal; see
shape_classes.py for its parameters). Without it all three are offered, for the web UI's
``--class-picker``; headless Locust then runs the first (step). The workload is
workload.json (workload.py). Prompts are never logged or reported. The SSE timing is the
benchmarks' shared line parser (loadtest/lib/sse.py, `StreamTimer`).
"""

from __future__ import annotations

import os
import random
import time
from typing import Any, ClassVar

import orjson
from locust import HttpUser, constant, task
from requests.exceptions import RequestException

from pdgate.loadtest.lib.sse import StreamResult, StreamTimer
from pdgate.loadtest.locust import shape_classes
from pdgate.loadtest.locust.workload import LocustWorkload, load_workload

# Locust runs every LoadTestShape class bound in this module (headless: the first one), so
# only the shape asked for is bound; without one, all three are, for --class-picker.
_SHAPE = os.environ.get("PDGATE_LOCUST_SHAPE", "").strip().lower()
if _SHAPE:
    if _SHAPE not in shape_classes.SHAPES:
        known = ", ".join(shape_classes.SHAPES)
        raise SystemExit(f"PDGATE_LOCUST_SHAPE={_SHAPE!r}: expected one of {known}")
    Shape = shape_classes.SHAPES[_SHAPE]
else:
    StepShape = shape_classes.StepShape
    SurgeShape = shape_classes.SurgeShape
    TidalShape = shape_classes.TidalShape

_MAX_BODY_CHARS = 200  # of an error response, in a failure message
_TIMEOUT_S = (10.0, 120.0)  # connect, and between two reads (a stream may idle that long)


class OpenAIStreamUser(HttpUser):
    """A closed-loop user: send a streaming completion, read it to the end, repeat."""

    wait_time = constant(0)
    _workload: ClassVar[LocustWorkload | None] = None

    def on_start(self) -> None:
        if OpenAIStreamUser._workload is None:  # read once per Locust process
            OpenAIStreamUser._workload = load_workload()
        self.workload = OpenAIStreamUser._workload
        self.rng = random.Random()

    @task
    def stream_completion(self) -> None:
        req = self.workload.pick(self.rng)
        body = orjson.dumps(
            {
                "model": self.workload.model,
                "prompt": req.prompt,
                "max_tokens": req.max_tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        )
        start = time.perf_counter()
        timer = StreamTimer(start)
        with self.client.post(
            "/v1/completions",
            data=body,
            headers={"content-type": "application/json"},
            stream=True,
            catch_response=True,
            timeout=_TIMEOUT_S,
            name="/v1/completions",
        ) as resp:
            if resp.status_code != 200:
                text = resp.text[:_MAX_BODY_CHARS] if resp.text else ""
                resp.failure(f"HTTP {resp.status_code}: {text}")
                return
            try:
                for line in resp.iter_lines(chunk_size=None):
                    timer.feed(line, time.perf_counter())
            except RequestException as exc:
                resp.failure(f"stream broken: {type(exc).__name__}")
                return
            result = timer.finish(time.perf_counter())
            reason = result.failure
            if reason is not None:
                resp.failure(reason)
                return
            resp.success()
        self._report(result)

    def _report(self, result: StreamResult) -> None:
        fire = self.environment.events.request.fire

        def sample(name: str, seconds: float) -> None:
            meta: dict[str, Any] = {
                "request_type": "SSE",
                "name": name,
                "response_time": seconds * 1000.0,
                "response_length": 0,
                "exception": None,
                "context": {},
            }
            fire(**meta)

        assert result.ttft_s is not None  # a successful stream has one
        sample("TTFT", result.ttft_s)
        for gap in result.itl_s:
            sample("ITL", gap)
        tpot = result.tpot_s
        if tpot is not None:
            sample("TPOT", tpot)
        sample("E2E", result.e2e_s)
