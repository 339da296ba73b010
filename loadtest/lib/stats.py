"""Per-request outcomes and their summary: success rate, goodput, TTFT, TPOT and E2E
percentiles; and the spread of a figure over repeated runs (min / median / max over seeds).

Success is judged on the client, by one rule for every mode: the first token arrived within
the request's TTFT deadline *and* the stream completed (``[DONE]``, no in-band error), and,
where the request has a TPOT SLO, its mean time per output token after the first (TPOT =
(E2E - TTFT) / (tokens - 1)) was within it, as DistServe and EcoServe judge TPOT. A
request the gateway ended early (503 after waiting out its deadline in the gateway queue,
or a prefill call aborted at the deadline in the baseline) counts as a failure, as does one
whose first token came late: the denominator is every request issued in the window. An
open-loop client that hit its own in-flight bound records the request it could not send as
`DROPPED`: a failure too (the service could not keep up with the arrivals).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = ["DROPPED", "RequestResult", "Spread", "Summary", "percentile", "summarize"]

# The status of a request an open-loop client never sent: its in-flight bound was reached.
DROPPED = -1


@dataclass(frozen=True, slots=True)
class RequestResult:
    scenario: str
    deadline_s: float
    status: int  # HTTP status; 0 when the connection failed; DROPPED when never sent
    ttft_s: float | None  # time to the first SSE data event, None when none came
    e2e_s: float  # time to the end of the response (or of the failure)
    completed: bool  # saw [DONE] and no in-band error
    gateway: int = 0  # index of the gateway (of a fleet) the request went to
    tenant: str = ""  # the tenant it was sent for ("": the workload has no tenants)
    tpot_s: float | None = None  # None: fewer than two tokens came
    tpot_slo_s: float | None = None  # None: TPOT is not judged
    retry_after_s: float | None = None  # a refusal's Retry-After, in seconds
    # Tries the client made for it (a client that retries a refusal: more than one); the
    # rest is its last try's.
    attempts: int = 1
    issued_s: float = math.nan  # when it was issued, seconds after the window opened
    prefill: str = ""  # the prefill that served it, where the gateway says (pdgate's header)

    @property
    def ttft_met(self) -> bool:
        return (
            self.status == 200
            and self.completed
            and self.ttft_s is not None
            and self.ttft_s <= self.deadline_s
        )

    @property
    def tpot_met(self) -> bool:
        """Completed, and within its TPOT SLO (if it has one: one token has no TPOT)."""
        if self.status != 200 or not self.completed:
            return False
        return self.tpot_slo_s is None or self.tpot_s is None or self.tpot_s <= self.tpot_slo_s

    @property
    def success(self) -> bool:
        return self.ttft_met and self.tpot_met


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between closest ranks (numpy's
    default); NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError("q must be within [0, 100]")
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True)
class Summary:
    requests: int
    successes: int
    success_rate: float
    goodput_rps: float  # successful requests per second of the measurement window
    throughput_rps: float  # completed streams (late or not) per second
    offered_rps: float  # requests issued per second (sent or dropped, whatever their end)
    ttft_p50_s: float  # over requests that got a first token
    ttft_p99_s: float
    e2e_p50_s: float  # over completed requests
    e2e_p99_s: float
    status_counts: dict[int, int]
    success_by_scenario: dict[str, float]
    success_by_gateway: dict[int, float]
    success_by_tenant: dict[str, float]  # empty when no request named a tenant
    # Requests each gateway's clients issued: with closed-loop users a gateway that answers
    # failures fast gets more requests, so its success rate alone can mislead.
    requests_by_gateway: dict[int, int] = field(default_factory=dict)
    tpot_p50_s: float = math.nan  # over requests that got two tokens or more
    tpot_p99_s: float = math.nan
    # Shares of the requests issued that met each SLO on its own (success needs both).
    ttft_attainment: float = math.nan
    tpot_attainment: float = math.nan
    # Requests the client tried again after a refusal, and the share of those that
    # succeeded on their first retry (NaN: none retried).
    retried: int = 0
    first_retry_success: float = math.nan
    # Each gateway's success as its own scenario mix predicts it, at the run's success per
    # scenario: users draw their own prompts, and a gateway whose users drew more of a
    # scenario that fails more fails more. Its success less this is the gateway's own part.
    mix_by_gateway: dict[int, float] = field(default_factory=dict)
    # Each gateway's failures by where they ended: refused (no 200: the client's last try
    # was a 503 or 429, or an error) or late (a 200 whose first token missed its deadline,
    # whose stream broke, or whose TPOT missed its SLO).
    refused_by_gateway: dict[int, int] = field(default_factory=dict)
    late_by_gateway: dict[int, int] = field(default_factory=dict)

    @property
    def dropped(self) -> int:
        """Requests the client never sent (open loop, in-flight bound reached)."""
        return self.status_counts.get(DROPPED, 0)

    def headline(self) -> dict[str, float]:
        """The figures every benchmark's CSV rows carry, by column name, in column order."""
        return {
            "success_rate": self.success_rate,
            "goodput_rps": self.goodput_rps,
            "throughput_rps": self.throughput_rps,
            "ttft_p50_s": self.ttft_p50_s,
            "ttft_p99_s": self.ttft_p99_s,
            "e2e_p50_s": self.e2e_p50_s,
            "e2e_p99_s": self.e2e_p99_s,
        }


