"""A small P/D cluster behind `MockUpstream`, and the gateway parts wired to it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from pdgate.config import GatewaySettings, QueueOrder, Role
from pdgate.config.aio import Background, ConstantBackoff
from pdgate.config.openai_api import Api, parse_api
from pdgate.config.wire import EXT_BATCH_PREFILL, EXT_QUEUELESS, SSE_DONE
from pdgate.gateway.app import build_dispatcher
from pdgate.gateway.instances.health import Ejection, Ejector, RetryBudget
from pdgate.gateway.instances.tracker import InstanceTracker
from pdgate.gateway.observe.metrics import GatewayMetrics
from pdgate.gateway.placement.admission import AdmissionOptions
from pdgate.gateway.placement.decode_attempt import client_error
from pdgate.gateway.placement.dispatch import Dispatcher
from pdgate.gateway.placement.drain import DecodeCapacity, DecodeWaits
from pdgate.gateway.placement.forwarder import PrefillForwarder
from pdgate.gateway.placement.leases import Fleet
from pdgate.gateway.placement.placed import DecodeLeg, Placement
from pdgate.gateway.placement.queue import Waiter, WaitQueue
from pdgate.gateway.placement.shared import ForwardingOptions, Shared
from pdgate.gateway.stream.relay import Relay, RelayOptions, RelayRequest
from pdgate.gateway.upstream.mock import Call, MockUpstream, Reply
from pdgate.policies import load_policy
from pdgate.policies.base import Ranker, RequestInfo
from pdgate.registry.base import InstanceRecord
from pdgate.registry.fleet import LocalFleet


def completion_chunks(text: str, *, request_id: str = "cmpl-1") -> list[bytes]:
    """A decode's SSE stream of `text`, one character per event, then [DONE]."""
    out = []
    for i, ch in enumerate(text):
        finish = "length" if i == len(text) - 1 else None
        event = {
            "id": request_id,
            "object": "text_completion",
            "created": 1,
            "model": "m",
            "choices": [{"index": 0, "text": ch, "logprobs": None, "finish_reason": finish}],
        }
        out.append(b"data: " + orjson.dumps(event) + b"\n\n")
    usage = {"prompt_tokens": 3, "completion_tokens": len(text), "total_tokens": 3 + len(text)}
    tail = {"id": request_id, "object": "text_completion", "created": 1, "model": "m"}
    out.append(b"data: " + orjson.dumps({**tail, "choices": [], "usage": usage}) + b"\n\n")
    out.append(SSE_DONE)
    return out


@dataclass
class FakeCluster:
    """Prefills accept (or do what `prefill_script` says per call), decodes stream `text`."""

    text: str = "hello"
    prefill_delay_s: float = 0.0
    # Per prefill call, in order: a Reply to give instead of the normal answer.
    prefill_script: list[Reply] = field(default_factory=list)
    decode_script: list[Reply] = field(default_factory=list)
    decode_chunk_delay_s: float = 0.0
    gate: asyncio.Event | None = None  # prefills wait for it when set

    async def __call__(self, call: Call) -> Reply:
        if call.leg == "prefill":
            if self.gate is not None:
                await self.gate.wait()
            if self.prefill_delay_s:
                await asyncio.sleep(self.prefill_delay_s)
            if self.prefill_script:
                return self.prefill_script.pop(0)
            params = {
                "do_remote_prefill": True,
                "remote_host": call.url.split("//")[1],
                "remote_port": 80,
                "remote_request_id": call.kv_id or "kv",
            }
            return Reply(json={"choices": [{"text": self.text[:1]}], "kv_transfer_params": params})
        if self.decode_script:
            return self.decode_script.pop(0)
        return Reply(
            chunks=completion_chunks(self.text, request_id=call.request_id),
            chunk_delay_s=self.decode_chunk_delay_s,
        )


def records(
    prefills: Sequence[int], decodes: Sequence[int] = (), *, stock: bool = False
) -> dict[str, InstanceRecord]:
    """Prefills p0.. and decodes d0.. with the given capacities; pdgate shims (prefills
    declare the batch endpoint) unless `stock`."""
    out = {}
    for role, caps, tag in ((Role.PREFILL, prefills, "p"), (Role.DECODE, decodes, "d")):
        ext = (EXT_BATCH_PREFILL,) if role is Role.PREFILL and not stock else ()
        for i, cap in enumerate(caps):
            rid = f"{tag}{i}"
            out[rid] = InstanceRecord(
                id=rid, role=role, url=f"http://{rid}", model="m", capacity=cap, extensions=ext
            )
    return out


def tracker_for(
    prefills: Sequence[int], decodes: Sequence[int] = (), *, stock: bool = False
) -> InstanceTracker:
    tracker = InstanceTracker(reject_hold_s=0.05)
    tracker.update_membership(records(prefills, decodes, stock=stock))
    return tracker


def decode_fleet(*, hard: bool = True, decodes: tuple[int, ...] = (4, 4)) -> InstanceTracker:
    """One prefill of one slot and decodes of the given slots, which enforce them (429 when
    full) if `hard`, as pdgate's shims declare."""
    ext = (EXT_QUEUELESS,) if hard else ()
    recs = [InstanceRecord(id="p0", role=Role.PREFILL, url="http://p0", model="m")]
    recs += [
        InstanceRecord(
            id=f"d{i}", role=Role.DECODE, url=f"http://d{i}", model="m", capacity=c, extensions=ext
        )
        for i, c in enumerate(decodes)
    ]
    tracker = InstanceTracker(reject_hold_s=0.05)
    tracker.update_membership({r.id: r for r in recs})
    return tracker


