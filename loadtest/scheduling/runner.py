"""One measured point: a number of closed-loop users, or an open loop's arrival rate,
against a running cluster.

warm-up (discarded) -> snapshot -> measurement window -> snapshot -> drain (every request
issued in the window is followed to its end). The point carries the client-side summary,
the server-side counter deltas and how busy the cluster and the client were, so a CPU-bound
run can be told from a scheduler effect; and the prefills' KV holds over the whole point
(warm-up to drain): the longest hold so far, the holds over 5 s, and KV still held a few
seconds after the last request ended (stranded: nobody will fetch it).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pdgate.loadtest.lib.probes import (
    PER_GATEWAY,
    Counters,
    HoldSnapshot,
    delta,
    read_counters,
    read_holds,
    wait_kv_released,
)
from pdgate.loadtest.lib.procfs import host_busy_s, own_cpu_s
from pdgate.loadtest.lib.stats import RequestResult, Summary, summarize
from pdgate.loadtest.scheduling._load import LoadGenerator
from pdgate.loadtest.scheduling.closed_loop import ClosedLoop
from pdgate.loadtest.scheduling.clusters import Cluster
from pdgate.loadtest.scheduling.open_loop import Arrivals, OpenLoop
from pdgate.loadtest.scheduling.workload import Workload

__all__ = ["Holds", "Point", "Timing", "run_point"]


@dataclass(frozen=True, slots=True)
class Timing:
    warmup_s: float
    measure_s: float
    drain_s: float = 60.0  # a bound; the drain ends when the last request does
    # After the drain, how long KV may take to be released before what is left counts as
    # stranded (a decode pulls it within milliseconds of its request's first token).
    release_s: float = 3.0


@dataclass(frozen=True, slots=True)
class Holds:
    """The prefills' KV holds over one point (NaN: the prefills do not report them)."""

    max_s: float = math.nan  # longest hold since the cluster started, as of the point's end
    over_5s: float = math.nan  # holds over 5 s that ended during the point
    stranded: float = math.nan  # KV still held `Timing.release_s` after the drain

    @classmethod
    def between(cls, before: HoldSnapshot, after: HoldSnapshot) -> Holds:
        return cls(after.max_s, after.over_5s - before.over_5s, after.held)


# The gateways' own counts of the requests they shed, by why (gateway/placement/admission.py).
_SHEDS = ("early_drops", "queue_sheds_drain", "queue_sheds_full")

# The fleet's Redis calls a request makes (gateway/placement/leases.py); the others are periodic.
_PER_REQUEST_OPS = ("acquire", "computed", "release")


