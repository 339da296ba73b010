"""The Locust user's SSE timing and verdicts (loadtest/sse_metrics.py), without Locust."""

from __future__ import annotations

import orjson
import pytest

from loadtest.sse_metrics import MAX_ITL_SAMPLES, StreamTimer


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
