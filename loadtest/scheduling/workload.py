"""The multi-scenario workload: each scenario has its own shared prefix, length mix and deadline.

P/D-Serve's point (sections 1 and 3.5) is that production traffic is a mix of scenarios whose
prompts share a per-scenario prefix (a system prompt, a tool description, a document set) and
differ in length: long prompts queued ahead of short ones in a prefill's local queue make the
short ones miss their (shorter) TTFT thresholds. `SCENARIOS` is such a mix.

Prompts are made of words of 1-5 lowercase letters, each preceded by a space, which the sim
tokenizer (config/sim_tokenizer.py) turns into exactly one token each, so token counts are
exact without running the tokenizer here. A prompt is ``prefix + tag + body``: the tag is a
few random words unique to the request, and since prefix-cache block hashes are chained, every
block after the tag is unique too. Bodies come from a small pre-built pool per scenario so
the load generator spends its CPU on requests, not on building text.

`WORKLOADS` names the workloads ``pdgate bench scheduling --workload`` offers: the mix
above (``mix``, the default) and variants that each bring out one effect a policy should
handle (shared prefixes that are most of the prompt, no shared prefix at all, widely mixed
lengths, long documents only, several tenants).
A workload with tenants tags each request with one (`Tenant`): the closed loop gives each
user one tenant for good (`Workload.tenant_for`), the open loop draws one per arrival by
weight; the client sends the tenant's name and priority class as headers.
"""

from __future__ import annotations

import random
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType

__all__ = [
    "APIS",
    "SCENARIOS",
    "WORKLOADS",
    "Prompt",
    "Scenario",
    "Tenant",
    "Workload",
    "WorkloadSpec",
    "vocabulary",
    "words",
    "workload_named",
]

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
    tpot_slo_s: float | None = None  # judged by the client where set (lib/stats.py)

    def __post_init__(self) -> None:
        if not 0 < self.body_min <= self.body_max or self.prefix_tokens < 0:
            raise ValueError(f"scenario {self.name}: bad lengths")
        if self.max_tokens <= 0 or self.ttft_deadline_s <= 0 or self.weight <= 0:
            raise ValueError(f"scenario {self.name}: bad max_tokens, deadline or weight")
        if self.tpot_slo_s is not None and not self.tpot_slo_s > 0:
            raise ValueError(f"scenario {self.name}: the TPOT SLO must be positive")


# Short interactive scenarios with 1-1.5 s TTFT thresholds next to a long-document scenario
# whose prefill alone takes longer than those thresholds (the paper: thresholds differ by
# scenario, and long prompts queued ahead of short ones make the short ones miss theirs).
# Prefixes together are 3,584 tokens = 224 blocks, more than the per-prefill prefix cache
# the experiment configures.
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


@dataclass(frozen=True, slots=True)
class Tenant:
    """A client of the service with its share of the requests and its priority class
    (``x-pdgate-tenant`` / ``x-pdgate-priority`` headers)."""

    name: str
    weight: int = 1  # requests relative to the other tenants'
    priority: str = "normal"  # high | normal | low

    def __post_init__(self) -> None:
        if not self.name or self.weight < 1 or self.priority not in ("high", "normal", "low"):
            raise ValueError(f"tenant {self.name!r}: bad name, weight or priority")


# The client APIs a request may go to (gateway/translate/ serves the last two as chat).
APIS = ("completions", "chat", "responses", "messages")


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    name: str
    about: str  # one line, for the report
    scenarios: tuple[Scenario, ...]
    tenants: tuple[Tenant, ...] = ()
    apis: tuple[str, ...] = ("completions",)  # each request goes to one, in turn by chance


def _no_prefix(s: Scenario) -> Scenario:
    """`s` with its prefix turned into unique body: the same lengths, nothing shared."""
    return replace(
        s, prefix_tokens=0, body_min=s.body_min + s.prefix_tokens,
        body_max=s.body_max + s.prefix_tokens,
    )  # fmt: skip


# Eight system prompts of 1,536 tokens, each ~92% of its prompt: the prefix cache of one
# prefill (192 blocks = 3,072 tokens) holds two of them, all eight prefills together hold
# every one, so where a request goes decides whether its prefill computes a short body or
# the whole prompt: the case where cache affinity can raise capacity.
_SHARED_PREFIX = tuple(
    Scenario(f"sp{i}", prefix_tokens=1536, body_min=32, body_max=160, max_tokens=64,
             ttft_deadline_s=1.0)
    for i in range(8)
)  # fmt: skip

# Short, medium and long prompts with no shared prefix: 10% of the requests (the long ones)
# carry over half of the prompt tokens, so open streams and prompt tokens rank prefills
# differently: the case that tells least_sse and least_tokens apart.
_MIXED_LENGTHS = (
    Scenario("short", prefix_tokens=0, body_min=64, body_max=256, max_tokens=64,
             ttft_deadline_s=1.0, weight=0.6),
    Scenario("medium", prefix_tokens=0, body_min=1024, body_max=2048, max_tokens=64,
             ttft_deadline_s=2.0, weight=0.3),
    Scenario("long", prefix_tokens=0, body_min=6144, body_max=8192, max_tokens=64,
             ttft_deadline_s=4.0, weight=0.1),
)  # fmt: skip

