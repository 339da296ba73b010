"""The chaos benchmark's figures, from the records of its runs (pure functions, no I/O but
the CSV writer), and their markdown.

Per fault (requests belong to a fault when they ended after it began and were issued before
the arrivals paused after it, loadtest/chaos/run.py):

* **errors**: requests the client saw fail (status, and the error body's or in-band
  error's code); **unexpected**: those the issue allows none of: all of them, except, for
  the gateway's kill, the requests that were open on the killed gateway at the kill;
* **stall**: the longest gap between two consecutive SSE events of any stream, among the
  gaps that overlap the fault window (its start to 5 s after its end); a stream that broke
  stalls from its last event to its end; **p99 stall**: the p99, over the streams open in
  the window (their first event before its end, their end after its start), of each one's
  longest such gap (0 for one with none kept);
* a decode's kill or stop (**streams**): the streams in flight at the fault, those of them
  whose events stopped across it (a kept gap, or the break, from before 0.1 s after the
  fault to after it: the target's streams as a client sees them) and how many of each
  failed or missed their TTFT deadline;
* a gateway's kill (**dead gateway's KV**): from the kill until no prefill held KV for the
  killed gateway's fleet id (0 when none did at the first poll; a lower bound when one
  still did at the last), and the prefills' 429s in each poll interval that began after
  the fleet's lease time and at whose start that prefill still held it;
* **recover**: from the fault's start to the issue of the last request that failed or whose
  TTFT was above the steady phase's (``max(2 x p99, p99 + 0.25 s)``); 0 when none; marked
  ``>`` when that request was among the last 2 s issued before the pause (not proven back);
* **whole**: from the fault's start until every gateway lists every instance ready again;
* **held**: what the fleet still held with no request open, at least 5 s after the fault
  (every count must be 0, as in the baseline).
"""

from __future__ import annotations

import csv
import itertools
import math
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdgate.loadtest.chaos.load import GAP_KEEP_S, StreamRecord
from pdgate.loadtest.chaos.run import FAULT_TITLES, ChaosResult, FaultEvent, OverloadResult
from pdgate.loadtest.lib.probes import bucket_quantile
from pdgate.loadtest.lib.stats import percentile

__all__ = [
    "DeadGatewayKv",
    "FaultRow",
    "OverloadRow",
    "StreamsHit",
    "dead_gateway_kv",
    "fault_figures",
    "fault_rows",
    "longest_stall",
    "markdown",
    "overload_row",
    "recovery_s",
    "spread_cell",
    "stall_p99",
    "streams_hit",
    "summary_json",
    "write_csv",
]

STALL_AFTER_S = 5.0  # the fault window runs on this long after the fault's end
_DECODE_FAULTS = ("kill-decode", "stop-decode")
_UNPROVEN_S = 2.0  # a bad request this close to the pause: recovery not shown


def _gaps(r: StreamRecord) -> list[tuple[float, float]]:
    """`r`'s kept gaps; a stream that broke after its first event also stalled from its
    last event to its end."""
    if r.status == 200 and not r.completed and r.last_event_s is not None:
        return [*r.gaps, (r.last_event_s, r.ended_s)]
    return r.gaps


def _stall(r: StreamRecord, start_s: float, end_s: float) -> float:
    return max((b - a for a, b in _gaps(r) if a < end_s and b > start_s), default=0.0)


def longest_stall(records: Iterable[StreamRecord], start_s: float, end_s: float) -> float:
    """The longest gap between consecutive events of any stream, among gaps overlapping
    [start_s, end_s]. 0.0 when no kept gap overlaps (every gap was ordinary decoding)."""
    return max((_stall(r, start_s, end_s) for r in records), default=0.0)


def stall_p99(records: Iterable[StreamRecord], start_s: float, end_s: float) -> float:
    """The p99, over the streams open in [start_s, end_s] (first event before its end,
    ended after its start), of each one's longest gap overlapping it; NaN when none."""
    open_ = [r for r in records if r.first_event_s is not None and r.first_event_s <= end_s
             and r.ended_s >= start_s]  # fmt: skip
    return percentile([_stall(r, start_s, end_s) for r in open_], 99)


@dataclass(frozen=True, slots=True)
class StreamsHit:
    """A decode fault's streams: in flight at the fault, and those of them whose events
    stopped across it; how many of each failed or missed their TTFT deadline."""

    in_flight: int
    in_flight_bad: int
    stalled: int
    stalled_bad: int