def summarize(results: Iterable[RequestResult], window_s: float) -> Summary:
    """Summary of the requests issued during a measurement window of `window_s` seconds."""
    if window_s <= 0:
        raise ValueError("window_s must be positive")
    rows = list(results)
    ok = [r for r in rows if r.success]
    ttfts = [r.ttft_s for r in rows if r.ttft_s is not None]
    tpots = [r.tpot_s for r in rows if r.tpot_s is not None]
    e2es = [r.e2e_s for r in rows if r.completed]
    retried = [r for r in rows if r.attempts > 1]
    # Served on the first retry: its second try was its last, and it succeeded.
    first_retry = sum(r.attempts == 2 and r.success for r in retried)
    statuses: dict[int, int] = {}
    per_scenario: dict[str, list[int]] = {}
    per_gateway: dict[int, list[int]] = {}
    per_tenant: dict[str, list[int]] = {}
    mix: dict[int, dict[str, int]] = {}
    refused: dict[int, int] = {}
    late: dict[int, int] = {}
    for r in rows:
        statuses[r.status] = statuses.get(r.status, 0) + 1
        drawn = mix.setdefault(r.gateway, {})
        drawn[r.scenario] = drawn.get(r.scenario, 0) + 1
        if not r.success:
            ends = late if r.status == 200 else refused
            ends[r.gateway] = ends.get(r.gateway, 0) + 1
        tallies = [
            per_scenario.setdefault(r.scenario, [0, 0]),
            per_gateway.setdefault(r.gateway, [0, 0]),
        ]
        if r.tenant:
            tallies.append(per_tenant.setdefault(r.tenant, [0, 0]))
        for tally in tallies:
            tally[0] += r.success
            tally[1] += 1
    return Summary(
        requests=len(rows),
        successes=len(ok),
        success_rate=len(ok) / len(rows) if rows else math.nan,
        goodput_rps=len(ok) / window_s,
        throughput_rps=len(e2es) / window_s,
        offered_rps=len(rows) / window_s,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        e2e_p50_s=percentile(e2es, 50),
        e2e_p99_s=percentile(e2es, 99),
        status_counts=dict(sorted(statuses.items())),
        success_by_scenario={k: s / n for k, (s, n) in sorted(per_scenario.items())},
        success_by_gateway={k: s / n for k, (s, n) in sorted(per_gateway.items())},
        success_by_tenant={k: s / n for k, (s, n) in sorted(per_tenant.items())},
        requests_by_gateway={k: n for k, (_, n) in sorted(per_gateway.items())},
        tpot_p50_s=percentile(tpots, 50),
        tpot_p99_s=percentile(tpots, 99),
        ttft_attainment=sum(r.ttft_met for r in rows) / len(rows) if rows else math.nan,
        tpot_attainment=sum(r.tpot_met for r in rows) / len(rows) if rows else math.nan,
        retried=len(retried),
        first_retry_success=first_retry / len(retried) if retried else math.nan,
        mix_by_gateway={
            g: sum(n * per_scenario[k][0] / per_scenario[k][1] for k, n in drawn.items())
            / sum(drawn.values())
            for g, drawn in sorted(mix.items())
        },
        refused_by_gateway={g: refused.get(g, 0) for g in sorted(per_gateway)},
        late_by_gateway={g: late.get(g, 0) for g in sorted(per_gateway)},
    )


@dataclass(frozen=True, slots=True)
class Spread:
    """One figure over repeated runs (seeds): a single run can be lucky or unlucky, so the
    benchmarks report the range and the middle rather than one number."""

    min: float
    median: float
    max: float
    n: int  # runs that reported the figure (NaNs, "not measured", are left out)

    @classmethod
    def of(cls, values: Iterable[float]) -> Spread:
        known = [v for v in values if not math.isnan(v)]
        if not known:
            return cls(math.nan, math.nan, math.nan, 0)
        return cls(min(known), percentile(known, 50), max(known), len(known))

    def as_dict(self) -> dict[str, float]:
        return {"min": self.min, "median": self.median, "max": self.max}
