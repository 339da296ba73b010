"""One id per request: the body's ``id`` (every SSE event's, or the whole answer's) equals the
``x-request-id`` response header, whether the client sent one or not, streaming or not,
completions and chat; through pdgate's sim shims and through stock servers that answer with
ids of their own (vLLM: ``cmpl-`` + the id it was sent)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from pdgate.gateway.stream.ids import StreamIds
from tests._cluster import Subprocess, ThreadedCluster, gateway_url, start
from tests.registry._stock_server import StockServer

SIM_MODEL = "sim-llama-3.1-8b"
CLIENT_ID = "client-chosen-id-42"
CASES = [
    pytest.param(chat, stream, rid, id=f"{'chat' if chat else 'cmpl'}-{stream=}-{bool(rid)=}")
    for chat in (False, True)
    for stream in (False, True)
    for rid in (None, CLIENT_ID)
]


def _ids(
    url: str, model: str, *, chat: bool, stream: bool, rid: str | None
) -> tuple[str, set[str]]:
    """The response's x-request-id header and every id in its body."""
    path, body = (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "name one id"}]})
        if chat
        else ("/v1/completions", {"prompt": "name one id"})
    )
    body = {**body, "model": model, "max_tokens": 4, "stream": stream}
    headers = {"x-request-id": rid} if rid else {}
    with httpx.stream("POST", url + path, json=body, headers=headers, timeout=30) as resp:
        raw = resp.read()
        assert resp.status_code == 200, raw
        header = resp.headers["x-request-id"]
    if not stream:
        return header, {orjson.loads(raw)["id"]}
    events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    parsed: list[dict[str, Any]] = [orjson.loads(e) for e in events[:-1]]
    assert parsed and all("error" not in e for e in parsed), parsed
    return header, {e["id"] for e in parsed}


def _check(header: str, ids: set[str], *, chat: bool, rid: str | None) -> None:
    assert ids == {header}
    if rid is not None:
        assert header == rid
    else:
        assert header.startswith("chatcmpl-" if chat else "cmpl-")


@pytest.fixture(scope="module")
def sim() -> Iterator[str]:
    with ThreadedCluster(prefills=1, decodes=1) as cluster:
        yield cluster.url


@pytest.mark.parametrize(("chat", "stream", "rid"), CASES)
def test_one_id_through_the_sim_shims(sim: str, chat: bool, stream: bool, rid: str | None) -> None:
    header, ids = _ids(sim, SIM_MODEL, chat=chat, stream=stream, rid=rid)
    _check(header, ids, chat=chat, rid=rid)


@pytest.fixture(scope="module")
def stock() -> Iterator[tuple[str, str]]:
    model = f"stock-{uuid.uuid4().hex[:8]}"
    servers = [StockServer(model).start(), StockServer(model).start()]
    procs: list[Subprocess] = []
    try:
        args = ["gateway", "--port", "0", "--prefill", servers[0].url, "--decode", servers[1].url]
        yield gateway_url(start(procs, args, {})), model
    finally:
        for p in procs:
            p.kill()
        for s in servers:
            s.kill()


@pytest.mark.parametrize(("chat", "stream", "rid"), CASES)
def test_one_id_through_a_stock_decode_that_answers_with_its_own(
    stock: tuple[str, str], chat: bool, stream: bool, rid: str | None
) -> None:
    url, model = stock
    header, ids = _ids(url, model, chat=chat, stream=stream, rid=rid)
    _check(header, ids, chat=chat, rid=rid)


# -- the stream rewrite, chunk by chunk ------------------------------------------------------


def _event(rid: str, text: str, sep: bytes = b"\n\n") -> bytes:
    return b"data: " + orjson.dumps({"id": rid, "choices": [{"text": text}]}) + sep


def _run(ids: StreamIds, chunks: list[bytes]) -> bytes:
    return b"".join(ids.feed(c) for c in chunks) + ids.flush()


def test_a_foreign_id_is_replaced_even_when_split_across_reads() -> None:
    stream = b": ping\n\n" + _event("cmpl-up", "a") + _event("cmpl-up", "b") + b"data: [DONE]\n\n"
    for size in (1, 3, 7, len(stream)):
        chunks = [stream[i : i + size] for i in range(0, len(stream), size)]
        out = _run(StreamIds("req-1"), chunks)
        assert out == stream.replace(b'"cmpl-up"', b'"req-1"'), size


def test_whole_events_go_out_at_once_and_crlf_streams_too() -> None:
    ids = StreamIds("req-1")
    first = _event("up", "a", b"\r\n\r\n")
    assert ids.feed(first + b"data: {") == first.replace(b'"up"', b'"req-1"')
    assert ids.feed(b'"id":"up"}\r\n\r\n') == b'data: {"id":"req-1"}\r\n\r\n'


def test_a_stream_that_already_carries_the_id_passes_untouched() -> None:
    ids = StreamIds("req-1")
    first = _event("req-1", "a")
    assert ids.feed(first + b"data: {partial") == first + b"data: {partial"
    later = _event("other", "b")
    assert ids.feed(later) is later  # no copy, no search once the id is known to match


def test_whole_event_chunks_after_the_first_are_rewritten_and_split_ones_still_joined() -> None:
    ids = StreamIds("req-1")
    assert ids.feed(_event("up", "a")) == _event("req-1", "a")
    assert ids.feed(_event("up", "b")) == _event("req-1", "b")  # whole: rewritten at once
    split = _event("up", "c")
    assert ids.feed(split[:9]) == b""  # part of an id: held back
    assert ids.feed(split[9:] + _event("up", "d")) == _event("req-1", "c") + _event("req-1", "d")
    assert ids.flush() == b""