def streams_hit(records: Iterable[StreamRecord], at_s: float, deadline_s: float) -> StreamsHit:
    """The streams in flight at `at_s`; stalled: had their first event by then and a kept
    gap (or their break) from before `at_s` + `GAP_KEEP_S` to after `at_s` (the last event
    the target sent before the fault reaches the client a little after it); bad: failed,
    or no first token within `deadline_s`."""
    in_flight = [r for r in records if r.issued_s <= at_s < r.ended_s]
    stalled = [r for r in in_flight if r.first_event_s is not None and r.first_event_s <= at_s
               and any(a <= at_s + GAP_KEEP_S and b > at_s for a, b in _gaps(r))]  # fmt: skip

    def bad(rs: list[StreamRecord]) -> int:
        return sum(r.failed or r.ttft_s is None or r.ttft_s > deadline_s for r in rs)

    return StreamsHit(len(in_flight), bad(in_flight), len(stalled), bad(stalled))


@dataclass(frozen=True, slots=True)
class DeadGatewayKv:
    """After a gateway's kill, the KV the prefills held for it."""

    held_s: float  # from the kill until no prefill held any (0: none did at the first poll)
    released: bool  # False: still held at the last poll (held_s is a lower bound)
    prefills: int  # how many held some at the first poll
    late_429: int  # 429s of a prefill still holding it, past the lease
    lease_s: float
    new_id: bool | None  # the restarted gateway's fleet id differs (None: not read)


def dead_gateway_kv(event: FaultEvent) -> DeadGatewayKv | None:
    """From `event.kv_polls` (a gateway's kill); None when it has none."""
    polls = event.kv_polls
    if not polls:
        return None
    held_s, released = polls[-1][0] - event.began_s, False
    for n, (at, holds) in enumerate(polls):
        if all(h is not None and not h[0] for h in holds):
            held_s, released = (at - event.began_s if n else 0.0), True
            break
    late = 0
    for (at, before), (_, after) in itertools.pairwise(polls):
        if at - event.began_s >= event.lease_s:
            late += sum(max(0, b[1] - a[1]) for a, b in zip(before, after, strict=True)
                        if a is not None and b is not None and a[0])  # fmt: skip
    killed, restarted = event.gateway_ids
    return DeadGatewayKv(
        held_s=held_s,
        released=released,
        prefills=sum(h is not None and h[0] for h in polls[0][1]),
        late_429=late,
        lease_s=event.lease_s,
        new_id=restarted != killed if killed and restarted else None,
    )


def ttft_limit(steady: Sequence[StreamRecord]) -> float:
    p99 = percentile([r.ttft_s for r in steady if r.ttft_s is not None], 99)
    return math.inf if math.isnan(p99) else max(2 * p99, p99 + 0.25)


def recovery_s(
    records: Iterable[StreamRecord], began_s: float, paused_s: float, limit_s: float
) -> tuple[float, bool]:
    """(seconds from the fault to the issue of the last bad request issued in
    [began_s, paused_s), proven): bad = failed or TTFT above `limit_s`; proven is False
    when that request came in the last `_UNPROVEN_S` before the pause."""
    last: float | None = None
    for r in records:
        if not began_s <= r.issued_s < paused_s:
            continue
        if r.failed or r.ttft_s is None or r.ttft_s > limit_s:
            last = r.issued_s if last is None else max(last, r.issued_s)
    if last is None:
        return 0.0, True
    return last - began_s, last < paused_s - _UNPROVEN_S


@dataclass(frozen=True, slots=True)
class FaultRow:
    fault: str
    target: str
    requests: int
    errors: int
    unexpected: int
    codes: Mapping[str, int]
    stall_s: float
    stall_p99_s: float
    recover_s: float
    recover_proven: bool
    whole_s: float
    held: Mapping[str, float]  # only the counts that are not 0
    open_at_fault: int | None = None
    note: str = ""
    streams: StreamsHit | None = None  # a decode's kill or stop
    dead_kv: DeadGatewayKv | None = None  # a gateway's kill

    @property
    def held_ok(self) -> bool:
        return not self.held


def _in_fault(r: StreamRecord, event: FaultEvent) -> bool:
    return r.ended_s >= event.began_s and r.issued_s < event.paused_s


def _expected(r: StreamRecord, event: FaultEvent, slot: int | None) -> bool:
    """A failure the issue allows: open on the killed gateway at the kill."""
    return slot is not None and r.gateway == slot and r.issued_s <= event.began_s <= r.ended_s


