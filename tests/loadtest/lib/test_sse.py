"""The SSE client side (loadtest/lib/sse.py): the Locust line parser's timing and verdicts,
and the aiohttp reader against a real server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest
from aiohttp import web

from pdgate.loadtest.lib.sse import MAX_ITL_SAMPLES, StreamTimer, post_stream
from tests.loadtest._http import served


def _text(text: str) -> bytes:
    chunk = {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": text}]}
    return b"data: " + orjson.dumps(chunk)


def _usage(tokens: int) -> bytes:
    chunk = {"id": "cmpl-1", "choices": [], "usage": {"completion_tokens": tokens}}
    return b"data: " + orjson.dumps(chunk)


def test_timings_of_a_complete_stream() -> None:
    timer = StreamTimer(start=10.0)
    timer.feed(_text(" a"), 10.1)
    timer.feed(b"", 10.1)  # the blank line between events
    timer.feed(_text(" b"), 10.15)
    timer.feed(_text(" c"), 10.3)
    timer.feed(_usage(3), 10.3)
    timer.feed(b"data: [DONE]", 10.5)
    result = timer.finish(11.0)
    assert result.failure is None
    assert result.ttft_s == pytest.approx(0.1)
    assert result.itl_s == pytest.approx([0.05, 0.15])
    assert result.e2e_s == pytest.approx(0.5)  # [DONE], not the end of the body
    assert result.completion_tokens == 3
    assert result.tpot_s == pytest.approx((0.5 - 0.1) / 2)


def test_usage_token_count_wins_over_event_count() -> None:
    timer = StreamTimer(start=0.0)
    timer.feed(_text(" two tokens"), 1.0)
    timer.feed(_text(" more"), 2.0)
    timer.feed(_usage(5), 2.0)
    timer.feed(b"data: [DONE]", 3.0)
    result = timer.finish(3.0)
    assert result.text_events == 2
    assert result.tpot_s == pytest.approx((3.0 - 1.0) / 4)


def test_in_band_error_is_a_failure() -> None:
    timer = StreamTimer(start=0.0)
    timer.feed(_text(" a"), 0.1)
    timer.feed(b'data: {"error": {"message": "the decode instance failed mid-stream"}}', 0.2)
    timer.feed(b"data: [DONE]", 0.2)
    result = timer.finish(0.2)
    assert result.failure == "in-band error: the decode instance failed mid-stream"


def test_missing_done_is_a_failure_and_e2e_is_the_end_of_body() -> None:
    timer = StreamTimer(start=0.0)
    timer.feed(_text(" a"), 0.1)
    result = timer.finish(0.7)
    assert result.failure is not None and "[DONE]" in result.failure
    assert result.e2e_s == pytest.approx(0.7)


def test_no_text_is_a_failure() -> None:
    timer = StreamTimer(start=0.0)
    timer.feed(b"data: [DONE]", 0.1)
    assert timer.finish(0.1).failure == "no text in the stream"


def test_comments_fields_and_malformed_data() -> None:
    timer = StreamTimer(start=0.0)
    timer.feed(b": keep-alive", 0.05)
    timer.feed(b"event: message", 0.05)
    timer.feed(_text(" a"), 0.1)
    timer.feed(b"data: {not json", 0.2)
    timer.feed(b"data: [DONE]", 0.3)
    result = timer.finish(0.3)
    assert result.ttft_s == pytest.approx(0.1)
    assert result.failure == "in-band error: malformed SSE data"


def test_itl_samples_are_bounded() -> None:
    timer = StreamTimer(start=0.0)
    for i in range(MAX_ITL_SAMPLES + 10):
        timer.feed(_text("x"), i * 0.001)
    timer.feed(b"data: [DONE]", 100.0)
    result = timer.finish(100.0)
    assert len(result.itl_s) == MAX_ITL_SAMPLES
    assert result.text_events == MAX_ITL_SAMPLES + 10


def test_long_error_messages_are_truncated() -> None:
    timer = StreamTimer(start=0.0)
    timer.feed(b'data: {"error": {"message": "' + b"x" * 1000 + b'"}}', 0.1)
    result = timer.finish(0.1)
    assert result.error is not None and len(result.error) == 200


# -- post_stream, against a real server over a real socket ---------------------------------

_TOKEN = b'data: {"id":"cmpl-1","choices":[{"index":0,"text":" hi"}]}\n\n'
_DONE = b"data: [DONE]\n\n"


async def _pieces(request: web.Request, *parts: bytes) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await resp.prepare(request)
    for part in parts:
        await resp.write(part)
        await asyncio.sleep(0.02)  # separate reads on the client
    return resp


async def _split(request: web.Request) -> web.StreamResponse:
    # Every marker cut in two across reads: the first token's, a data: prefix, [DONE]'s.
    return await _pieces(
        request, _TOKEN[:8], _TOKEN[8:] + _TOKEN[:2], _TOKEN[2:] + _DONE[:9], _DONE[9:]
    )


async def _error(request: web.Request) -> web.StreamResponse:
    return await _pieces(request, _TOKEN, b'data: {"error": {"message": "decode lost"}}\n\n', _DONE)


async def _drop(request: web.Request) -> web.StreamResponse:
    resp = await _pieces(request, _TOKEN)
    assert request.transport is not None
    request.transport.close()  # mid-stream, no [DONE]
    return resp


async def _busy(request: web.Request) -> web.Response:
    return web.json_response({"error": {"message": "no free slot"}}, status=429)


@pytest.fixture
async def sse_server() -> AsyncIterator[str]:
    app = web.Application()
    for path, handler in (
        ("/split", _split),
        ("/error", _error),
        ("/drop", _drop),
        ("/busy", _busy),
    ):
        app.router.add_post(path, handler)
    async with served(app) as url:
        yield url


async def test_markers_split_across_reads_are_found(sse_server: str) -> None:
    async with aiohttp.ClientSession() as session:
        out = await post_stream(session, sse_server + "/split", b"{}")
    assert out.status == 200 and out.done and not out.errored and out.completed
    assert out.ttft_s is not None and 0.015 < out.ttft_s < out.end
    assert out.events == 2  # two token events; [DONE] is not one


async def test_ttft_counts_from_the_given_start(sse_server: str) -> None:
    async with aiohttp.ClientSession() as session:
        earlier = time.monotonic() - 5.0  # e.g. a prefill leg before this call
        out = await post_stream(session, sse_server + "/split", b"{}", start=earlier)
    assert out.ttft_s is not None and out.ttft_s > 5.0


async def test_failures_are_outcomes_not_exceptions(sse_server: str) -> None:
    async with aiohttp.ClientSession() as session:
        errored = await post_stream(session, sse_server + "/error", b"{}")
        dropped = await post_stream(session, sse_server + "/drop", b"{}")
        busy = await post_stream(session, sse_server + "/busy", b"{}")
        refused = await post_stream(session, "http://127.0.0.1:9/v1/completions", b"{}")
    assert errored.errored and errored.done and not errored.completed
    assert dropped.ttft_s is not None and not dropped.done and not dropped.completed
    assert busy.status == 429 and busy.ttft_s is None and not busy.completed
    assert refused.status == 0 and not refused.completed
