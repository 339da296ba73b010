"""A fake P/D cluster behind `MockUpstream` whose text is made of tokens with ids.

Its next token is a function of the whole context (prompt ids + tokens so far), as a real
model's greedy output is, and it answers ``return_token_ids`` as vLLM does (the prompt's ids
in the first event, each chunk its tokens' ids), so a stream re-submitted as prompt ids +
generated ids continues exactly. Decode calls can be scripted to fail in each of the ways a
decode fails: an error status, never reached, or a stream that breaks after k events (the
connection lost, an in-band error event, or an end without ``[DONE]``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from hashlib import blake2b
from typing import Any

import orjson

from pdgate.config import Role
from pdgate.config.openai_api import sse_event
from pdgate.config.wire import CHAT_PATH, EXT_BATCH_PREFILL, EXT_CONTINUATION, SSE_DONE
from pdgate.gateway.instances.tracker import InstanceTracker
from pdgate.gateway.observe.metrics import GatewayMetrics
from pdgate.gateway.stream.relay import Relay
from pdgate.gateway.upstream.mock import Call, MockUpstream, Reply
from pdgate.registry.base import InstanceRecord
from tests.gateway._fakes import Sink, dispatcher, eventually, relay

MODEL = "m"
# The usual request: its prompt and max_tokens.
PROMPT = "tell me a story"
N = 12


def encode(text: str) -> list[int]:
    return [ord(c) % 64 + 1 for c in text]


def next_id(context: list[int]) -> int:
    digest = blake2b(orjson.dumps(context), digest_size=4).digest()
    return int.from_bytes(digest, "little") % 500 + 100


def word(token_id: int) -> str:
    return f" w{token_id}"


def generate(prompt: list[int], n: int) -> list[int]:
    context = list(prompt)
    out = []
    for _ in range(n):
        t = next_id(context)
        out.append(t)
        context.append(t)
    return out


def chat_ids(messages: list[dict[str, Any]]) -> list[int]:
    return encode("".join(f"<{m['role']}>{m.get('content') or ''}" for m in messages))


def prompt_ids(body: dict[str, Any]) -> list[int]:
    if "messages" in body:
        return chat_ids(body["messages"])
    prompt = body["prompt"]
    return list(prompt) if isinstance(prompt, list) else encode(prompt)


def expected_text(prompt: str | list[dict[str, Any]], n: int) -> str:
    ids = chat_ids(prompt) if isinstance(prompt, list) else encode(prompt)
    return "".join(word(t) for t in generate(ids, n))


def text_of(events: list[Any], chat: bool = False) -> str:
    """The text a client got from a stream's events (``[DONE]`` included or not)."""
    return "".join(
        (c["delta"].get("content") or "") if chat else c["text"]
        for e in events
        if isinstance(e, dict)
        for c in e.get("choices") or ()
    )


@dataclass(frozen=True)
class Fault:
    """How one decode call fails: ``status`` (500), ``unreachable``, or after `after` events
    ``lost`` (connection), ``silent`` (the decode stopped answering every stream: the stall
    watchdog gave up on it), ``error`` (in-band error event) or ``truncated`` (no [DONE])."""

    kind: str
    after: int = 0