def nonzero(held: Mapping[str, float]) -> dict[str, float]:
    return {k: v for k, v in held.items() if v != 0 or math.isnan(v)}


def fault_rows(result: ChaosResult) -> list[FaultRow]:
    steady = [r for r in result.records if r.issued_s < result.steady[1]]
    limit = ttft_limit(steady)
    deadline = result.plan.scenario().ttft_deadline_s
    rows = []
    for event in result.faults:
        mine = [r for r in result.records if _in_fault(r, event)]
        window = event.began_s, event.ended_s + STALL_AFTER_S
        failed = [r for r in mine if r.failed]
        slot = result.plan.gateways - 1 if event.fault == "kill-gateway" else None
        recover, proven = recovery_s(result.records, event.began_s, event.paused_s, limit)
        rows.append(
            FaultRow(
                fault=event.fault,
                target=event.target,
                requests=len(mine),
                errors=len(failed),
                unexpected=sum(not _expected(r, event, slot) for r in failed),
                codes=dict(Counter(r.error_label() for r in failed)),
                stall_s=longest_stall(mine, *window),
                stall_p99_s=stall_p99(mine, *window),
                recover_s=recover,
                recover_proven=proven,
                whole_s=event.ready_s - event.began_s,
                held=nonzero(event.held),
                open_at_fault=event.open_at_fault,
                note=event.note,
                streams=(
                    streams_hit(mine, event.began_s, deadline)
                    if event.fault in _DECODE_FAULTS
                    else None
                ),
                dead_kv=dead_gateway_kv(event),
            )
        )
    return rows


# A shed answered within this of its request counts as answered at once: a client learns it
# may go elsewhere or back off, where a queued request waits out its TTFT deadline.
AT_ONCE_S = 1.0


@dataclass(frozen=True, slots=True)
class OverloadRow:
    label: str
    capacity_rps: float
    offered_rps: float
    requests: int
    ok: int
    shed: int  # 429 or 503
    shed_with_retry_after: int
    shed_at_once: int  # answered within AT_ONCE_S of being sent
    codes: Mapping[str, int]  # every failure, by label
    first_shed_s: float  # since the overload began: the first 429/503 answered
    shed_p50_s: float  # a shed request's time to its answer
    shed_p99_s: float
    probe_idle_ms: float
    probe_p50_ms: float
    probe_p99_ms: float
    probe_max_ms: float
    probe_failed: int
    loop_lag_p99_ms: float  # the bucket bound holding the p99 of the gateway's own histogram
    rss_start_mib: float
    rss_peak_mib: float
    rss_end_mib: float
    held: Mapping[str, float] = field(default_factory=dict)


def overload_row(o: OverloadResult) -> OverloadRow:
    shed = [r for r in o.records if r.status in (429, 503)]
    answered = [r.ended_s - r.issued_s for r in shed]
    lat = [p for _, p in o.probes if not math.isnan(p)]
    rss = [s.rss_kib / 1024 for s in o.rss] or [math.nan]
    first = min((r.ended_s for r in shed), default=math.nan) - o.began_s
    return OverloadRow(
        label=o.label,
        capacity_rps=o.capacity_rps,
        offered_rps=o.rate_rps,
        requests=len(o.records),
        ok=sum(r.completed for r in o.records),
        shed=len(shed),
        shed_with_retry_after=sum(r.retry_after is not None for r in shed),
        shed_at_once=sum(a <= AT_ONCE_S for a in answered),
        codes=dict(Counter(r.error_label() for r in o.records if r.failed)),
        first_shed_s=first,
        shed_p50_s=percentile(answered, 50),
        shed_p99_s=percentile(answered, 99),
        probe_idle_ms=1000 * o.idle_probe_s,
        probe_p50_ms=1000 * percentile(lat, 50),
        probe_p99_ms=1000 * percentile(lat, 99),
        probe_max_ms=1000 * max(lat, default=math.nan),
        probe_failed=sum(math.isnan(p) for _, p in o.probes),
        loop_lag_p99_ms=1000 * bucket_quantile(o.loop_lag, 0.99),
        rss_start_mib=rss[0],
        rss_peak_mib=max(rss),
        rss_end_mib=rss[-1],
        held=nonzero(o.held),
    )


# -- formatting ----------------------------------------------------------------------------


