"""``sim_prefix_cache_blocks`` on a real ``pdgate shim`` process: 0 turns the sim prefill's
prefix cache off, a positive value bounds it (LRU over 16-token blocks), unset keeps the
profile's. Hits are read from the shim's ``GET /load`` (``prefix_cache_hit_tokens``)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from pdgate.config.sim_tokenizer import count
from pdgate.config.wire import kv_release_url
from tests._cluster import Subprocess, hold_prefill_slot, shim_load, start

BLOCK = 16  # tokens per prefix-cache block (engine_shim/prefix_cache.py)
SHORT = "The travel desk answers questions about bookings and seats. " * 3  # 43 tokens
LONG = "Every booking has a reference, a passenger list and a fare class. " * 15  # 256


@pytest.fixture
def shims() -> Iterator[list[Subprocess]]:
    started: list[Subprocess] = []
    yield started
    for p in started:
        p.kill()


def _prefill(procs: list[Subprocess], blocks: int | None) -> str:
    env = {} if blocks is None else {"PDGATE_SHIM_SIM_PREFIX_CACHE_BLOCKS": str(blocks)}
    shim = start(procs, ["shim", "--role", "prefill", "--host", "127.0.0.1", "--port", "0"], env)
    return shim.lines[-1].split()[-1].strip()


def _hits(url: str, prompt: str) -> int:
    """Prompt tokens the prefill served from its prefix cache for one more `prompt`."""
    before = shim_load(url)["prefix_cache_hit_tokens"]
    params = hold_prefill_slot(url, prompt)
    # Nobody pulls this KV: give the slot back at once.
    httpx.delete(kv_release_url(url, params["remote_request_id"]), timeout=5).raise_for_status()
    return int(shim_load(url)["prefix_cache_hit_tokens"]) - int(before)


def test_the_prompts_have_the_sizes_the_tests_assume() -> None:
    assert 2 * BLOCK < count(SHORT) < 3 * BLOCK and count(LONG) > 12 * BLOCK


def test_zero_blocks_turns_the_prefix_cache_off(shims: list[Subprocess]) -> None:
    url = _prefill(shims, 0)
    assert _hits(url, LONG) == 0
    assert _hits(url, LONG) == 0  # the same prompt again: still nothing cached
    assert shim_load(url)["prefix_cache_total_tokens"] > 0  # it did see the prompts


def test_a_positive_bound_limits_what_is_cached(shims: list[Subprocess]) -> None:
    default, bounded = _prefill(shims, None), _prefill(shims, 2)
    # The profile's cache keeps the whole long prompt ...
    _hits(default, LONG)
    assert _hits(default, LONG) >= 10 * BLOCK
    # ... a 2-block cache never serves more than 2 blocks of it,
    _hits(bounded, LONG)
    assert _hits(bounded, LONG) <= 2 * BLOCK
    # yet it is a cache: a prompt that fits is served from it when repeated.
    _hits(bounded, SHORT)
    assert _hits(bounded, SHORT) == 2 * BLOCK
