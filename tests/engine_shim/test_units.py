"""Tokenizer, prefix cache, stop sequences, timing profiles, slots and the sim engines."""

from __future__ import annotations

import asyncio
import math

import pytest

from pdgate.config import sim_tokenizer as tokenizer
from pdgate.engine_shim._slots import PoolFull, SlotPool
from pdgate.engine_shim._stop import StopMatcher
from pdgate.engine_shim.backend import DecodeBackend, DecodeJob, PrefillBackend
from pdgate.engine_shim.prefix_cache import BLOCK_SIZE, PrefixCache, block_hashes
from pdgate.engine_shim.sim_engine import SimDecodeEngine, SimPrefillEngine
from pdgate.engine_shim.sim_profile import PROFILES, get_profile

ENGLISH = (
    "The gateway ranks prefill candidates by the number of open streaming connections and by "
    "prefix cache affinity, then tries them one after another. When a prefill accepts, the "
    "gateway keeps forwarding queued requests to it until it rejects, so prefills run full batches."
)


# -- tokenizer ----------------------------------------------------------------------------------


def test_tokenizer_pieces_cover_the_text_exactly() -> None:
    for text in (ENGLISH, "a  b\n\n\tc", "x_y=1234567; ünïcödé 東京", " "):
        assert "".join(tokenizer.pieces(text)) == text


def test_tokenizer_is_deterministic_and_in_vocab() -> None:
    ids = tokenizer.encode(ENGLISH)
    assert ids == tokenizer.encode(ENGLISH)
    assert all(0 <= t < tokenizer.VOCAB_SIZE for t in ids)
    assert tokenizer.count(ENGLISH) == len(ids)
    assert tokenizer.encode("hello world") != tokenizer.encode("hello there")
    # The same piece always maps to the same id.
    assert tokenizer.encode("the the")[0] != tokenizer.encode("the the")[1]  # "the" vs " the"
    assert tokenizer.encode("the the")[1] == tokenizer.encode("cat the")[1]


def test_tokenizer_about_four_characters_per_token_on_english() -> None:
    assert 3.0 <= len(ENGLISH) / tokenizer.count(ENGLISH) <= 5.0
    assert tokenizer.pieces("12345") == ["123", "45"]


# -- prefix cache -------------------------------------------------------------------------------


def test_prefix_cache_hits_full_blocks_of_a_shared_prefix() -> None:
    cache = PrefixCache(capacity_blocks=100)
    prompt = list(range(50))  # 3 full blocks + 2 tokens
    assert cache.lookup_and_insert(prompt) == 0
    assert cache.lookup_and_insert(prompt) == 3 * BLOCK_SIZE
    # Same first block, different second block: only the first block hits.
    other = list(range(16)) + [999] * 20
    assert cache.lookup_and_insert(other) == BLOCK_SIZE
    assert cache.hit_tokens == 4 * BLOCK_SIZE
    assert cache.query_tokens == 50 + 50 + 36


def test_prefix_cache_always_recomputes_the_last_token() -> None:
    cache = PrefixCache(capacity_blocks=10)
    prompt = list(range(32))  # exactly two blocks
    cache.lookup_and_insert(prompt)
    assert cache.lookup_and_insert(prompt) == 31


def test_prefix_cache_chains_hashes() -> None:
    a = block_hashes(list(range(32)))
    b = block_hashes([100, *range(1, 32)])
    assert len(a) == 2
    assert a[0] != b[0]
    assert a[1] != b[1]
    assert block_hashes(list(range(15))) == []


def test_prefix_cache_is_bounded_and_evicts_least_recently_used() -> None:
    cache = PrefixCache(capacity_blocks=4)
    old = list(range(1000, 1032))  # 2 blocks
    cache.lookup_and_insert(old)
    for i in range(5):
        cache.lookup_and_insert([i] * 32)
        assert len(cache) <= 4
    assert cache.lookup_and_insert(old) == 0  # evicted
    recent = [4] * 32
    assert cache.lookup_and_insert(recent) > 0


# -- stop sequences -----------------------------------------------------------------------------


def test_stop_matcher_holds_back_a_possible_match_across_pieces() -> None:
    m = StopMatcher(["END"])
    assert m.feed("abc E") == ("abc ", False)
    assert m.feed("N") == ("", False)
    assert m.feed("Dxyz") == ("", True)


def test_stop_matcher_releases_a_false_alarm_and_flushes() -> None:
    m = StopMatcher(["END", "\n\n"])
    assert m.feed("x E") == ("x ", False)
    assert m.feed("Nx") == ("ENx", False)
    assert m.feed("y\n") == ("y", False)
    assert m.flush() == "\n"


def test_stop_matcher_earliest_match_wins() -> None:
    m = StopMatcher(["b", "a"])
    assert m.feed("xxab") == ("xx", True)
    assert StopMatcher([]).feed("anything") == ("anything", False)


# -- timing profiles ----------------------------------------------------------------------------