def _num(value: float, digits: int) -> str:
    return "n/a" if math.isnan(value) else f"{value:.{digits}f}"


def spread_cell(values: Sequence[float], digits: int = 1) -> str:
    """``median (min-max)`` of one figure over the runs; one run: the value; NaNs left out."""
    known = [v for v in values if not math.isnan(v)]
    if not known:
        return "n/a"
    if len(known) == 1:
        return _num(known[0], digits)
    lo, mid, hi = min(known), statistics.median(known), max(known)
    if _num(lo, digits) == _num(hi, digits):
        return _num(mid, digits)
    return f"{_num(mid, digits)} ({_num(lo, digits)}-{_num(hi, digits)})"


def codes_cell(codes: Iterable[Mapping[str, int]]) -> str:
    """Error labels summed over the runs, most frequent first; ``-`` when none."""
    total: Counter[str] = Counter()
    for c in codes:
        total.update(c)
    return ", ".join(f"{k} x{n}" for k, n in total.most_common()) or "-"


def held_cell(helds: Iterable[Mapping[str, float]]) -> str:
    """``0`` when every run held nothing; otherwise each count left, per run."""
    parts = [", ".join(f"{k}={v:g}" for k, v in sorted(h.items())) for h in helds]
    if not any(parts):
        return "0"
    return "; ".join(f"run {i + 1}: {p or '0'}" for i, p in enumerate(parts))


def _recover_cell(rows: Sequence[FaultRow]) -> str:
    cell = spread_cell([r.recover_s for r in rows])
    return cell if all(r.recover_proven for r in rows) else f"> {cell}"


def _stall_cell(stalls: Sequence[float]) -> str:
    """A stall over the runs; a run whose every gap was shorter than the reader keeps
    (`GAP_KEEP_S`) counts as that bound, shown ``<``."""
    if all(s == 0 for s in stalls):
        return f"< {GAP_KEEP_S:g}"
    return spread_cell([s or GAP_KEEP_S for s in stalls], 2)


def fault_table(runs: Sequence[Sequence[FaultRow]]) -> list[str]:
    lines = [
        "| fault | requests | client errors | unexpected | status / code | longest stall, s "
        "| p99 stall, s | recover, s | fleet whole, s | held +5 s (idle) |",
        "|---|--:|--:|--:|---|--:|--:|--:|--:|---|",
    ]
    faults = [r.fault for r in runs[0]] if runs else []
    for i, fault in enumerate(faults):
        rows = [run[i] for run in runs if i < len(run)]
        title = FAULT_TITLES.get(fault, fault)
        lines.append(
            f"| {i + 1}. {title} | {spread_cell([r.requests for r in rows], 0)} "
            f"| {spread_cell([r.errors for r in rows], 0)} "
            f"| {spread_cell([r.unexpected for r in rows], 0)} "
            f"| {codes_cell(r.codes for r in rows)} "
            f"| {_stall_cell([r.stall_s for r in rows])} "
            f"| {_stall_cell([r.stall_p99_s for r in rows])} | {_recover_cell(rows)} "
            f"| {spread_cell([r.whole_s for r in rows])} | {held_cell(r.held for r in rows)} |"
        )
    return lines


def overload_table(runs: Sequence[Sequence[OverloadRow]]) -> list[str]:
    """One row per overloaded gateway (its label), each cell over the runs."""
    if not runs or not runs[0]:
        return []
    lines = [
        "| overload (one gateway, open loop) | offered, req/s | capacity, req/s | requests "
        "| completed | shed 429/503, % | with Retry-After, % | shed at once, % | status / code "
        "| first shed, s "
        "| shed answered p50 / p99, s | loop lag p99, ms (its own, at most) "
        "| /health p99 (idle), ms | /health max, ms "
        "| RSS start / peak / end, MiB | held after (idle) |",
        "|---|--:|--:|--:|--:|--:|--:|--:|---|--:|--:|--:|--:|--:|--:|---|",
    ]
    for i, first in enumerate(runs[0]):
        lines.append(_overload_line([run[i] for run in runs if i < len(run)], first))
    return lines


