"""What parsing each SSE event costs the relay (decode migration needs the token ids).

With ``max_migrations = 0`` (and no first token early) the relay passes a stream's bytes
through; otherwise it parses every event to record its token ids, strips the ids the client
did not ask for and re-encodes the event (or keeps its bytes when nothing changed), and a
continuation leg's events are reshaped as the client's stream. This streams one long decode
answer (one event per token, vLLM's shape with ``return_token_ids``) through `Relay` over
`MockUpstream` in each mode, interleaved over several rounds, and reports the relay's time
per event (median round) and the difference to the byte relay.

    python -m pdgate.loadtest.gateway_cost.relay_events [--events 20000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from typing import Any

import orjson

from pdgate.config import GatewaySettings, Role
from pdgate.config.aio import ConstantBackoff
from pdgate.config.openai_api import Api, parse_api, sse_event
from pdgate.config.wire import EXT_CONTINUATION, SSE_DONE
from pdgate.gateway.app import build_dispatcher
from pdgate.gateway.instances.tracker import InstanceTracker
from pdgate.gateway.observe.metrics import GatewayMetrics
from pdgate.gateway.stream.relay import Relay, RelayOptions, RelayRequest
from pdgate.gateway.upstream.mock import Call, MockUpstream, Reply
from pdgate.policies import load_policy
from pdgate.policies.base import RequestInfo
from pdgate.registry.base import InstanceRecord

# mode: (relay options, client asks for ids, the stream is a continuation leg)
MODES: dict[str, tuple[dict[str, Any], bool]] = {
    "bytes (migration off)": ({"max_migrations": 0}, False),
    "parsed, ids stripped": ({"max_migrations": 2}, False),
    "parsed, client asked ids": ({"max_migrations": 2}, True),
    "continuation (first token early)": ({"max_migrations": 2, "first_token_early": True}, False),
}


def _events(n: int, *, ids: bool) -> list[bytes]:
    head = {"id": "req-1", "object": "text_completion", "created": 1, "model": "m"}
    out = []
    for i in range(n):
        choice: dict[str, Any] = {"index": 0, "text": " token", "logprobs": None,
                                  "finish_reason": "length" if i == n - 1 else None}  # fmt: skip
        if ids:
            choice["token_ids"] = [1000 + i % 30000]
            if i == 0:
                choice["prompt_token_ids"] = list(range(64))
        out.append(sse_event({**head, "choices": [choice]}))
    out.append(SSE_DONE)
    return out


class _Null:
    async def __call__(self, message: Any) -> None:
        return None


async def _one(n: int, options: dict[str, Any], client_ids: bool) -> float:
    chunks = _events(n, ids=True)

    async def handler(call: Call) -> Reply:
        if call.leg == "prefill":
            choice = {"text": " token", "token_ids": [7], "prompt_token_ids": list(range(64))}
            params = {"remote_host": "p0", "remote_port": 80, "remote_request_id": "kv"}
            return Reply(json={"choices": [choice], "kv_transfer_params": params})
        return Reply(chunks=chunks)

    tracker = InstanceTracker(reject_hold_s=0.05)
    decode = InstanceRecord(
        id="d0", role=Role.DECODE, url="http://d0", model="m", extensions=(EXT_CONTINUATION,)
    )
    prefill = InstanceRecord(id="p0", role=Role.PREFILL, url="http://p0", model="m")
    tracker.update_membership({"p0": prefill, "d0": decode})
    metrics = GatewayMetrics(tracker.totals, lambda: 0)
    d = build_dispatcher(
        GatewaySettings(), tracker=tracker, upstream=MockUpstream(handler), metrics=metrics,
        prefill_policy=load_policy("least_sse"), decode_policy=load_policy("least_loaded"),
        backoff=ConstantBackoff(0.01),
    )  # fmt: skip
    body = {"model": "m", "prompt": "p", "max_tokens": n + 1, "stream": True}
    if client_ids:
        body["return_token_ids"] = True
    req, forward = parse_api(Api.COMPLETIONS, orjson.dumps(body), max_tokens_limit=1 << 30)
    info = RequestInfo(model="m", group=None, prompt="p", prompt_chars=1, max_tokens=n + 1)
    now = time.monotonic()
    relay = Relay(
        d, _Null(), RelayRequest(info, req, forward, Api.COMPLETIONS, "req-1", now + 60, now),
        RelayOptions(**options), metrics,
    )  # fmt: skip
    started = time.perf_counter()
    outcome = await relay.run()
    took = time.perf_counter() - started
    if relay.first is not None:
        relay.first.close()
    await d.close()
    assert outcome == "ok", outcome
    return took / n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--events", type=int, default=20000, help="events per stream")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per mode")
    args = p.parse_args(argv)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode, (options, client_ids) in MODES.items():
            times[mode].append(asyncio.run(_one(args.events, options, client_ids)))
    base = statistics.median(times["bytes (migration off)"])
    report = {}
    for mode, values in times.items():
        us = statistics.median(values) * 1e6
        report[mode] = {"us_per_event": round(us, 2), "vs_bytes_us": round(us - base * 1e6, 2)}
        print(f"{mode:36s} {us:7.2f} us/event  ({us - base * 1e6:+.2f})", file=sys.stderr)
    print(orjson.dumps({"events": args.events, "rounds": args.rounds, "modes": report}).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
