"""A decode that takes plain requests (no kv_transfer_params) and prefills them itself.

Against real shims on real sockets: the decode streams a plain request with the same greedy
text the disaggregated path gives, holds a slot for it (429 when full, freed when the client
leaves), reuses its prefix cache, and declares the capability in its registry record only
when it has it. The sim engine's model of the trade-off (chunked prefill inside the decode
steps, slowing the running batch) is checked step by step with a recording profile.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import orjson
import pytest

from pdgate.config import Role
from pdgate.config import sim_tokenizer as tokenizer
from pdgate.config.wire import CHAT_PATH, EXT_LOCAL_PREFILL
from pdgate.engine_shim.backend import DecodeJob, LocalPrefill
from pdgate.engine_shim.prefix_cache import BLOCK_SIZE
from pdgate.engine_shim.sim_engine import SimDecodeEngine
from pdgate.engine_shim.sim_profile import SimProfile, get_profile
from pdgate.registry.memory import MemoryRegistry
from tests.engine_shim.conftest import (
    MODEL,
    Shim,
    StartShim,
    assert_openai_error,
    prefill_leg,
    wait_load,
)

PROMPT = "Explain why a decode might prefill a short prompt itself. " * 3


def _plain(prompt: str = PROMPT, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 12, **extra}


async def _text(decode: Shim, body: dict[str, Any]) -> str:
    events = await decode.stream(body)
    assert events[-1] == "[DONE]"
    return "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])


async def _disaggregated_text(prefill: Shim, decode: Shim, prompt: str = PROMPT) -> str:
    reply = await prefill.prefilled(prompt)
    return await _text(decode, _plain(prompt, kv_transfer_params=reply["kv_transfer_params"]))


@pytest.fixture
async def pair(start_shim: StartShim) -> tuple[Shim, Shim]:
    return await start_shim(Role.PREFILL, capacity=2), await start_shim(Role.DECODE, capacity=2)


async def test_plain_request_streams_the_disaggregated_greedy_text(
    pair: tuple[Shim, Shim],
) -> None:
    prefill, decode = pair
    local = await _text(decode, _plain())
    assert (await prefill.load())["admitted"] == 0  # the prefill never saw it
    assert local == await _disaggregated_text(prefill, decode)
    load = await wait_load(decode, "used", 0)
    assert load["local_prefills"] == 1
    assert load["completed"] == 2

    # Non-streaming, with usage: the same text, the prompt counted as the decode tokenized it.
    status, whole, _ = await decode.post(_plain())
    assert status == 200, whole
    assert whole["choices"][0]["text"] == local
    assert whole["usage"]["prompt_tokens"] == tokenizer.count(PROMPT)
    assert whole["usage"]["completion_tokens"] == 12

    # An empty kv_transfer_params (what vLLM's own proxies send without a prefill) is plain too.
    assert await _text(decode, _plain(kv_transfer_params={})) == local


async def test_plain_chat_request_matches_the_disaggregated_chat(
    pair: tuple[Shim, Shim],
) -> None:
    prefill, decode = pair
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say something short."}],
        "max_tokens": 6,
    }

    async def chat_text(body: dict[str, Any]) -> str:
        async with decode.http.post(
            decode.url + "/v1/chat/completions", data=orjson.dumps(body)
        ) as resp:
            assert resp.status == 200, await resp.text()
            return str((await resp.json())["choices"][0]["message"]["content"])

    status, reply, _ = await prefill.post(prefill_leg(chat), CHAT_PATH)
    assert status == 200, reply
    params = reply["kv_transfer_params"]
    assert await chat_text(chat) == await chat_text({**chat, "kv_transfer_params": params})


async def test_local_prefill_holds_a_slot_until_the_client_leaves(start_shim: StartShim) -> None:
    decode = await start_shim(Role.DECODE, capacity=1)
    # ~6 ms per step on the default profile: a few seconds of stream, long enough to overlap.
    async with decode.http.post(
        decode.url + "/v1/completions", data=orjson.dumps(_plain(max_tokens=2000, stream=True))
    ) as first:
        assert first.status == 200
        await first.content.readline()  # the first event: the prompt is computed
        status, body, headers = await decode.post(_plain())
        assert status == 429
        assert assert_openai_error(body)["code"] == "no_free_slot"
        assert "retry-after" in headers
        first.close()
    load = await wait_load(decode, "used", 0)  # the client left: the slot is free at once
    assert load["cancelled"] == 1
    assert load["rejected"] == 1
    assert await _text(decode, _plain()) != ""


async def test_phase_switch_waits_run_from_the_end_of_each_prefill(start_shim: StartShim) -> None:
    """A prompt prefilled elsewhere waits from its arrival (its KV pull, here 1 Gb/s) to its
    first token; one computed here waits from its first token to its second (a decode step)."""
    link = {"sim_kv_bandwidth_gbps": 1.0, "capacity": 2}
    prefill, decode = await start_shim(Role.PREFILL, **link), await start_shim(Role.DECODE, **link)
    profile = dataclasses.replace(
        get_profile(decode.settings.sim_profile), kv_bandwidth_bytes_s=1e9 / 8
    )
    tokens = tokenizer.count(PROMPT)
    await _disaggregated_text(prefill, decode)
    load = await wait_load(decode, "used", 0)
    assert load["phase_switch_waits"] == 1
    remote = load["phase_switch_wait_s"]
    assert remote >= profile.kv_transfer_s(tokens)
    await _text(decode, _plain())
    load = await wait_load(decode, "used", 0)
    assert load["phase_switch_waits"] == 2
    local = load["phase_switch_wait_s"] - remote
    assert profile.decode_step_s(1, tokens) * 0.9 <= local < remote


async def test_local_prefill_reuses_the_decodes_prefix_cache(pair: tuple[Shim, Shim]) -> None:
    prefill, decode = pair
    # The KV of a disaggregated request stays in the decode's blocks: a later plain request
    # with the same prefix computes only the rest.
    await _disaggregated_text(prefill, decode)
    load = await decode.load()
    assert load["prefix_cache_total_tokens"] == 0  # only local prefills look the cache up
    longer = PROMPT + "And one more sentence."
    await _text(decode, _plain(longer))
    load = await decode.load()
    n = tokenizer.count(PROMPT)
    assert load["prefix_cache_total_tokens"] == tokenizer.count(longer)
    assert load["prefix_cache_hit_tokens"] == n // BLOCK_SIZE * BLOCK_SIZE
    unseen = "Nothing in common with what came before, at all."
    await _text(decode, _plain(unseen))
    assert (await decode.load())["prefix_cache_hit_tokens"] == n // BLOCK_SIZE * BLOCK_SIZE


async def test_capability_is_declared_only_when_on(
    start_shim: StartShim, registry: MemoryRegistry
) -> None:
    prefill = await start_shim(Role.PREFILL)
    on = await start_shim(Role.DECODE)
    off = await start_shim(Role.DECODE, local_prefill=False)
    records = {r.url: r for r in await registry.snapshot()}
    assert EXT_LOCAL_PREFILL not in records[prefill.url].extensions
    assert EXT_LOCAL_PREFILL in records[on.url].extensions
    assert EXT_LOCAL_PREFILL not in records[off.url].extensions
    # Off: a plain request is refused as before, with nothing held.
    status, body, _ = await off.post(_plain())
    assert status == 400
    assert assert_openai_error(body)["param"] == "kv_transfer_params"
    assert (await off.load())["used"] == 0
    # On, a half handshake is still refused: only a request with no params at all is plain.
    status, body, _ = await on.post(_plain(kv_transfer_params={"do_remote_decode": True}))
    assert status == 400
    assert assert_openai_error(body)["param"] == "kv_transfer_params"


# -- the sim engine's model ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Recording(SimProfile):
    """A zero-time profile that records every step: (running sequences, prompt chunks)."""

    steps: list[tuple[int, list[tuple[int, int]]]] = dataclasses.field(default_factory=list)

    def mixed_step_s(
        self, batch_size: int, context_tokens: int, chunks: Iterable[tuple[int, int]]
    ) -> float:
        self.steps.append((batch_size, list(chunks)))
        return 0.0


async def test_sim_local_prefill_is_chunked_into_the_running_batch() -> None:
    fields = dataclasses.asdict(get_profile("null"))
    profile = _Recording(**{**fields, "step_tokens": 64})
    engine = SimDecodeEngine(profile, max_batch=4)
    assert isinstance(engine, LocalPrefill)
    await engine.start()
    try:
        short = list(range(10))
        long = list(range(1000, 1200))
        # A sequence that keeps decoding (its tokens queue up unread) while another prefills.
        running = engine.generate(DecodeJob(short, 1000, engine.local_kv(short)))
        assert (await anext(running)).token_id is not None
        steps_before = len(profile.steps)
        generated = [t async for t in engine.generate(DecodeJob(long, 2, engine.local_kv(long)))]
        chunks = [c for _, c in profile.steps[steps_before:] if c]
        assert all(len(c) == 1 for c in chunks)
        # 200 tokens in chunks of at most 64 - 1 (one token of the budget went to the running
        # sequence), each resuming where the last one stopped.
        assert [c[0] for c in chunks] == [(63, 0), (126, 63), (189, 126), (200, 189)]
        # Every step that carried a chunk also decoded the running sequence: it waited for
        # the chunk's compute (the interference the gateway trades against the prefill leg).
        assert [b for b, c in profile.steps[steps_before:] if c] == [1, 1, 1, 1]
        # The same prompt again: the decode's prefix cache holds all but its last block.
        before = len(profile.steps)
        again = [t async for t in engine.generate(DecodeJob(long, 2, engine.local_kv(long)))]
        assert [t.text for t in again] == [t.text for t in generated]
        assert [c for _, c in profile.steps[before:] if c] == [[(200, 192)]]
        await running.aclose()
    finally:
        await engine.aclose()


def test_mixed_step_costs_what_the_chunk_computes() -> None:
    p = get_profile("llama-3.1-8b-h100")
    assert p.step_tokens == 8192
    assert get_profile("llama-3.1-8b-a100").step_tokens == 2048
    batch, context = 16, 16 * 1024
    decode = p.decode_step_s(batch, context)
    assert p.mixed_step_s(batch, context, []) == decode
    # Alone, a chunk is a prefill; beside a running batch it adds only its compute (the
    # weights are read once per step).
    assert p.mixed_step_s(0, 0, [(512, 0)]) == p.prefill_batch_s([(512, 0)])
    stretch = p.mixed_step_s(batch, context, [(512, 0)]) - decode
    assert stretch == pytest.approx(p.prefill_batch_s([(512, 0)]) - p.prefill_overhead_s)
    # A cached prefix costs only its attention: the uncached part is what is paid for.
    assert p.mixed_step_s(batch, context, [(1024, 512)]) < p.mixed_step_s(
        batch, context, [(1024, 0)]
    )