def _overload_line(rows: Sequence[OverloadRow], first: OverloadRow) -> str:
    def cell(name: str, digits: int = 1) -> str:
        return spread_cell([float(getattr(r, name)) for r in rows], digits)

    shed_pct = [100 * r.shed / r.requests if r.requests else math.nan for r in rows]
    ra_pct = [100 * r.shed_with_retry_after / r.shed if r.shed else math.nan for r in rows]
    once_pct = [100 * r.shed_at_once / r.shed if r.shed else math.nan for r in rows]
    factor = first.offered_rps / first.capacity_rps
    return (
        f"| {factor:.0f}x capacity, {first.label} | {cell('offered_rps')} "
        f"| {cell('capacity_rps')} | {cell('requests', 0)} | {cell('ok', 0)} "
        f"| {spread_cell(shed_pct)} | {spread_cell(ra_pct)} | {spread_cell(once_pct)} "
        f"| {codes_cell(r.codes for r in rows)} | {cell('first_shed_s', 2)} "
        f"| {cell('shed_p50_s', 2)} / {cell('shed_p99_s', 2)} | {cell('loop_lag_p99_ms')} "
        f"| {cell('probe_p99_ms')} ({cell('probe_idle_ms', 2)}) | {cell('probe_max_ms')} "
        f"| {cell('rss_start_mib')} / {cell('rss_peak_mib')} / {cell('rss_end_mib')} "
        f"| {held_cell(r.held for r in rows)} |"
    )


def markdown(results: Sequence[ChaosResult], command: str, *, date: str, machine: str) -> str:
    runs = [fault_rows(r) for r in results]
    overloads = [[overload_row(o) for o in r.overloads] for r in results]
    plan = results[0].plan
    steady = [[x for x in r.records if x.issued_s < r.steady[1]] for r in results]
    ttft = [percentile([x.ttft_s for x in s if x.ttft_s is not None], 99) for s in steady]
    lines = [
        f"`{command}` — {date}; {machine}; {len(results)} run(s), each cell the median "
        "(min-max) over the runs, counts summed where so said.",
        "",
        f"Fleet: {plan.prefills} prefills ({plan.prefill_capacity} slots), {plan.decodes} "
        f"decodes ({plan.decode_capacity} slots), {plan.gateways} gateways, each its own "
        f"process; sim engine `{plan.sim_profile}`; registry in Redis behind Sentinel (a "
        "primary, a replica, three sentinels, `redis+sentinel://`). Load: open loop, "
        f"Poisson arrivals at {plan.rate_rps:g} req/s over both gateways, prompts of "
        f"{plan.prompt_tokens[0]}-{plan.prompt_tokens[1]} tokens, streams of "
        f"{plan.min_tokens}-{plan.max_tokens} tokens; a client resends to the other gateway "
        f"only a request that got no response start. SIGSTOPs last {plan.stop_s:g} s. "
        f"Steady TTFT p99: {spread_cell(ttft, 3)} s.",
        "",
        *fault_table(runs),
        "",
        *overload_table(overloads),
        "",
    ]
    notes: list[str] = []
    for i, row in enumerate(runs[0] if runs else []):
        said = [f"run {n + 1}: {run[i].note}" for n, run in enumerate(runs) if run[i].note]
        if said:
            notes.append(f"{row.fault}: " + "; ".join(said))
        same = [run[i] for run in runs if i < len(run)]
        held = [r.open_at_fault for r in same]
        if any(h is not None for h in held):
            what = "requests pending" if row.fault == "kill-gateway" else "slots in use"
            notes.append(f"{row.fault}: the target had {held} {what} at the fault (per run)")
        hit = [r.streams for r in same if r.streams is not None]
        if hit:
            deadline = plan.scenario().ttft_deadline_s
            notes.append(
                f"{row.fault}: {[h.stalled for h in hit]} streams stalled across the fault "
                f"(their events stopped over {GAP_KEEP_S:g} s across it: the target's, as "
                "clients see them), "
                f"{[h.stalled_bad for h in hit]} of them failed or missed their {deadline:g} s "
                f"TTFT deadline; of all {[h.in_flight for h in hit]} in flight at the fault, "
                f"{[h.in_flight_bad for h in hit]} (per run)"
            )
        kv = [r.dead_kv for r in same if r.dead_kv is not None]
        if kv:
            notes.append(f"{row.fault}: {_dead_kv_note(kv)}")
    lines += [f"- {n}" for n in notes]
    lines.append(
        f"- wall time per run: {', '.join(f'{r.wall_s:.0f} s' for r in results)}; load "
        f"average {', '.join(f'{a:.1f}->{b:.1f}' for a, b in (r.load_avg for r in results))}"
    )
    return "\n".join(lines) + "\n"