@dataclass(frozen=True, slots=True)
class Point:
    mode: str
    users: int  # closed loop: the users; open loop: the closed-loop users it stands for
    summary: Summary
    counters: Counters  # server-side deltas over the window
    cluster_cpu: float  # cores used by the cluster process during the window (1.0 = one core)
    client_cpu: float  # cores used by the load generator
    host_cpu: float  # cores busy on the whole machine (NaN where /proc/stat is missing)
    loop_lag: dict[str, float]  # cluster event-loop lag during the window, ms (in-process)
    wall_s: float  # the whole point, warm-up and drain included
    gateway_cpu: float = math.nan  # cores used by the gateway processes (processes only)
    holds: Holds = field(default_factory=Holds)
    seed: int = 0
    arrivals: str = "closed"  # open_loop.ARRIVALS
    client: str = "instant"  # the closed loop's users' (clients.CLIENTS)
    rate_rps: float = math.nan  # open loop: the mean arrival rate asked for
    max_in_flight: int = 0  # open loop: the client's bound (0: closed loop)
    load_fraction: float = math.nan  # offered load / capacity (NaN: capacity unknown)
    results: tuple[RequestResult, ...] = field(default=(), repr=False)  # the window's sample

    @property
    def prefix_hit_rate(self) -> float:
        total = self.counters.get("shim_prefix_cache_total_tokens", 0.0)
        return self.counters.get("shim_prefix_cache_hit_tokens", 0.0) / total if total else math.nan

    @property
    def phase_switch_wait_s(self) -> float:
        """Mean phase-switching wait of the window's requests (the shims' own measure: end
        of a prefill to the first decode step); NaN where none was recorded."""
        n = self.counters.get("shim_phase_switch_waits", 0.0)
        return self.counters.get("shim_phase_switch_wait_s", 0.0) / n if n else math.nan

    @property
    def rejections_429(self) -> float:
        """429s answered by prefills (every one is a retry for on-demand forwarding and a
        failed request for the baseline, whose prefills only reject when their queue is full)."""
        return self.counters.get("shim_rejected", 0.0)

    @property
    def retries_per_request(self) -> float:
        """Rejected prefill attempts per request issued in the window (NaN without pdgate's
        metrics, e.g. behind another router)."""
        n = self.summary.requests
        if not n or "attempts_rejected" not in self.counters:
            return math.nan
        return self.counters["attempts_rejected"] / n

    @property
    def rejections_per_request(self) -> float:
        """Prefill 429s per request issued in the window (the fleet measurement's figure)."""
        n = self.summary.requests
        return self.rejections_429 / n if n else math.nan

    @property
    def fleet_calls_per_request(self) -> float:
        """The gateways' calls to the fleet's Redis that requests make (acquire, computed,
        release) per request issued in the window; the periodic sync and renewal are per
        gateway and second, not per request. NaN where none were made (one gateway alone
        counts the slots of queue-less prefills itself)."""
        n = self.summary.requests
        calls = sum(self.counters.get(f"fleet_calls_{op}", 0.0) for op in _PER_REQUEST_OPS)
        return calls / n if n and calls else math.nan

    def fleet_ms(self, op: str) -> float:
        """Mean milliseconds of one fleet call of `op` in the window (NaN: none made)."""
        calls = self.counters.get(f"fleet_calls_{op}", 0.0)
        return 1000 * self.counters.get(f"fleet_seconds_{op}", 0.0) / calls if calls else math.nan

    def row(self) -> dict[str, Any]:
        s = self.summary
        return {
            "mode": self.mode,
            "users": self.users,
            "arrivals": self.arrivals,
            "client": self.client,
            "rate_rps": self.rate_rps,
            "load_fraction": self.load_fraction,
            "requests": s.requests,
            "offered_rps": s.offered_rps,
            "client_dropped": s.dropped,
            "max_in_flight": self.max_in_flight,
            **s.headline(),
            "tpot_p50_s": s.tpot_p50_s,
            "tpot_p99_s": s.tpot_p99_s,
            "ttft_attainment": s.ttft_attainment,
            "tpot_attainment": s.tpot_attainment,
            "retried": s.retried,
            "first_retry_success": s.first_retry_success,
            "phase_switch_wait_s": self.phase_switch_wait_s,
            "prefix_hit_rate": self.prefix_hit_rate,
            "prefill_429s": self.rejections_429,
            "prefill_429s_per_request": self.rejections_per_request,
            "retries_per_request": self.retries_per_request,
            "gateway_503s": s.status_counts.get(503, 0),
            **self.sheds(),
            "cluster_cpu_cores": self.cluster_cpu,
            "client_cpu_cores": self.client_cpu,
            "host_cpu_cores": self.host_cpu,
            "loop_lag_p99_ms": self.loop_lag.get("lag_p99_ms", math.nan),
            "gateway_cpu_cores": self.gateway_cpu,
            "fleet_calls_per_request": self.fleet_calls_per_request,
            "fleet_acquire_ms": self.fleet_ms("acquire"),
            "kv_hold_max_s": self.holds.max_s,
            "kv_hold_over_5s": self.holds.over_5s,
            "kv_stranded": self.holds.stranded,
            "seed": self.seed,
            **{f"success_{k}": v for k, v in s.success_by_scenario.items()},
            **{f"success_tenant_{k}": v for k, v in s.success_by_tenant.items()},
            **(
                {f"success_gateway{k}": v for k, v in s.success_by_gateway.items()}
                | {f"requests_gateway{k}": v for k, v in s.requests_by_gateway.items()}
                | {f"mix_gateway{k}": v for k, v in s.mix_by_gateway.items()}
                | {f"refused_gateway{k}": v for k, v in s.refused_by_gateway.items()}
                | {f"late_gateway{k}": v for k, v in s.late_by_gateway.items()}
                if len(s.success_by_gateway) > 1
                else {}
            ),
            **self.per_gateway(),
            # Each gateway's own event-loop lag p99, where several ran as processes.
            **{
                f"loop_lag_p99_ms_gateway{k.removeprefix('lag_p99_ms_gw')}": v
                for k, v in self.loop_lag.items()
                if k.startswith("lag_p99_ms_gw")
            },
        }

    def sheds(self) -> dict[str, float]:
        """Why the gateways shed requests in the window, summed over them (a reason none was
        shed for has no sample yet: 0); NaN behind another router, without their metrics."""
        served = any(k.startswith("outcome_") for k in self.counters)
        return {k: self.counters.get(k, 0.0 if served else math.nan) for k in _SHEDS}

    def per_gateway(self) -> dict[str, float]:
        """With several gateways, each one's early drops, fleet yields and drain sheds in the
        window (``early_drops_gateway0``, ...): what tells a gateway left behind from bad
        luck."""
        out: dict[str, float] = {}
        for key, value in sorted(self.counters.items()):
            name, _, counter = key.partition("_")
            if name.startswith("gw") and name[2:].isdigit() and counter in PER_GATEWAY:
                out[f"{counter}_gateway{name[2:]}"] = value
        return out if len({k.rsplit("_gateway", 1)[1] for k in out}) > 1 else {}