def test_h100_profile_is_monotone_and_plausible() -> None:
    p = get_profile("llama-3.1-8b-h100")
    assert p.kv_bytes_per_token == 32 * 8 * 128 * 2 * 2 == 131072
    times = [p.prefill_batch_s([(n, 0)]) for n in (1, 16, 256, 1024, 4096, 16384)]
    assert times == sorted(times)
    assert len(set(times)) == len(times)
    batches = [p.prefill_batch_s([(512, 0)] * b) for b in (1, 2, 4, 8, 16)]
    assert batches == sorted(batches)
    assert len(set(batches)) == len(batches)
    assert p.prefill_batch_s([(1024, 512)]) < p.prefill_batch_s([(1024, 0)])
    steps = [p.decode_step_s(b, b * 1024) for b in (1, 2, 8, 32, 128)]
    assert steps == sorted(steps)
    assert len(set(steps)) == len(steps)
    assert p.decode_step_s(8, 1000) < p.decode_step_s(8, 100_000)
    # Calibration sanity: ~10-20k prompt tokens/s, single-stream ITL ~5-10 ms.
    assert 10_000 <= 4096 / p.prefill_batch_s([(4096, 0)]) <= 20_000
    assert 0.005 <= p.decode_step_s(1, 512) <= 0.010
    assert p.decode_step_s(64, 64 * 1024) < 3 * p.decode_step_s(1, 1024)
    assert 0 < p.kv_transfer_s(1000) < 0.05
    assert p.kv_wire_bytes(1000, 1 / 64) == 1000 * 2048
    assert p.kv_wire_bytes(10, 1e-9) == 10  # at least one byte per token


def test_null_profile_takes_no_time_and_profiles_are_named() -> None:
    p = get_profile("null")
    assert p.prefill_batch_s([(4096, 0)] * 8) == 0
    assert p.decode_step_s(64, 10**6) == 0
    assert p.kv_transfer_s(10**6) == 0
    assert p.kv_bandwidth_bytes_s == math.inf
    assert {"llama-3.1-8b-h100", "llama-3.1-8b-a100", "null"} <= set(PROFILES)
    with pytest.raises(ValueError, match="known profiles"):
        get_profile("gpt-5-on-a-toaster")


# -- slots --------------------------------------------------------------------------------------


async def test_slot_pool_serves_waiters_fifo_and_release_is_idempotent() -> None:
    pool = SlotPool(1, queue_limit=2)
    first = pool.try_acquire()
    assert first is not None
    assert pool.try_acquire() is None
    order: list[int] = []

    async def wait(i: int) -> None:
        slot = await pool.acquire()
        order.append(i)
        slot.release()

    tasks = [asyncio.create_task(wait(i)) for i in range(2)]
    await asyncio.sleep(0)
    assert pool.queued == 2
    with pytest.raises(PoolFull):
        await pool.acquire()
    first.release()
    first.release()
    await asyncio.gather(*tasks)
    assert order == [0, 1]
    assert pool.used == 0
    assert pool.queued == 0


async def test_slot_pool_cancelled_waiter_takes_nothing() -> None:
    pool = SlotPool(1, queue_limit=1)
    held = pool.try_acquire()
    assert held is not None
    waiter = asyncio.create_task(pool.acquire())
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert pool.queued == 0
    held.release()
    assert pool.used == 0


# -- sim engines --------------------------------------------------------------------------------


async def test_a_prefill_withdrawn_as_the_engine_wakes_for_it_ends() -> None:
    """The caller leaves in the loop turn that woke the engine for its prompt, and the
    engine runs first: it skipped the withdrawn prompt without saying it had left, so the
    call waited for ever (and the shim's slot, freed when it ends, with it)."""
    prefill = SimPrefillEngine(get_profile("llama-3.1-8b-h100"), max_batch=4, kv_wire_fraction=1)
    await prefill.start()
    try:
        await asyncio.sleep(0.01)  # the engine idles, waiting for work
        call = asyncio.ensure_future(prefill.prefill(list(range(100))))
        await asyncio.sleep(0)  # the call queues its prompt and wakes the engine
        call.cancel()  # in the same turn: the engine runs before the call's clean-up
        done, _ = await asyncio.wait([call], timeout=5)
        assert done == {call} and call.cancelled()
        assert (prefill.stats().running, prefill.stats().waiting) == (0, 0)
    finally:
        await prefill.aclose()


async def test_sim_prefill_batches_concurrent_prompts_and_matches_decode_token_0() -> None:
    profile = get_profile("llama-3.1-8b-h100")
    prefill = SimPrefillEngine(profile, max_batch=4, kv_wire_fraction=1 / 64)
    decode = SimDecodeEngine(profile, max_batch=4)
    assert isinstance(prefill, PrefillBackend)
    assert isinstance(decode, DecodeBackend)
    await prefill.start()
    await decode.start()
    try:
        prompts = [prefill.tokenize(f"prompt number {i} " * 50) for i in range(4)]
        calls = [asyncio.ensure_future(prefill.prefill(p)) for p in prompts]
        for _ in range(100):  # until the engine loop has taken the prompts
            await asyncio.sleep(0)
            if prefill.stats().running:
                break
        # One batch of four, not four prefills one after another.
        assert (prefill.stats().running, prefill.stats().waiting) == (4, 0)
        outs = await asyncio.gather(*calls)
        for p, out in zip(prompts, outs, strict=True):
            assert out.prompt_tokens == len(p)
            assert out.kv.tokens == len(p)
            assert out.kv.nbytes == profile.kv_wire_bytes(len(p), 1 / 64)
            body = b"".join([c async for c in out.kv.chunks(1000)])
            assert len(body) == out.kv.nbytes
            sink = decode.kv_sink(p, out.kv.nbytes)
            sink.write(body)
            await sink.commit()
            pieces = [t async for t in decode.generate(DecodeJob(p, 3, sink))]
            assert len(pieces) == 3
            assert pieces[0].text == out.first_token
            assert all(t.logprobs is None for t in pieces)  # not asked for
        again = await prefill.prefill(prompts[0])
        assert again.cached_tokens > 0
        assert prefill.stats().prefix_hit_tokens == again.cached_tokens
    finally:
        await prefill.aclose()
        await decode.aclose()