@dataclass
class TokenCluster:
    faults: list[Fault | None] = field(default_factory=list)  # per decode call, in order
    chunk_delay_s: float = 0.0
    # Set: decodes wait for it before answering (ordering tests).
    decode_gate: asyncio.Event | None = None

    async def __call__(self, call: Call) -> Reply:
        assert call.body is not None
        if call.leg == "prefill":
            return self._prefill(call)
        if self.decode_gate is not None:
            await self.decode_gate.wait()
        fault = self.faults.pop(0) if self.faults else None
        if fault is not None and fault.kind == "status":
            return Reply(status=500, json={"error": {"message": "decode failed"}})
        if fault is not None and fault.kind == "unreachable":
            return Reply(unreachable=True)
        chunks = self._decode(call)
        if fault is None:
            return Reply(chunks=chunks, chunk_delay_s=self.chunk_delay_s)
        head = chunks[: fault.after]
        if fault.kind in ("lost", "silent"):
            return Reply(
                chunks=head,
                fail_after=fault.after,
                chunk_delay_s=self.chunk_delay_s,
                silent=fault.kind == "silent",
            )
        if fault.kind == "error":
            error = {"error": {"message": "KV transfer failed", "type": "upstream_error"}}
            return Reply(chunks=[*head, sse_event(error), SSE_DONE])
        return Reply(chunks=head, chunk_delay_s=self.chunk_delay_s)  # truncated

    def _prefill(self, call: Call) -> Reply:
        body = call.body
        assert body is not None
        ids = prompt_ids(body)
        first = next_id(ids)
        wants = bool(body.get("return_token_ids"))
        params = {
            "do_remote_prefill": True,
            "remote_host": call.url.split("//")[1],
            "remote_port": 80,
            "remote_request_id": call.kv_id or "kv",
        }
        reply: dict[str, Any] = {"id": "prefill-own-id", "created": 7, "model": MODEL}
        if call.path == CHAT_PATH:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": word(first)},
                "finish_reason": "length",
            }
            reply["object"] = "chat.completion"
            if wants:
                reply["prompt_token_ids"] = ids
        else:
            choice = {"index": 0, "text": word(first), "finish_reason": "length"}
            reply["object"] = "text_completion"
            if wants:
                choice["prompt_token_ids"] = ids
        if wants:
            choice["token_ids"] = [first]
        return Reply(json={**reply, "choices": [choice], "kv_transfer_params": params})

    def _decode(self, call: Call) -> list[bytes]:
        body = call.body
        assert body is not None
        ids = prompt_ids(body)
        n = int(body["max_tokens"])
        wants = bool(body.get("return_token_ids"))
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        chat = call.path == CHAT_PATH
        head = {"id": "decode-own-id", "created": 9, "model": MODEL}
        head["object"] = "chat.completion.chunk" if chat else "text_completion"
        out = []
        if chat:
            role: dict[str, Any] = {
                **head,
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
            }
            if wants:
                role["prompt_token_ids"] = ids
            out.append(sse_event(role))
        text = ""
        generated = generate(ids, n)
        for i, t in enumerate(generated):
            piece = word(t)
            finish = "length" if i == n - 1 else None
            # No hold-back: a stop string is only found once its last character arrived.
            joined = text + piece
            hit = min((at for s in stops if (at := joined.find(s)) >= 0), default=-1)
            if hit >= 0:
                piece, finish = joined[:hit][len(text) :], "stop"
            text += piece
            # vLLM's fields in vLLM's order (0.32: every field it sets is written).
            choice: dict[str, Any] = {"index": 0}
            if chat:
                choice["delta"] = {"content": piece}
            else:
                choice["text"] = piece
            choice.update(logprobs=None, finish_reason=finish)
            if not chat:
                choice.update(stop_reason=None, prompt_token_ids=ids if wants and i == 0 else None)
            if wants:
                choice["token_ids"] = [t]
            out.append(sse_event({**head, "choices": [choice]}))
            if finish == "stop":
                generated = generated[: i + 1]
                break
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": len(ids), "completion_tokens": len(generated)}
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            out.append(sse_event({**head, "choices": [], "usage": usage}))
        out.append(SSE_DONE)
        return out


def token_tracker(
    prefills: int = 1, decodes: int = 2, *, decode_extensions: tuple[str, ...] = (EXT_CONTINUATION,)
) -> InstanceTracker:
    """Prefills p0.. (pdgate shims) and decodes d0.. declaring `decode_extensions`."""
    records = {}
    for role, count, tag, ext in (
        (Role.PREFILL, prefills, "p", (EXT_BATCH_PREFILL,)),
        (Role.DECODE, decodes, "d", decode_extensions),
    ):
        for i in range(count):
            rid = f"{tag}{i}"
            records[rid] = InstanceRecord(
                id=rid, role=role, url=f"http://{rid}", model=MODEL, capacity=4, extensions=ext
            )
    tracker = InstanceTracker(reject_hold_s=0.05)
    tracker.update_membership(records)
    return tracker


def stream_body(prompt: str = PROMPT, max_tokens: int = N, **extra: Any) -> dict[str, Any]:
    """A streaming completions request (by default the tests' usual one)."""
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True, **extra}


@dataclass
class Relayed:
    outcome: str
    relay: Relay
    sink: Sink  # what the client was sent
    upstream: MockUpstream  # its calls
    metrics: GatewayMetrics


async def relay_tokens(
    cluster: TokenCluster,
    body: dict[str, Any] | None = None,
    *,
    decode_extensions: tuple[str, ...] | None = None,
    sink: Sink | None = None,
    **options: Any,
) -> Relayed:
    """One request (by default `stream_body()`) through a dispatcher and the relay, against
    `cluster` behind a `MockUpstream` (decodes declaring `decode_extensions`, by default
    continuations), once every count it took on the instances is back."""
    upstream = MockUpstream(cluster)
    extensions = {} if decode_extensions is None else {"decode_extensions": decode_extensions}
    tracker = token_tracker(**extensions)
    d, metrics = dispatcher(upstream, tracker)
    try:
        outcome, r, sink = await relay(d, metrics, body or stream_body(), sink=sink, **options)
        await eventually(lambda: tracker.totals() == (0, 0))
    finally:
        await d.close()
    return Relayed(outcome, r, sink, upstream, metrics)