def _dead_kv_note(kv: Sequence[DeadGatewayKv]) -> str:
    held = ", ".join(f"{'' if k.released else '> '}{k.held_s:.1f}" for k in kv)
    ids = {k.new_id for k in kv}
    if ids == {True}:
        restarted = "a new fleet id (KV held for the old one is the dead gateway's alone)"
    elif False in ids:
        restarted = (
            "the same fleet id in some run (KV held for it after the restart may be the new "
            "process's)"
        )
    else:
        restarted = "a fleet id not read in some run"
    return (
        f"the dead gateway's KV held for [{held}] s after the kill (lease "
        f"{kv[0].lease_s:g} s; held by {[k.prefills for k in kv]} prefills at the kill); "
        f"prefill 429s while it was held past the lease: {[k.late_429 for k in kv]}; the "
        f"restarted gateway had {restarted} (per run)"
    )


def fault_figures(row: FaultRow) -> dict[str, Any]:
    """The figures of one kind of fault (none for the others), for the JSON and the CSV."""
    out: dict[str, Any] = {}
    if row.streams is not None:
        h = row.streams
        out.update(in_flight=h.in_flight, in_flight_bad=h.in_flight_bad, stalled=h.stalled,
                   stalled_bad=h.stalled_bad)  # fmt: skip
    if row.dead_kv is not None:
        k = row.dead_kv
        out.update(dead_kv_held_s=round(k.held_s, 3), dead_kv_released=k.released,
                   dead_kv_prefills=k.prefills, late_429=k.late_429, lease_s=k.lease_s,
                   new_gateway_id=k.new_id)  # fmt: skip
    return out


def summary_json(results: Sequence[ChaosResult]) -> dict[str, Any]:
    out: dict[str, Any] = {"runs": len(results), "faults": {}, "overload": []}
    for result in results:
        for row in fault_rows(result):
            out["faults"].setdefault(row.fault, []).append(
                {
                    "errors": row.errors,
                    "unexpected": row.unexpected,
                    "codes": row.codes,
                    "stall_s": round(row.stall_s, 3),
                    "stall_p99_s": round(row.stall_p99_s, 3),
                    "recover_s": round(row.recover_s, 3),
                    "whole_s": round(row.whole_s, 3),
                    "held": row.held,
                    **fault_figures(row),
                }
            )
        for o in map(overload_row, result.overloads):
            out["overload"].append(
                {
                    "label": o.label,
                    "offered_rps": round(o.offered_rps, 2),
                    "shed": o.shed,
                    "requests": o.requests,
                    "retry_after": o.shed_with_retry_after,
                    "shed_at_once": o.shed_at_once,
                    "probe_p99_ms": round(o.probe_p99_ms, 1),
                    "loop_lag_p99_ms": round(o.loop_lag_p99_ms, 1),
                    "rss_mib": [
                        round(o.rss_start_mib, 1),
                        round(o.rss_peak_mib, 1),
                        round(o.rss_end_mib, 1),
                    ],
                }
            )
    return out


CSV_FIELDS = (
    "run", "fault", "target", "requests", "errors", "unexpected", "codes", "stall_s",
    "stall_p99_s", "recover_s", "recover_proven", "whole_s", "held", "figures",
)  # fmt: skip


def _pairs(figures: Mapping[str, Any]) -> str:
    return ";".join(f"{k}={v}" for k, v in figures.items())


def write_csv(results: Sequence[ChaosResult], path: Path) -> None:
    """One row per run and fault, then one per run for the overload."""
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for i, result in enumerate(results, 1):
            for row in fault_rows(result):
                w.writerow([i, row.fault, row.target, row.requests, row.errors, row.unexpected,
                            ";".join(f"{k}={v}" for k, v in row.codes.items()),
                            f"{row.stall_s:.3f}", f"{row.stall_p99_s:.3f}", f"{row.recover_s:.3f}",
                            row.recover_proven, f"{row.whole_s:.3f}",
                            ";".join(f"{k}={v:g}" for k, v in row.held.items()),
                            _pairs(fault_figures(row))])  # fmt: skip
            for o in map(overload_row, result.overloads):
                w.writerow([i, "overload", o.label, o.requests, o.requests - o.ok,
                            o.requests - o.ok - o.shed,
                            ";".join(f"{k}={v}" for k, v in o.codes.items()),
                            "", "", "", "", "",
                            ";".join(f"{k}={v:g}" for k, v in o.held.items()), ""])  # fmt: skip
