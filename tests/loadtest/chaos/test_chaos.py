"""``pdgate bench chaos``: the pure parts (a stream's stall, recovery, the rows and their
spread over runs, the SSE reader), and a short real run of two faults and the overload."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from pdgate.loadtest.chaos.load import DROPPED, StreamRecord, read_stream
from pdgate.loadtest.chaos.report import (
    codes_cell,
    dead_gateway_kv,
    fault_rows,
    held_cell,
    longest_stall,
    markdown,
    overload_row,
    recovery_s,
    spread_cell,
    stall_p99,
    streams_hit,
    ttft_limit,
)
from pdgate.loadtest.chaos.run import (
    ChaosPlan,
    ChaosResult,
    FaultEvent,
    OverloadResult,
    _gateway_id,
    _health,
)
from pdgate.loadtest.lib.rss import RssSample
from tests.loadtest._http import served
from tests.loadtest._procs import RunBench


def _rec(issued: float, ended: float, *, status: int = 200, done: bool = True,
         ttft: float | None = 0.1, gaps: list[tuple[float, float]] | None = None,
         last: float | None = None, code: str = "", gateway: int = 0) -> StreamRecord:  # fmt: skip
    return StreamRecord(issued_s=issued, ended_s=ended, status=status, done=done, ttft_s=ttft,
                        gaps=gaps or [], last_event_s=last, code=code, gateway=gateway,
                        errored=bool(code) and status == 200,
                        first_event_s=None if ttft is None else issued + ttft)  # fmt: skip


def test_the_longest_stall_is_the_longest_gap_overlapping_the_window() -> None:
    records = [
        _rec(0, 10, gaps=[(1.0, 1.5), (6.0, 9.0)]),  # 3 s gap, after the window
        _rec(0, 10, gaps=[(3.0, 4.2)]),  # 1.2 s inside
        _rec(0, 10, gaps=[(1.0, 2.5)]),  # 1.5 s: starts before, ends inside
    ]
    assert longest_stall(records, 2.0, 5.0) == pytest.approx(1.5)
    assert longest_stall(records, 5.5, 5.9) == 0.0  # nothing overlaps: ordinary decoding
    # A stream that broke stalled from its last event to its end.
    broken = _rec(0, 8.0, done=False, last=3.0)
    assert longest_stall([broken], 4.0, 5.0) == pytest.approx(5.0)
    # A refused request never streamed: no stall.
    assert longest_stall([_rec(0, 8.0, status=503, done=False, last=None)], 0, 9) == 0.0


def test_the_p99_stall_is_over_each_open_stream_s_longest_gap_in_the_window() -> None:
    stalled = [_rec(0, 10, gaps=[(2.5, 2.7), (3.0, 8.5)])]  # its longest: 5.5 s
    smooth = [_rec(0, 10) for _ in range(99)]  # no gap kept: 0
    outside = [_rec(11, 20, gaps=[(12, 19)]), _rec(0, 1, ttft=0.5)]  # not open in [2, 9]
    records = [*stalled, *smooth, *outside]
    # 100 open streams, one of them stalled 5.5 s: the p99 lies between 0 and 5.5.
    assert stall_p99(records, 2.0, 9.0) == pytest.approx(0.01 * 5.5)
    assert stall_p99([*stalled, *stalled, *smooth], 2.0, 9.0) == pytest.approx(5.5)
    # A stream that broke stalls from its last event to its end, as for the longest.
    assert stall_p99([_rec(0, 8.0, done=False, last=3.0)], 4.0, 5.0) == pytest.approx(5.0)
    assert math.isnan(stall_p99(outside, 2.0, 9.0))  # nobody streamed in the window


def test_streams_hit_are_those_whose_events_stopped_across_the_fault() -> None:
    at = 20.0
    records = [
        _rec(18.0, 25.0, gaps=[(19.9, 25.0)]),  # on the target: stalled across it
        _rec(18.0, 26.0, done=False, last=20.05),  # its last event came just after: broke
        _rec(18.0, 24.0, gaps=[(20.2, 20.5)]),  # on the other decode: a later stall only
        _rec(19.9, 31.0, ttft=10.5),  # waiting for its first token: past the 10 s deadline
        _rec(18.0, 19.0, gaps=[(18.5, 18.9)]),  # ended before the fault
        _rec(21.0, 24.0, gaps=[(22.0, 23.0)]),  # issued after it
    ]
    hit = streams_hit(records, at, 10.0)
    assert (hit.in_flight, hit.in_flight_bad, hit.stalled, hit.stalled_bad) == (4, 2, 2, 1)


def test_the_dead_gateway_s_kv_is_timed_from_the_kill_and_late_429s_counted() -> None:
    kill = FaultEvent("kill-gateway", "gateway-1", 40.0, 40.0, lease_s=2.0,
                      gateway_ids=("gw-a", "gw-b"))  # fmt: skip
    held, free = (True, 0), (False, 0)
    kill.kv_polls = [
        (40.0, [held, free]),
        (41.0, [(True, 1), None]),  # a 429 inside the lease: not counted
        (42.0, [(True, 1), (False, 3)]),  # the other prefill's 429s: it held nothing
        (42.5, [(True, 3), (False, 3)]),  # two while it held the KV past the lease
        (43.0, [(False, 4), (False, 3)]),  # one more in the interval it let go in
        (43.5, [(False, 6), (False, 3)]),
    ]
    kv = dead_gateway_kv(kill)
    assert kv is not None and kv.released and kv.held_s == pytest.approx(3.0)
    assert (kv.prefills, kv.late_429, kv.lease_s, kv.new_id) == (1, 3, 2.0, True)
    # Still held at the last poll: a lower bound. Held by none at the first: 0.
    kill.kv_polls = kill.kv_polls[:4]
    kv = dead_gateway_kv(kill)
    assert kv is not None and not kv.released and kv.held_s == pytest.approx(2.5)
    kill.kv_polls, kill.gateway_ids = [(40.05, [free, free])], ("gw-a", "gw-a")
    kv = dead_gateway_kv(kill)
    assert kv is not None and kv.released and kv.held_s == 0.0 and kv.new_id is False
    assert dead_gateway_kv(FaultEvent("kill-decode", "decode-0", 1.0, 1.0)) is None


def test_recovery_ends_at_the_last_bad_request_after_the_fault() -> None:
    records = [
        _rec(1.0, 2.0, ttft=5.0),  # before the fault: not counted
        _rec(10.5, 12.0, ttft=0.1),
        _rec(11.0, 14.0, status=503, done=False, ttft=None),  # failed
        _rec(12.5, 15.0, ttft=0.9),  # slow first token
        _rec(14.0, 16.0, ttft=0.1),
    ]
    took, proven = recovery_s(records, 10.0, 20.0, 0.5)
    assert took == pytest.approx(2.5) and proven
    took, proven = recovery_s(records, 10.0, 13.0, 0.5)
    assert took == pytest.approx(2.5) and not proven  # too close to the pause: not shown
    assert recovery_s(records[3:], 13.0, 20.0, 0.5) == (0.0, True)
    steady = [_rec(i, i + 1, ttft=0.1 + i / 100) for i in range(10)]
    assert ttft_limit(steady) == pytest.approx(0.1891 + 0.25, abs=1e-3)


def test_error_labels_name_status_and_code() -> None:
    assert _rec(0, 1).error_label() == ""
    assert _rec(0, 1, status=503, done=False, code="gateway_overloaded").error_label() == (
        "503 gateway_overloaded"
    )
    assert _rec(0, 1, status=0, done=False).error_label() == "0"
    assert _rec(0, 1, done=False).error_label() == "200 broken"
    assert _rec(0, 1, code="upstream_error").error_label() == "200 upstream_error"
    assert _rec(0, 0, status=DROPPED, done=False).error_label() == "dropped"


def test_spread_cells_show_median_and_range() -> None:
    assert spread_cell([1.0, 3.0, 2.0]) == "2.0 (1.0-3.0)"
    assert spread_cell([2.0, 2.0, 2.0]) == "2.0"
    assert spread_cell([0, 1, 0], 0) == "0 (0-1)"
    assert spread_cell([math.nan, 4.0]) == "4.0"
    assert spread_cell([math.nan]) == "n/a"
    assert codes_cell([{"200 broken": 1}, {}, {"200 broken": 2, "0": 1}]) == ("200 broken x3, 0 x1")
    assert codes_cell([{}, {}]) == "-"
    assert held_cell([{}, {}]) == "0"
    assert held_cell([{}, {"gw_pending": 1.0}]) == "run 1: 0; run 2: gw_pending=1"


def _result(seed: int) -> ChaosResult:
    plan = ChaosPlan(faults=("kill-decode", "kill-gateway"), seed=seed)
    steady = [_rec(i * 0.5, i * 0.5 + 3, ttft=0.1) for i in range(20)]
    records = [
        *steady,
        # kill-decode at 20: one stream stalls 1.2 s (migrated), one request slow.
        _rec(19.0, 24.0, gaps=[(19.95, 21.15)]),
        _rec(20.5, 23.0, ttft=1.5),
        _rec(22.0, 25.0),
        # kill-gateway (slot 1) at 40: the stream open on it breaks; a refused one retried.
        _rec(39.0, 40.0, done=False, last=39.9, gateway=1),
        _rec(41.0, 44.0, status=503, done=False, ttft=None, code="gateway_overloaded"),
    ]
    faults = [
        FaultEvent("kill-decode", "decode-0", 20.0, 20.0, 23.0, 32.0, 37.0, 37.5),
        FaultEvent(
            "kill-gateway",
            "gateway-1",
            40.0,
            40.0,
            41.0,
            52.0,
            53.0,
            53.5,
            held={"gw_pending": 0.0, "redis_slot_leases": float(seed)},
            open_at_fault=3,
            gateway_ids=("gw-a", "gw-b"),
            lease_s=2.0,
            kv_polls=[(40.0, [(True, 0), (False, 0)]), (42.6, [(False, 0), (False, 0)])],
        ),
    ]
    shed = [_rec(61 + i / 10, 61.1 + i / 10, status=503, done=False, ttft=None,
                 code="gateway_overloaded") for i in range(9)]  # fmt: skip
    shed[0].retry_after = None
    for r in shed[1:]:
        r.retry_after = "1"
    overload = OverloadResult(
        label="defaults",
        capacity_rps=5.0, rate_rps=50.0, began_s=60.0, ended_s=80.0,
        records=[*shed, _rec(60.5, 64.0)], probes=[(60.0 + i, 0.001 * (i + 1)) for i in range(10)],
        idle_probe_s=0.0005, rss=[RssSample(0, 70 * 1024, 0), RssSample(1, 90 * 1024, 5),
                                  RssSample(2, 80 * 1024, 10)],
        loop_lag=[(0.001, 150.0), (0.01, 190.0), (0.025, 198.0), (0.05, 200.0),
                  (float("inf"), 200.0)],
    )  # fmt: skip
    return ChaosResult(plan, records, faults, {}, (0.0, 15.0), [overload], 300.0, (0.5, 1.5))


def test_rows_count_errors_stalls_recovery_and_what_is_held() -> None:
    decode, gateway = fault_rows(_result(0))
    assert (decode.errors, decode.unexpected) == (0, 0) and decode.stall_s == pytest.approx(1.2)
    # Of the three streams open in the window one stalled 1.2 s; the one in flight at the
    # kill is the one that stalled across it.
    assert decode.stall_p99_s == pytest.approx(0.98 * 1.2)
    assert decode.streams is not None and decode.streams.stalled == 1
    assert (decode.streams.stalled_bad, decode.streams.in_flight_bad) == (0, 0)
    assert gateway.streams is None and decode.dead_kv is None
    assert gateway.dead_kv is not None and gateway.dead_kv.held_s == pytest.approx(2.6)
    assert decode.recover_s == pytest.approx(0.5) and decode.recover_proven
    assert decode.whole_s == pytest.approx(3.0) and decode.held_ok
    # The stream open on the killed gateway may fail; the 503 after it may not.
    assert (gateway.errors, gateway.unexpected) == (2, 1)
    assert gateway.codes == {"200 broken": 1, "503 gateway_overloaded": 1}
    assert gateway.held_ok and gateway.open_at_fault == 3
    assert not fault_rows(_result(2))[1].held_ok
    o = overload_row(_result(0).overloads[0])
    assert (o.requests, o.ok, o.shed, o.shed_with_retry_after) == (10, 1, 9, 8)
    assert o.shed_at_once == 9
    assert o.first_shed_s == pytest.approx(1.1) and o.shed_p50_s == pytest.approx(0.1)
    assert (o.rss_start_mib, o.rss_peak_mib, o.rss_end_mib) == (70, 90, 80)
    assert o.probe_p99_ms == pytest.approx(9.91)
    assert o.loop_lag_p99_ms == 25.0  # 198 of 200 within 25 ms: the 99th is in that bucket


def test_the_markdown_has_a_row_per_fault_and_the_overload_with_spreads() -> None:
    text = markdown([_result(0), _result(1), _result(2)], "pdgate bench chaos",
                    date="2026-11-26", machine="2 cores, 24 GiB, CPU, sim engine")  # fmt: skip
    assert text.startswith("`pdgate bench chaos` — 2026-11-26; 2 cores, 24 GiB, CPU, sim engine")
    decode_row = "| 1. kill -9 a decode mid-stream, start a replacement | 3 | 0 | 0 | - |"
    assert decode_row + " 1.20 | 1.18 |" in text  # the longest stall, then the p99
    assert "kill-decode: [1, 1, 1] streams stalled across the fault" in text
    assert "[0, 0, 0] of them failed or missed their 10 s TTFT deadline" in text
    assert "kill-gateway: the dead gateway's KV held for [2.6, 2.6, 2.6] s after the kill" in text
    assert "(lease 2 s; held by [1, 1, 1] prefills at the kill)" in text
    assert "past the lease: [0, 0, 0]; the restarted gateway had a new fleet id" in text
    assert "| 2. kill -9 a gateway, restart it | 2 | 2 | 1 |" in text
    assert "| 200 broken x3, 503 gateway_overloaded x3 |" in text
    assert "run 1: 0; run 2: redis_slot_leases=1; run 3: redis_slot_leases=2" in text
    assert "| 10x capacity, defaults | 50.0 | 5.0 | 10 | 1 | 90.0 | 88.9 | 100.0 |" in text
    assert "| 0.10 / 0.10 | 25.0 |" in text  # shed answered p50 / p99, then the loop lag
    assert "| 70.0 / 90.0 / 80.0 |" in text


async def test_the_reader_keeps_gaps_ttft_and_the_in_band_error_code() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"id":"1","choices":[{"text":"a"}]}\n\n')
        await resp.write(b'data: {"id":"1","choices":[{"text":"b"}]}\n\nda')
        await asyncio.sleep(0.4)  # a stall, and a "data:" split over two reads
        await resp.write(b'ta: {"id":"1","choices":[{"text":"c"}]}\n\n')
        error = {"error": {"message": "x", "type": "api_error", "code": "upstream_error"}}
        await resp.write(b"data: " + orjson.dumps(error) + b"\n\n")
        return resp

    app = web.Application()
    app.router.add_get("/", handler)
    record = StreamRecord(issued_s=0.0, status=200)
    async with served(app) as url, aiohttp.ClientSession() as session:
        origin = start = time.monotonic()
        async with session.get(url + "/") as resp:
            await read_stream(resp, record, origin, start)
    assert record.events == 4 and record.errored and record.code == "upstream_error"
    assert not record.done and record.error_label() == "200 upstream_error"
    assert len(record.gaps) == 1 and record.gaps[0][1] - record.gaps[0][0] > 0.35
    # The first token before the stall (the start is the origin here).
    assert record.ttft_s is not None and record.ttft_s <= record.gaps[0][0]


async def test_a_gateway_s_fleet_id_comes_from_its_health_or_is_empty() -> None:
    """The kill-gateway step reads the gateway's open requests and its fleet id from one
    /health; a gateway that does not answer (or answers an error) says nothing."""
    answers = [web.json_response({"pending": 3, "gateway_id": "gw-1"}), web.Response(status=500)]
    reads = 0

    async def health(request: web.Request) -> web.StreamResponse:
        nonlocal reads
        reads += 1
        return answers[reads - 1]

    app = web.Application()
    app.router.add_get("/health", health)
    async with served(app) as url, aiohttp.ClientSession() as session:
        first = await _health(session, url)
        assert (first["pending"], _gateway_id(first)) == (3, "gw-1")
        assert await _health(session, url) == {}  # the 500
    assert reads == 2
    assert _gateway_id(await _health_of_nothing()) == ""


async def _health_of_nothing() -> dict[str, Any]:
    """/health of a port nobody listens on (served, then closed)."""
    async with served(web.Application()) as url:
        pass
    async with aiohttp.ClientSession() as session:
        return await _health(session, url)


def test_a_plan_refuses_unknown_faults_and_a_fleet_without_spares() -> None:
    with pytest.raises(ValueError, match="unknown faults"):
        ChaosPlan(faults=("kill-router",))
    with pytest.raises(ValueError, match="two of each"):
        ChaosPlan(decodes=1)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_short_chaos_run(tmp_path: Path, run_bench: RunBench) -> None:
    """Two faults and a short overload, for real: no request may fail but those open on
    the killed gateway, nothing may stay held, and the overload is shed with Retry-After."""
    doc = tmp_path / "chaos.md"
    doc.write_text("# Chaos\n\n<!-- chaos:t:begin -->\nOLD\n<!-- chaos:t:end -->\nkept\n")
    lines = run_bench(
        ["chaos", "--quick", "--faults=kill-decode,kill-gateway", "--overload-s=3",
         f"--out={tmp_path}", f"--doc={doc}", "--kind=t"]
    )  # fmt: skip
    data = orjson.loads(lines[-1])
    decode, gateway = data["faults"]["kill-decode"][0], data["faults"]["kill-gateway"][0]
    assert decode["unexpected"] == 0 and gateway["unexpected"] == 0, data
    assert decode["held"] == {} and gateway["held"] == {}, data
    overload = data["overload"][0]
    assert overload["shed"] > 0 and overload["retry_after"] == overload["shed"], overload
    # One gateway of the fleet takes ten times the fleet's capacity while the other is
    # quiet: once the pace is known it refuses on arrival, not at each TTFT deadline.
    assert overload["shed_at_once"] > 0, overload
    text = doc.read_text()
    assert "OLD" not in text and text.endswith("kept\n") and "| 1. kill -9 a decode" in text
    assert (tmp_path / "t.csv").exists() and (tmp_path / "t.md").exists()