# Long documents with short answers and nothing shared (summaries, questions over a long
# context): the prompt is most of the work, where the serving strategies part most
# (docs/strategies.md).
_LONG_PROMPT = (
    Scenario("long", prefix_tokens=0, body_min=3072, body_max=8192, max_tokens=128,
             ttft_deadline_s=4.0),
)  # fmt: skip

# One heavy tenant sending 3x what each of three light ones sends (half of all requests),
# all in the same priority class: what fairness must protect.
_TENANTS = (
    Tenant("heavy", weight=3),
    Tenant("light-a"),
    Tenant("light-b"),
    Tenant("light-c"),
)

WORKLOADS: Mapping[str, WorkloadSpec] = MappingProxyType({
    w.name: w
    for w in (
        WorkloadSpec("mix", "four scenarios with their own shared prefixes, lengths and "
                     "deadlines (chat, code, agent, doc)", SCENARIOS),
        WorkloadSpec("shared-prefix", "eight 1,536-token shared prefixes, ~92% of each "
                     "prompt; two fit one prefill's cache", _SHARED_PREFIX),
        WorkloadSpec("no-prefix", "the mix's lengths and deadlines with nothing shared",
                     tuple(_no_prefix(s) for s in SCENARIOS)),
        WorkloadSpec("mixed-lengths", "short / medium / long prompts (60/30/10%), no shared "
                     "prefix", _MIXED_LENGTHS),
        WorkloadSpec("long-prompt", "3,072-8,192-token documents, 128-token answers, no "
                     "shared prefix", _LONG_PROMPT),
        WorkloadSpec("tenants", "the mix, sent for a heavy tenant (3x a light one's "
                     "requests) and three light ones", SCENARIOS, _TENANTS),
        WorkloadSpec("chat", "the mix, every request a chat completion", SCENARIOS,
                     apis=("chat",)),
        WorkloadSpec("api-mix", "the mix, each request to one of completions, chat, the "
                     "Responses API and Anthropic Messages, in equal shares", SCENARIOS,
                     apis=APIS),
    )
})  # fmt: skip


def workload_named(name: str) -> WorkloadSpec:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}") from None


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
    tenant: Tenant | None = None
    api: str = "completions"  # one of `APIS`


class Workload:
    """Deterministic prompts for a set of scenarios: the same seed gives the same prefixes,
    bodies and (with the same per-user random streams) the same request sequence."""

    def __init__(
        self,
        scenarios: Sequence[Scenario] = SCENARIOS,
        *,
        seed: int = 0,
        tenants: Sequence[Tenant] = (),
        apis: Sequence[str] = ("completions",),
    ) -> None:
        if not scenarios:
            raise ValueError("a workload needs at least one scenario")
        if not apis or set(apis) - set(APIS):
            raise ValueError(f"apis must be some of {', '.join(APIS)}")
        self.scenarios = tuple(scenarios)
        self.tenants = tuple(tenants)
        self.apis = tuple(apis)
        self.seed = seed
        self._weights = [s.weight for s in self.scenarios]
        self._pattern = _interleave(self.tenants)
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

    def tenant_for(self, slot: int) -> Tenant | None:
        """The tenant of closed-loop user `slot`: consecutive slots follow the tenants'
        weights as evenly as possible (3:1:1:1 gives H a H b c H, repeated)."""
        return self._pattern[slot % len(self._pattern)] if self._pattern else None

    def next_prompt(self, rng: random.Random, tenant: Tenant | None = None) -> Prompt:
        """A new request: a scenario by weight, its prefix, a unique tag, a body; and, if the
        workload has tenants, `tenant` or else one drawn by weight."""
        if tenant is None and self.tenants:
            tenant = rng.choices(self.tenants, [t.weight for t in self.tenants])[0]
        scenario = rng.choices(self.scenarios, self._weights)[0]
        body, body_tokens = rng.choice(self._bodies[scenario.name])
        text = self._prefix[scenario.name] + words(rng, _TAG_WORDS, self._vocab) + body
        api = self.apis[0] if len(self.apis) == 1 else rng.choice(self.apis)
        tokens = scenario.prefix_tokens + _TAG_WORDS + body_tokens
        return Prompt(scenario, text, tokens, tenant, api)

    def total_prefix_tokens(self) -> int:
        return sum(s.prefix_tokens for s in self.scenarios)


def _interleave(tenants: Sequence[Tenant]) -> list[Tenant]:
    """One period of smooth weighted round robin over `tenants` (nginx's): each tenant
    appears `weight` times, spread out rather than in runs."""
    total = sum(t.weight for t in tenants)
    credit = [0] * len(tenants)
    out: list[Tenant] = []
    for _ in range(total):
        credit = [c + t.weight for c, t in zip(credit, tenants, strict=True)]
        best = max(range(len(tenants)), key=credit.__getitem__)
        credit[best] -= total
        out.append(tenants[best])
    return out
