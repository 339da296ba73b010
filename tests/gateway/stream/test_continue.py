"""`Progress` (gateway/stream/continuation.py): a stream's usual events taken as bytes say
and record what parsing them would have, and anything else is left to the parse."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from pdgate.config.openai_api import Api
from pdgate.gateway.stream.continuation import Progress

RID = "cmpl-gateway-1"


def _vllm(i: int, text: str = " w", *, decode_id: str = "cmpl-decode-0", **extra: Any) -> bytes:
    """A completions chunk as vLLM 0.32 writes one asked for ``return_token_ids``: compact,
    every choice field set (``exclude_unset``), the prompt's ids in the first only."""
    choice: dict[str, Any] = {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": None,
        "stop_reason": None,
        "prompt_token_ids": None,
        "token_ids": [i],
    }
    choice.update(extra)
    return orjson.dumps({"id": decode_id, "object": "text_completion", "created": 7,
                         "model": "m", "choices": [choice]})  # fmt: skip


def _chat(i: int, text: str = " w") -> bytes:
    choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None,
              "token_ids": [i]}  # fmt: skip
    return orjson.dumps({"id": "chatcmpl-d", "object": "chat.completion.chunk", "created": 7,
                         "model": "m", "choices": [choice]})  # fmt: skip


def _started(api: Api = Api.COMPLETIONS, **kwargs: Any) -> Progress:
    """A progress past its stream's first event (the prompt's ids), which is always parsed."""
    progress = Progress(api, request_id=RID, max_tokens=100, **kwargs)
    first = _chat(1) if api is Api.CHAT else _vllm(1, prompt_token_ids=[5, 6])
    event = orjson.loads(first)
    if api is Api.CHAT:
        event["prompt_token_ids"] = [5, 6]
    assert progress.passthrough_bytes(first) is None
    progress.passthrough(event)
    return progress


def _parsed(progress: Progress, data: bytes) -> dict[str, Any]:
    event = orjson.loads(data)
    progress.passthrough(event)
    return event


@pytest.mark.parametrize("client_ids", [False, True])
@pytest.mark.parametrize("api", [Api.COMPLETIONS, Api.CHAT])
def test_usual_events_as_bytes_say_what_the_parse_says(api: Api, client_ids: bool) -> None:
    fast, slow = _started(api, client_ids=client_ids), _started(api, client_ids=client_ids)
    for i in range(2, 6):
        data = _chat(i, f" t{i}") if api is Api.CHAT else _vllm(i, f" t{i}")
        raw = fast.passthrough_bytes(data)
        assert raw is not None
        assert orjson.loads(raw) == _parsed(slow, data)
        assert raw.startswith(b'{"id":"' + RID.encode() + b'"')
    assert fast.ids == slow.ids == [1, 2, 3, 4, 5]
    assert fast.remaining == slow.remaining == 95
    assert fast.events == slow.events
    forward = {"model": "m", "prompt": "p", "max_tokens": 100}
    assert fast.body(forward) == slow.body(forward)


def test_a_stream_with_the_request_id_is_passed_as_it_came() -> None:
    progress = Progress(Api.COMPLETIONS, request_id=RID, max_tokens=9, client_ids=True)
    progress.passthrough(orjson.loads(_vllm(1, decode_id=RID, prompt_token_ids=[5])))
    data = _vllm(2, decode_id=RID)
    assert progress.passthrough_bytes(data) == data


@pytest.mark.parametrize(
    "data",
    [
        _vllm(2, finish_reason="length"),
        _vllm(2, logprobs={"tokens": [" w"], "token_logprobs": [-0.5], "text_offset": [0]}),
        _vllm(2, prompt_token_ids=[5, 6]),
        _vllm(2, decode_id="cmpl-another-decode"),
        _vllm(2).replace(b"}]}", b'}],"usage":{"prompt_tokens":2,"completion_tokens":2}}'),
        _vllm(2).replace(b'"choices":[', b'"choices":[{"index":1,"text":"","token_ids":[9]},'),
        orjson.dumps(orjson.loads(_vllm(2)), option=orjson.OPT_INDENT_2),  # not compact
        _vllm(2).replace(b',"token_ids":[2]', b""),  # no ids: the parse marks them incomplete
        b'{"error":{"message":"boom","type":"internal_error","code":500}}',
    ],
    ids=[
        "finish",
        "logprobs",
        "prompt-ids",
        "other-id",
        "usage",
        "two-choices",
        "indented",
        "no-ids",
        "error",
    ],
)
def test_what_only_a_parse_can_tell_is_left_to_it(data: bytes) -> None:
    progress = _started()
    assert progress.passthrough_bytes(data) is None
    assert progress.events == 1 and progress.ids == [1]


def test_stop_strings_and_the_first_event_are_parsed() -> None:
    assert (
        Progress(Api.COMPLETIONS, request_id=RID, max_tokens=9).passthrough_bytes(_vllm(1)) is None
    )
    with_stops = _started(stops=("END",))
    assert with_stops.passthrough_bytes(_vllm(2)) is None


def test_ids_stay_in_order_across_bytes_and_parsed_events() -> None:
    progress = _started()
    assert progress.passthrough_bytes(_vllm(2)) is not None
    _parsed(progress, _vllm(3, finish_reason="length"))
    assert progress.passthrough_bytes(_vllm(4)) is not None
    assert progress.passthrough_bytes(_vllm(5).replace(b"[5]", b"[]")) is not None  # no token
    assert progress.remaining == 100 - 4
    assert progress.ids == [1, 2, 3, 4]
    assert progress.finish == "length"