async def run_point(
    cluster: Cluster,
    session: aiohttp.ClientSession,
    workload: Workload,
    users: int,
    timing: Timing,
    *,
    user_offset: int = 0,
    fronts: Sequence[str] | None = None,
    seed: int = 0,
    name: str | None = None,
    ramp_s: float | None = None,
    arrivals: Arrivals | None = None,
    rate_rps: float | None = None,
    load_fraction: float = math.nan,
) -> Point:
    """`fronts`: base URLs the users send to, when not the cluster's own gateways (another
    router); the gateways' metrics are then left out of the counters. `name`: the point's
    series (default: the mode's name). `ramp_s`: the users start over this long (default
    0.5 s or half the warm-up, if shorter). With open-loop `arrivals`, requests arrive at
    `rate_rps` instead, and `users` only sizes the client's in-flight bound."""
    urls = cluster.urls
    metrics_from = urls.gateways if fronts is None else []
    shims = [*urls.prefills, *urls.decodes]
    began = time.monotonic()
    holds0 = await read_holds(session, urls.prefills)
    targets = [url + "/v1/completions" for url in (urls.gateways if fronts is None else fronts)]
    arrivals = arrivals or Arrivals()
    bound = 0
    loop: LoadGenerator
    if arrivals.open:
        if rate_rps is None:
            raise ValueError("an open loop needs its arrival rate")
        bound = arrivals.in_flight_bound(users)
        loop = OpenLoop(session, targets, cluster.spec.model, workload, arrivals, rate_rps,
                        max_in_flight=bound, stream=user_offset)  # fmt: skip
    else:
        loop = ClosedLoop(
            session, targets, cluster.spec.model, workload, users, user_offset=user_offset,
            ramp_s=min(0.5, timing.warmup_s / 2) if ramp_s is None else ramp_s,
            client=arrivals.client,
        )  # fmt: skip
    loop.start()
    try:
        await asyncio.sleep(timing.warmup_s)
        before, child0 = await asyncio.gather(
            read_counters(session, metrics_from, urls.prefills, shims), cluster.stats()
        )
        own0, host0 = own_cpu_s(), host_busy_s()
        loop.open_window()
        await asyncio.sleep(timing.measure_s)
        window = loop.close_window()
        after, child1 = await asyncio.gather(
            read_counters(session, metrics_from, urls.prefills, shims), cluster.stats()
        )
        own1, host1 = own_cpu_s(), host_busy_s()
        cancelled = await loop.stop(timing.drain_s)
    finally:
        await loop.stop(0.0)  # on a failure above: no user may outlive the point
    if cancelled:
        raise RuntimeError(f"{cancelled} requests did not end within {timing.drain_s} s")
    elapsed = child1["wall_s"] - child0["wall_s"]
    holds1 = await wait_kv_released(session, urls.prefills, timing.release_s)
    return Point(
        mode=name or cluster.mode.name,
        users=users,
        summary=summarize(loop.results, window),
        counters=delta(before, after),
        cluster_cpu=(child1["cpu_s"] - child0["cpu_s"]) / elapsed,
        client_cpu=(own1 - own0) / elapsed,
        host_cpu=(host1 - host0) / elapsed,
        loop_lag={k: v for k, v in child1.items() if k.startswith("lag_")},
        wall_s=time.monotonic() - began,
        gateway_cpu=(child1["gateway_cpu_s"] - child0["gateway_cpu_s"]) / elapsed,
        holds=Holds.between(holds0, holds1),
        seed=seed,
        arrivals=arrivals.kind,
        client=arrivals.client,
        rate_rps=math.nan if rate_rps is None or not arrivals.open else rate_rps,
        max_in_flight=bound,
        load_fraction=load_fraction,
        results=tuple(loop.results),
    )
