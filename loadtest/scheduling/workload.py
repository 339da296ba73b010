"""The multi-scenario workload: each scenario has its own shared prefix, length mix and deadline.

P/D-Serve's point (sections 1 and 3.5) is that production traffic is a mix of scenarios whose
prompts share a per-scenario prefix (a system prompt, a tool description, a document set) and
differ in length: long prompts queued ahead of short ones in a prefill's local queue make the
short ones miss their (shorter) TTFT thresholds. `SCENARIOS` is such a mix.

Prompts are made of words of 1-5 lowercase letters, each preceded by a space, which the sim
tokenizer (engine_shim/tokenizer.py) turns into exactly one token each, so token counts are
exact without running the tokenizer here. A prompt is ``prefix + tag + body``: the tag is a
few random words unique to the request, and since prefix-cache block hashes are chained, every
block after the tag is unique too. Bodies come from a small pre-built pool per scenario so
the load generator spends its CPU on requests, not on building text.
"""

from __future__ import annotations

import random
import string
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["SCENARIOS", "Prompt", "Scenario", "Workload", "vocabulary", "words"]

_LETTERS = string.ascii_lowercase
_TAG_WORDS = 6  # 4096**6 = 2**72 combinations: unique per request for any run we do
_BODY_POOL = 32  # bodies per scenario


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    prefix_tokens: int  # shared by every request of the scenario
    body_min: int  # unique part of the prompt, tokens, uniform in [body_min, body_max]
    body_max: int
    max_tokens: int
    ttft_deadline_s: float  # the scenario's TTFT threshold (the paper: differs by scenario)
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.body_min <= self.body_max or self.prefix_tokens < 0:
            raise ValueError(f"scenario {self.name}: bad lengths")
        if self.max_tokens <= 0 or self.ttft_deadline_s <= 0 or self.weight <= 0:
            raise ValueError(f"scenario {self.name}: bad max_tokens, deadline or weight")


# Short interactive scenarios with 1-1.5 s TTFT thresholds next to a long-document scenario
# whose prefill alone takes 1-2 s (the paper: thresholds differ by scenario, and long prompts
# queued ahead of short ones make the short ones miss theirs). Prefixes together are 3,584
# tokens = 224 blocks, more than the per-prefill prefix cache the experiment configures.
SCENARIOS: tuple[Scenario, ...] = (
    Scenario("chat", prefix_tokens=512, body_min=32, body_max=128, max_tokens=128,
             ttft_deadline_s=1.0, weight=0.3),
    Scenario("code", prefix_tokens=1024, body_min=128, body_max=512, max_tokens=128,
             ttft_deadline_s=1.5, weight=0.25),
    Scenario("agent", prefix_tokens=1536, body_min=64, body_max=256, max_tokens=64,
             ttft_deadline_s=1.5, weight=0.25),
    Scenario("doc", prefix_tokens=512, body_min=4096, body_max=8192, max_tokens=64,
             ttft_deadline_s=4.0, weight=0.2),
)  # fmt: skip


def vocabulary(rng: random.Random, size: int = 4096) -> list[str]:
    """Space-led words of 1-5 letters: each is exactly one token of the sim tokenizer."""
    return [" " + "".join(rng.choices(_LETTERS, k=rng.randint(1, 5))) for _ in range(size)]


def words(rng: random.Random, n: int, vocab: Sequence[str]) -> str:
    """`n` tokens of text drawn from `vocab`."""
    return "".join(rng.choices(vocab, k=n))


@dataclass(frozen=True, slots=True)
class Prompt:
    scenario: Scenario
    text: str
    tokens: int


class Workload:
    """Deterministic prompts for a set of scenarios: the same seed gives the same prefixes,
    bodies and (with the same per-user random streams) the same request sequence."""

    def __init__(self, scenarios: Sequence[Scenario] = SCENARIOS, *, seed: int = 0) -> None:
        if not scenarios:
            raise ValueError("a workload needs at least one scenario")
        self.scenarios = tuple(scenarios)
        self.seed = seed
        self._weights = [s.weight for s in self.scenarios]
        self._vocab = vocabulary(random.Random(f"{seed}/vocabulary"))
        self._prefix: dict[str, str] = {}
        self._bodies: dict[str, list[tuple[str, int]]] = {}
        for s in self.scenarios:
            rng = random.Random(f"{seed}/{s.name}")
            self._prefix[s.name] = words(rng, s.prefix_tokens, self._vocab)
            lengths = [rng.randint(s.body_min, s.body_max) for _ in range(_BODY_POOL)]
            self._bodies[s.name] = [(words(rng, n, self._vocab), n) for n in lengths]

    def prefix(self, scenario: Scenario) -> str:
        return self._prefix[scenario.name]

    def user_rng(self, user: int) -> random.Random:
        """The random stream of one simulated user (independent of the others)."""
        return random.Random(f"{self.seed}/user/{user}")

    def next_prompt(self, rng: random.Random) -> Prompt:
        """A new request: a scenario by weight, its prefix, a unique tag, a body."""
        scenario = rng.choices(self.scenarios, self._weights)[0]
        body, body_tokens = rng.choice(self._bodies[scenario.name])
        text = self._prefix[scenario.name] + words(rng, _TAG_WORDS, self._vocab) + body
        return Prompt(scenario, text, scenario.prefix_tokens + _TAG_WORDS + body_tokens)

    def total_prefix_tokens(self) -> int:
        return sum(s.prefix_tokens for s in self.scenarios)