def test_ids_that_are_not_ids_make_the_stream_one_not_to_continue() -> None:
    progress = _started()
    assert progress.passthrough_bytes(_vllm(2).replace(b"[2]", b'[2,"x"]')) is not None
    assert progress.ids == [1]
    assert not progress.ids_complete
    assert progress.why_not({"prompt": "p"}) == "a chunk came without its token ids"


@pytest.mark.parametrize(
    "text", ['"quoted"', ',"token_ids":[7]', "]}]}", '"choices":[{"index":0,', "\\", "\u00e9\n"]
)
def test_text_that_spells_the_markers_is_still_the_text(text: str) -> None:
    """Inside a JSON string every quote is escaped, so the text cannot fake the shape."""
    fast, slow = _started(), _started()
    data = _vllm(2, text)
    raw = fast.passthrough_bytes(data)
    assert raw is not None
    assert orjson.loads(raw) == _parsed(slow, data)
    assert orjson.loads(raw)["choices"][0]["text"] == text
    assert fast.ids == slow.ids == [1, 2]


def test_parsed_ids_behind_unparsed_ones_keep_their_place_without_a_parse() -> None:
    progress = _started()
    assert progress.passthrough_bytes(_vllm(2)) is not None
    _parsed(progress, _vllm(3, finish_reason="length"))
    _parsed(progress, _vllm(4, finish_reason="length").replace(b"[4]", b"[]"))
    assert progress._raw_ids  # nothing parsed on the way: the usual stream never needs them
    assert progress.ids == [1, 2, 3]


@pytest.mark.vllm
def test_stock_vllm_chunks_are_the_usual_shape() -> None:
    """vLLM's own response classes, filled and written as its streaming code does (0.32:
    ``model_dump_json(exclude_unset=True)``): its token chunks take the bytes path, and say
    what the parse says. Runs in the vllm suite (it fails under ``CI=true`` without vLLM)."""
    from tests.vllm.conftest import _require_vllm

    _require_vllm()
    from vllm.entrypoints.generate.base.protocol import DeltaMessage
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponseStreamChoice,
        ChatCompletionStreamResponse,
    )
    from vllm.entrypoints.openai.completion.protocol import (
        CompletionResponseStreamChoice,
        CompletionStreamResponse,
    )

    def completion(i: int, prompt_ids: list[int] | None = None) -> bytes:
        choice = CompletionResponseStreamChoice(
            index=0, text=f" t{i}", logprobs=None, finish_reason=None, stop_reason=None,
            prompt_token_ids=prompt_ids, token_ids=[i],
        )  # fmt: skip
        chunk = CompletionStreamResponse(
            id="cmpl-vllm", object="text_completion", created=7, model="m", choices=[choice]
        )
        return chunk.model_dump_json(exclude_unset=True).encode()

    def chat(i: int) -> bytes:
        choice = ChatCompletionResponseStreamChoice(
            index=0, delta=DeltaMessage(content=f" t{i}"), logprobs=None, finish_reason=None,
            token_ids=[i],
        )  # fmt: skip
        chunk = ChatCompletionStreamResponse(
            id="chatcmpl-vllm", object="chat.completion.chunk", created=7, choices=[choice],
            model="m",
        )  # fmt: skip
        return chunk.model_dump_json(exclude_unset=True).encode()

    for api, write in ((Api.COMPLETIONS, completion), (Api.CHAT, chat)):
        fast = Progress(api, request_id=RID, max_tokens=9)
        slow = Progress(api, request_id=RID, max_tokens=9)
        for progress in (fast, slow):
            first = orjson.loads(completion(1, [5, 6]) if api is Api.COMPLETIONS else chat(1))
            if api is Api.CHAT:
                first["prompt_token_ids"] = [5, 6]  # vLLM's chat: on the first event
            progress.passthrough(first)
        for i in (2, 3):
            data = write(i)
            raw = fast.passthrough_bytes(data)
            assert raw is not None, data
            assert orjson.loads(raw) == _parsed(slow, data)
        assert fast.ids == slow.ids == [1, 2, 3]


def _no_ids(i: int, **extra: Any) -> bytes:
    """A chunk of an engine that sends no token ids (it ignores ``return_token_ids``)."""
    data = _vllm(i, f" t{i}", **extra).replace(f',"token_ids":[{i}]'.encode(), b"")
    return data.replace(b',"prompt_token_ids":null', b"")


@pytest.mark.parametrize("client_ids", [False, True])
def test_an_engine_without_ids_has_its_usual_events_passed_as_bytes(client_ids: bool) -> None:
    """Once a chunk came without ids the stream cannot be continued; its usual events then
    go out as they came, with the request's id, and say what the parse would have."""
    fast, slow = _started(client_ids=client_ids), _started(client_ids=client_ids)
    first = _no_ids(2)
    assert fast.passthrough_bytes(first) is None  # while ids may still come: the parse
    _parsed(fast, first), _parsed(slow, first)
    for i in range(3, 6):
        data = _no_ids(i)
        raw = fast.passthrough_bytes(data)
        assert raw is not None
        assert orjson.loads(raw) == _parsed(slow, data)
        assert raw.startswith(b'{"id":"' + RID.encode() + b'"')
    assert fast.events == slow.events == 5
    assert fast.ids == slow.ids == [1] and not fast.ids_complete
    assert fast.why_not({"prompt": "p"}) == "a chunk came without its token ids"
    # What only a parse can tell still goes to it.
    for data in (
        _no_ids(6, finish_reason="length"),
        _no_ids(6).replace(b"}]}", b'}],"usage":{"prompt_tokens":2,"completion_tokens":2}}'),
        _no_ids(6, logprobs={"tokens": [" w"], "token_logprobs": [-0.5], "text_offset": [0]}),
        _no_ids(6).replace(b'"index":0', b'"index":1'),
    ):
        assert fast.passthrough_bytes(data) is None
    assert fast.events == 5
