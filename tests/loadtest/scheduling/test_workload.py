"""The scenario workload: deterministic, shared prefixes, exact token counts."""

from __future__ import annotations

from collections import Counter

import pytest

from pdgate.engine_shim import tokenizer
from pdgate.engine_shim.prefix_cache import BLOCK_SIZE, block_hashes
from pdgate.loadtest.scheduling.workload import SCENARIOS, Scenario, Workload


def _prompts(workload: Workload, user: int, n: int) -> list[str]:
    rng = workload.user_rng(user)
    return [workload.next_prompt(rng).text for _ in range(n)]


def test_same_seed_same_requests_other_seed_other_requests() -> None:
    a, b, c = Workload(seed=7), Workload(seed=7), Workload(seed=8)
    assert _prompts(a, 3, 20) == _prompts(b, 3, 20)
    assert _prompts(a, 3, 20) != _prompts(a, 4, 20)  # users are independent streams
    assert _prompts(a, 3, 20) != _prompts(c, 3, 20)
    assert all(a.prefix(s) == b.prefix(s) != c.prefix(s) for s in SCENARIOS)


def test_token_counts_are_exact() -> None:
    workload = Workload(seed=1)
    rng = workload.user_rng(0)
    for _ in range(40):
        prompt = workload.next_prompt(rng)
        assert tokenizer.count(prompt.text) == prompt.tokens
        s = prompt.scenario
        assert s.prefix_tokens + s.body_min <= prompt.tokens <= s.prefix_tokens + s.body_max + 6


def test_a_scenario_shares_its_prefix_blocks_and_nothing_after() -> None:
    workload = Workload(seed=2)
    rng = workload.user_rng(0)
    by_scenario: dict[str, list[list[int]]] = {}
    while min((len(v) for v in by_scenario.values()), default=0) < 2 or len(by_scenario) < len(
        SCENARIOS
    ):
        prompt = workload.next_prompt(rng)
        assert prompt.text.startswith(workload.prefix(prompt.scenario))
        by_scenario.setdefault(prompt.scenario.name, []).append(
            block_hashes(tokenizer.encode(prompt.text))
        )
    for s in SCENARIOS:
        first, second = by_scenario[s.name][:2]
        shared = s.prefix_tokens // BLOCK_SIZE
        assert first[:shared] == second[:shared]
        # The per-request tag right after the prefix makes every later block unique.
        assert not set(first[shared + 1 :]) & set(second[shared + 1 :])
    prefixes = {tuple(v[0][:4]) for v in by_scenario.values()}
    assert len(prefixes) == len(SCENARIOS)  # scenarios do not share prefixes


def test_scenario_weights() -> None:
    scenarios = (
        Scenario("a", 16, 1, 2, max_tokens=1, ttft_deadline_s=1.0, weight=3.0),
        Scenario("b", 16, 1, 2, max_tokens=1, ttft_deadline_s=1.0, weight=1.0),
    )
    workload = Workload(scenarios, seed=0)
    rng = workload.user_rng(0)
    counts = Counter(workload.next_prompt(rng).scenario.name for _ in range(4000))
    assert counts["a"] / 4000 == pytest.approx(0.75, abs=0.03)


def test_bad_scenarios_are_refused() -> None:
    with pytest.raises(ValueError, match="lengths"):
        Scenario("x", 16, 10, 5, max_tokens=1, ttft_deadline_s=1.0)
    with pytest.raises(ValueError, match="deadline"):
        Scenario("x", 16, 1, 5, max_tokens=1, ttft_deadline_s=0)
    with pytest.raises(ValueError, match="scenario"):
        Workload(())