def info(prompt: str = "p", chars: int | None = None) -> RequestInfo:
    return RequestInfo(
        model="m",
        group=None,
        prompt=prompt,
        prompt_chars=len(prompt) if chars is None else chars,
        max_tokens=4,
    )


def waiter(i: int = 0, *, deadline_s: float = 5.0, prompt: str | None = None) -> Waiter:
    return Waiter(
        info=info(prompt or f"p{i}"),
        body={},
        request_id=f"r{i}",
        deadline=time.monotonic() + deadline_s,
        future=asyncio.get_running_loop().create_future(),
    )


def forwarder(
    upstream: MockUpstream,
    tracker: InstanceTracker,
    options: ForwardingOptions | None = None,
    *,
    admission: AdmissionOptions | None = None,
    order: QueueOrder = QueueOrder.EDF,
    policy: Ranker | None = None,
    fleet: Fleet | None = None,
    decode_capacity: DecodeCapacity | None = None,
    ejection: Ejection | None = None,
    budget: RetryBudget | None = None,
) -> tuple[PrefillForwarder, GatewayMetrics, Background]:
    metrics = GatewayMetrics(tracker.totals, lambda: 0)
    background = Background("test")
    fwd = PrefillForwarder(
        "m",
        None,
        WaitQueue(100, order),
        policy or load_policy("least_sse"),
        Shared(
            tracker,
            upstream,
            ConstantBackoff(0.01),
            metrics,
            None,
            options or ForwardingOptions(client_error=client_error),
            background,
            fleet or Fleet(LocalFleet("test"), tracker),
            Ejector(tracker, metrics, ejection or Ejection()),
            budget or RetryBudget(),
            DecodeWaits(tracker),
            decode_capacity=decode_capacity,
            admission=admission or AdmissionOptions(),
        ),
    )
    return fwd, metrics, background


def batching_forwarder(
    upstream: MockUpstream, tracker: InstanceTracker
) -> tuple[PrefillForwarder, GatewayMetrics, Background]:
    """A forwarder that sends runs of queued requests as one batch call (FIFO order)."""
    options = ForwardingOptions(
        batch_forwarding=True, batch_endpoint=True, client_error=client_error
    )
    return forwarder(upstream, tracker, options, order=QueueOrder.FIFO)


async def place(
    d: Dispatcher, info: RequestInfo, forward: dict[str, Any], **options: Any
) -> Placement:
    """Both legs with the request's own body, as the relay places a request that sends the
    client nothing between them (`options`: `Dispatcher.prefill`'s)."""
    prefilled = await d.prefill(info, forward, **options)
    return await d.decode(prefilled, DecodeLeg(forward, options.get("api", Api.COMPLETIONS)))


def dispatcher(
    upstream: MockUpstream, tracker: InstanceTracker, **settings: object
) -> tuple[Dispatcher, GatewayMetrics]:
    metrics = GatewayMetrics(tracker.totals, lambda: 0)
    gs = GatewaySettings(backoff_initial_s=0.005, backoff_max_s=0.02, **settings)  # type: ignore[arg-type]
    d = build_dispatcher(
        gs,
        tracker=tracker,
        upstream=upstream,
        metrics=metrics,
        prefill_policy=load_policy("least_sse"),
        decode_policy=load_policy("least_loaded"),
        backoff=ConstantBackoff(0.01),
    )
    return d, metrics


class Sink:
    """An ASGI `send` that keeps what was sent."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []

    async def __call__(self, message: Any) -> None:
        self.messages.append(message)

    @property
    def status(self) -> int:
        return int(self.messages[0]["status"])

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages[1:])

    def events(self) -> list[Any]:
        """A stream's events, parsed (``[DONE]`` as the string)."""
        out: list[Any] = []
        for line in self.body.decode().split("\n\n"):
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                out.append(data if data == "[DONE]" else orjson.loads(data))
        return out


async def relay(
    d: Dispatcher,
    metrics: GatewayMetrics,
    body: dict[str, Any] | None = None,
    *,
    api: Api = Api.COMPLETIONS,
    deadline_s: float = 2.0,
    sink: Sink | None = None,
    **options: Any,
) -> tuple[str, Relay, Sink]:
    """One request through `Relay` (placement, legs, relay) as the endpoint runs it; the
    outcome, the relay and what the client was sent. Nothing is left open."""
    raw = body or {"model": "m", "prompt": "p", "max_tokens": 4, "stream": True}
    req, forward = parse_api(api, orjson.dumps(raw), max_tokens_limit=1 << 16)
    sink = sink or Sink()
    now = time.monotonic()
    prompt = req.prompt_key
    request = RelayRequest(
        RequestInfo(model="m", group=None, prompt=prompt, prompt_chars=len(prompt),
                    max_tokens=req.max_tokens or 16),
        req, forward, api, "req-1", now + deadline_s, now,
    )  # fmt: skip
    r = Relay(d, sink, request, RelayOptions(**options), metrics)
    try:
        outcome = await r.run()
    finally:
        if r.first is not None:
            r.first.close()
    return outcome, r, sink


async def eventually(check: Callable[[], bool], timeout_s: float = 2.0) -> None:
    """Wait until `check()` holds (clean-up runs in background tasks)."""
    end = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > end:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.005)


Handler = Callable[[Call], Awaitable[Reply]]
