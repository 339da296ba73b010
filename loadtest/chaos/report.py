"""The chaos benchmark's figures, from the records of its runs (pure functions, no I/O but
the CSV writer), and their markdown.

Per fault (requests belong to a fault when they ended after it began and were issued before
the arrivals paused after it, loadtest/chaos/run.py):

* **errors**: requests the client saw fail (status, and the error body's or in-band
  error's code); **unexpected**: those the issue allows none of: all of them, except, for
  the gateway's kill, the requests that were open on the killed gateway at the kill;
* **stall**: the longest gap between two consecutive SSE events of any stream, among the
  gaps that overlap the fault window (its start to 5 s after its end); a stream that broke
  stalls from its last event to its end;
* **recover**: from the fault's start to the issue of the last request that failed or whose
  TTFT was above the steady phase's (``max(2 x p99, p99 + 0.25 s)``); 0 when none; marked
  ``>`` when that request was among the last 2 s issued before the pause (not proven back);
* **whole**: from the fault's start until every gateway lists every instance ready again;
* **held**: what the fleet still held with no request open, at least 5 s after the fault
  (every count must be 0, as in the baseline).
"""

from __future__ import annotations

import csv
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
    "FaultRow",
    "OverloadRow",
    "fault_rows",
    "longest_stall",
    "markdown",
    "overload_row",
    "recovery_s",
    "spread_cell",
    "summary_json",
    "write_csv",
]

STALL_AFTER_S = 5.0  # the fault window runs on this long after the fault's end
_UNPROVEN_S = 2.0  # a bad request this close to the pause: recovery not shown


def longest_stall(records: Iterable[StreamRecord], start_s: float, end_s: float) -> float:
    """The longest gap between consecutive events of any stream, among gaps overlapping
    [start_s, end_s]; a stream that broke after its first event also stalled from its last
    event to its end. 0.0 when no kept gap overlaps (every gap was ordinary decoding)."""
    longest = 0.0
    for r in records:
        gaps = list(r.gaps)
        if r.status == 200 and not r.completed and r.last_event_s is not None:
            gaps.append((r.last_event_s, r.ended_s))
        for a, b in gaps:
            if a < end_s and b > start_s:
                longest = max(longest, b - a)
    return longest


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
    recover_s: float
    recover_proven: bool
    whole_s: float
    held: Mapping[str, float]  # only the counts that are not 0
    open_at_fault: int | None = None
    note: str = ""

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
    rows = []
    for event in result.faults:
        mine = [r for r in result.records if _in_fault(r, event)]
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
                stall_s=longest_stall(mine, event.began_s, event.ended_s + STALL_AFTER_S),
                recover_s=recover,
                recover_proven=proven,
                whole_s=event.ready_s - event.began_s,
                held=nonzero(event.held),
                open_at_fault=event.open_at_fault,
                note=event.note,
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


def _stall_cell(rows: Sequence[FaultRow]) -> str:
    """The longest stall over the runs; a run whose every gap was shorter than the reader
    keeps (`GAP_KEEP_S`) counts as that bound, shown ``<``."""
    if all(r.stall_s == 0 for r in rows):
        return f"< {GAP_KEEP_S:g}"
    return spread_cell([r.stall_s or GAP_KEEP_S for r in rows], 2)


def fault_table(runs: Sequence[Sequence[FaultRow]]) -> list[str]:
    lines = [
        "| fault | requests | client errors | unexpected | status / code | longest stall, s "
        "| recover, s | fleet whole, s | held +5 s (idle) |",
        "|---|--:|--:|--:|---|--:|--:|--:|---|",
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
            f"| {_stall_cell(rows)} | {_recover_cell(rows)} "
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
        held = [run[i].open_at_fault for run in runs if i < len(run)]
        if any(h is not None for h in held):
            what = "requests pending" if row.fault == "kill-gateway" else "slots in use"
            notes.append(f"{row.fault}: the target had {held} {what} at the fault (per run)")
    lines += [f"- {n}" for n in notes]
    lines.append(
        f"- wall time per run: {', '.join(f'{r.wall_s:.0f} s' for r in results)}; load "
        f"average {', '.join(f'{a:.1f}->{b:.1f}' for a, b in (r.load_avg for r in results))}"
    )
    return "\n".join(lines) + "\n"


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
                    "recover_s": round(row.recover_s, 3),
                    "whole_s": round(row.whole_s, 3),
                    "held": row.held,
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
    "recover_s", "recover_proven", "whole_s", "held",
)  # fmt: skip


def write_csv(results: Sequence[ChaosResult], path: Path) -> None:
    """One row per run and fault, then one per run for the overload."""
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for i, result in enumerate(results, 1):
            for row in fault_rows(result):
                w.writerow([i, row.fault, row.target, row.requests, row.errors, row.unexpected,
                            ";".join(f"{k}={v}" for k, v in row.codes.items()),
                            f"{row.stall_s:.3f}", f"{row.recover_s:.3f}", row.recover_proven,
                            f"{row.whole_s:.3f}",
                            ";".join(f"{k}={v:g}" for k, v in row.held.items())])  # fmt: skip
            for o in map(overload_row, result.overloads):
                w.writerow([i, "overload", o.label, o.requests, o.requests - o.ok,
                            o.requests - o.ok - o.shed,
                            ";".join(f"{k}={v}" for k, v in o.codes.items()),
                            "", "", "", "",
                            ";".join(f"{k}={v:g}" for k, v in o.held.items())])  # fmt: skip
