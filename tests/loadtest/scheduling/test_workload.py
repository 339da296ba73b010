"""The scenario workload: deterministic, shared prefixes, exact token counts."""

from __future__ import annotations

from collections import Counter

import pytest

from pdgate.config import sim_tokenizer as tokenizer
from pdgate.engine_shim.prefix_cache import BLOCK_SIZE, block_hashes
from pdgate.loadtest.scheduling.workload import (
    SCENARIOS,
    WORKLOADS,
    Prompt,
    Scenario,
    Tenant,
    Workload,
    workload_named,
)


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


def _sample(name: str, n: int = 400) -> list[Prompt]:
    spec = WORKLOADS[name]
    workload = Workload(spec.scenarios, seed=9, tenants=spec.tenants)
    rng = workload.user_rng(0)
    return [workload.next_prompt(rng) for _ in range(n)]


def test_shared_prefix_is_most_of_each_prompt_and_outgrows_one_cache() -> None:
    prompts = _sample("shared-prefix")
    share = sum(p.scenario.prefix_tokens for p in prompts) / sum(p.tokens for p in prompts)
    assert share > 0.85
    prefixes = {s.name: s.prefix_tokens for s in WORKLOADS["shared-prefix"].scenarios}
    # More prefix blocks than one prefill's cache (192 blocks, ClusterSpec) holds, fewer
    # than eight prefills hold together: where a request goes decides its hit.
    blocks = sum(prefixes.values()) // BLOCK_SIZE
    assert 192 < blocks <= 8 * 192
    assert len({p.scenario.name for p in prompts}) == len(prefixes)


def test_no_prefix_shares_no_block_and_keeps_the_mix_lengths() -> None:
    prompts = _sample("no-prefix", 60)
    first_blocks = [block_hashes(tokenizer.encode(p.text))[0] for p in prompts]
    assert len(set(first_blocks)) == len(first_blocks)  # not even the first block
    mix = {s.name: s for s in SCENARIOS}
    for s in WORKLOADS["no-prefix"].scenarios:
        m = mix[s.name]
        assert s.prefix_tokens == 0 and s.ttft_deadline_s == m.ttft_deadline_s
        assert (s.body_min, s.body_max) == (
            m.prefix_tokens + m.body_min,
            m.prefix_tokens + m.body_max,
        )


def test_mixed_lengths_long_prompts_carry_most_tokens() -> None:
    prompts = _sample("mixed-lengths", 2000)
    long = [p for p in prompts if p.scenario.name == "long"]
    assert len(long) / len(prompts) == pytest.approx(0.1, abs=0.03)
    assert sum(p.tokens for p in long) / sum(p.tokens for p in prompts) > 0.5
    assert all(p.scenario.prefix_tokens == 0 for p in prompts)


def test_tenants_heavy_at_three_times_a_light_share() -> None:
    spec = WORKLOADS["tenants"]
    workload = Workload(spec.scenarios, seed=1, tenants=spec.tenants)
    # Closed loop: users by smooth weighted round robin, 3:1:1:1 in every 6 users.
    users = Counter(t.name for i in range(60) if (t := workload.tenant_for(i)) is not None)
    assert users == {"heavy": 30, "light-a": 10, "light-b": 10, "light-c": 10}
    # Open loop: drawn per request by weight; a given tenant is kept.
    drawn = Counter(p.tenant.name for p in _sample("tenants", 3000) if p.tenant is not None)
    assert drawn["heavy"] / 3000 == pytest.approx(0.5, abs=0.04)
    rng = workload.user_rng(0)
    assert workload.next_prompt(rng, spec.tenants[2]).tenant == spec.tenants[2]
    assert Workload(seed=1).tenant_for(0) is None
    assert all(p.tenant is None for p in _sample("mix", 20))
    with pytest.raises(ValueError, match="tenant"):
        Tenant("x", priority="urgent")
    with pytest.raises(ValueError, match="unknown workload"):
        workload_named("nope")
