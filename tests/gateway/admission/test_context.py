"""The context-length 400 (gateway/admission/context.py) on its own: the cheap bound that
spares requests that surely fit any count, the exact count past it, what the 400 says. The
count through real engines is in tests/gateway/api/test_served_models.py."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
import pytest

from pdgate.config.openai_api import parse_chat, parse_completion
from pdgate.config.wire import Role
from pdgate.gateway.admission.context import ContextLimit, EngineTokenCounter, FakeTokenCounter
from pdgate.gateway.errors import ContextLengthExceeded
from pdgate.gateway.instances.tracker import InstanceTracker
from pdgate.gateway.upstream.mock import Call, MockUpstream, Reply
from pdgate.registry.base import InstanceRecord

LIMIT = 2048


def _tracker(max_model_len: int = LIMIT) -> InstanceTracker:
    tracker = InstanceTracker()
    record = InstanceRecord(
        id="a1", role=Role.AGGREGATED, url="http://a1:1", model="m", max_model_len=max_model_len
    )
    tracker.update_membership({"a1": record})
    return tracker


def _count_words(model: str, body: Mapping[str, Any]) -> int | None:
    """A fake engine: a word a token, plus three per message for its template."""
    if "messages" in body:
        return sum(len(m["content"].split()) + 3 for m in body["messages"])
    prompt = body["prompt"]
    return len(prompt.split()) if isinstance(prompt, str) else None


async def _check(limit: ContextLimit, raw: dict[str, Any]) -> None:
    body = orjson.dumps(raw)
    parse = parse_chat if "messages" in raw else parse_completion
    req, forward = parse(body, max_tokens_limit=LIMIT * 8)
    assert req.max_tokens is not None
    if limit.may_exceed("m", len(body), req, req.max_tokens):
        await limit.check("m", req, forward, req.max_tokens)


async def test_a_request_under_the_bound_is_never_counted() -> None:
    counter = FakeTokenCounter(_count_words)
    limit = ContextLimit(_tracker(), counter, template_tokens=100, message_tokens=10)
    # 1850 bytes of prompt (and the body around it) + 100 + 16 < 2048: surely fits.
    await _check(limit, {"model": "m", "prompt": "x" * 1850, "max_tokens": 16})
    messages = [{"role": "user", "content": "y" * 800}, {"role": "user", "content": "z" * 800}]
    await _check(limit, {"model": "m", "messages": messages, "max_tokens": 16})
    assert counter.calls == []


async def test_past_the_bound_the_prompt_is_counted_and_refused_naming_both_numbers() -> None:
    counter = FakeTokenCounter(_count_words)
    limit = ContextLimit(_tracker(), counter)
    # Many bytes, few tokens: counted, and it fits.
    await _check(limit, {"model": "m", "prompt": "y" * 5000, "max_tokens": 16})
    assert len(counter.calls) == 1
    with pytest.raises(ContextLengthExceeded) as exc:
        await _check(limit, {"model": "m", "prompt": "w " * 3000, "max_tokens": 16})
    err = exc.value
    assert (err.status, err.code, err.param) == (400, "context_length_exceeded", "prompt")
    assert err.message == (
        "This model's maximum context length is 2048 tokens. However, you requested 3016 "
        "tokens (3000 in the prompt, 16 in the completion). Please reduce the length of the "
        "prompt or completion."
    )
    # A prompt that fits alone, but not with the completion asked for: max_tokens is why.
    with pytest.raises(ContextLengthExceeded) as exc:
        await _check(limit, {"model": "m", "prompt": "w " * 2000, "max_tokens": 100})
    assert exc.value.param == "max_tokens"
    assert "2100 tokens (2000 in the prompt, 100 in the completion)" in exc.value.message


async def test_a_chat_is_counted_by_its_engine_with_the_fields_that_shape_it() -> None:
    counter = FakeTokenCounter(_count_words)
    limit = ContextLimit(_tracker(), counter)
    messages = [{"role": "user", "content": "v " * 2100}]
    with pytest.raises(ContextLengthExceeded) as exc:
        await _check(limit, {"model": "m", "messages": messages, "max_completion_tokens": 5})
    assert exc.value.param == "messages"
    assert "2108 tokens (2103 in the messages, 5 in the completion)" in exc.value.message
    ((model, body),) = counter.calls
    assert model == "m" and body["messages"] == messages


async def test_token_ids_are_counted_as_they_are() -> None:
    counter = FakeTokenCounter(_count_words)
    limit = ContextLimit(_tracker(), counter)
    with pytest.raises(ContextLengthExceeded, match=r"3000 in the prompt"):
        await _check(limit, {"model": "m", "prompt": [7] * 3000, "max_tokens": 16})
    await _check(limit, {"model": "m", "prompt": [7] * 1000, "max_tokens": 16})
    assert counter.calls == []


async def test_nothing_changes_when_nobody_can_count_or_the_context_is_unknown() -> None:
    silent = FakeTokenCounter(lambda model, body: None)
    await _check(ContextLimit(_tracker(), silent), {"prompt": "w " * 9000, "max_tokens": 16})
    assert len(silent.calls) == 1
    unknown = FakeTokenCounter(_count_words)
    await _check(ContextLimit(_tracker(0), unknown), {"prompt": "w " * 9000, "max_tokens": 16})
    assert unknown.calls == []


def _fleet() -> InstanceTracker:
    tracker = InstanceTracker()
    records = {
        name: InstanceRecord(
            id=name,
            role=Role.DECODE,
            url=f"http://{name}:1",
            model="m",
            adapters=("m-lora",),
            max_model_len=LIMIT,
            endpoints=("/tokenize",),
        )
        for name in ("d1", "d2", "d3")
    }
    tracker.update_membership(records)
    return tracker


async def test_the_engine_counter_asks_tokenize_and_moves_on_from_a_failing_instance() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []

    async def handler(call: Call) -> Reply:
        assert call.leg == "side" and call.path == "/tokenize" and call.body is not None
        seen.append((call.url, call.body))
        if call.url == "http://d1:1":
            return Reply(unreachable=True)
        return Reply(json={"count": 42, "max_model_len": LIMIT, "tokens": [1] * 42})

    counter = EngineTokenCounter(_fleet(), MockUpstream(handler), tries=2)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "stream": True}
    assert await counter.count("m-lora", {**chat, "add_generation_prompt": True}) == 42
    # Only what shapes the rendered prompt is sent, for the model asked (an adapter here).
    assert seen[-1][1] == {
        "model": "m-lora",
        "messages": chat["messages"],
        "add_generation_prompt": True,
    }
    assert [url for url, _ in seen] == ["http://d1:1", "http://d2:1"]  # d1 down: the next
    assert await counter.count("m", {"prompt": [5, 6, 7]}) == 3  # ids: nobody asked
    calls = len(seen)
    assert await counter.count("m", {"prompt": "text"}) == 42  # no gateway tokenizer: asked
    assert len(seen) > calls


async def test_the_engine_counter_says_none_when_nobody_can_count() -> None:
    async def refuses(call: Call) -> Reply:
        return Reply(status=400, json={"error": {"message": "bad template"}})

    async def down(call: Call) -> Reply:
        return Reply(unreachable=True)

    body = {"messages": [{"role": "user", "content": "hi"}]}
    for handler in (refuses, down):
        upstream = MockUpstream(handler)
        assert await EngineTokenCounter(_fleet(), upstream, tries=2).count("m", body) is None
        assert len(upstream.calls) == (1 if handler is refuses else 2)  # bounded failover
    assert await EngineTokenCounter(InstanceTracker(), MockUpstream(down)).count("m", body) is None
