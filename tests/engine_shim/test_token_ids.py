"""Token ids (vLLM's ``return_token_ids``) and the sim engine's autoregression over them.

A stream that breaks mid-way is re-submitted as prompt + the tokens already generated (the
gateway's decode migration); greedy output must then continue exactly where it stopped. The
sim's next token is a function of the whole context, so that holds for it as for a real model:
checked on the engine's text model directly and through a real prefill shim and decode worker.
"""

from __future__ import annotations

from typing import Any

from pdgate.config import sim_tokenizer as tokenizer
from pdgate.config.wire import CHAT_PATH
from pdgate.engine_shim._sim_text import WORDS, Context, next_token, token_logprobs
from tests.engine_shim.conftest import MODEL, Shim, prefill_leg

PROMPT = "Tell me a story about disaggregated inference, with a moral at the end."
N = 24


def _generate(prompt: list[int], n: int) -> list[tuple[int, str]]:
    context = Context(prompt)
    out = []
    for _ in range(n):
        token_id, text = next_token(context)
        out.append((token_id, text))
        context.append(token_id)
    return out


def test_the_next_token_is_a_function_of_the_whole_context() -> None:
    prompt = tokenizer.encode(PROMPT)
    full = _generate(prompt, N)
    ids = [t for t, _ in full]
    for k in (1, 5, N - 1):
        assert _generate(prompt + ids[:k], N - k) == full[k:], k
    # The whole context counts, not just its tail: another prompt with the same last tokens
    # goes elsewhere, and so does the same prompt one token shorter at the front.
    assert _generate(tokenizer.encode("Different start. " + PROMPT), N) != full
    assert _generate(prompt[1:], N) != full
    # Text is made of the sim's words, ids are the ids of those words, and it is not stuck
    # on a word (a hash of the context, not of a fixed window).
    assert {text for _, text in full} <= set(WORDS)
    assert len({text for _, text in full}) > N // 3
    assert all(tokenizer.piece_id(text) == token_id for token_id, text in full)


def test_logprobs_follow_the_context_too() -> None:
    prompt = tokenizer.encode(PROMPT)
    ids = [t for t, _ in _generate(prompt, 8)]
    a = token_logprobs(Context(prompt + ids[:5]), 3)
    again = token_logprobs(Context(prompt + ids[:5]), 3)
    assert a == again
    assert a.token == _generate(prompt + ids[:5], 1)[0][1]
    assert a.top[0][0] == a.token  # the generated word is the most likely one


async def _run(prefill: Shim, decode: Shim, prompt: Any, max_tokens: int) -> dict[str, Any]:
    """One request through both legs with ``return_token_ids``: the prefill's answer, the
    decode's events, and the streamed text and ids per chunk."""
    first = await prefill.prefilled(prompt, return_token_ids=True)
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "return_token_ids": True,
        "logprobs": 2,
        "kv_transfer_params": first["kv_transfer_params"],
    }
    events = await decode.stream(body)
    assert events[-1] == "[DONE]"
    chunks = [e["choices"][0] for e in events[:-1]]
    return {"prefill": first["choices"][0], "chunks": chunks}


async def test_prefill_and_decode_return_token_ids_as_vllm_does(pair: tuple[Shim, Shim]) -> None:
    prefill, decode = pair
    run = await _run(prefill, decode, PROMPT, N)
    prompt_ids = tokenizer.encode(PROMPT)
    expected = _generate(prompt_ids, N)
    # The prefill's choice: the prompt's ids and its one token's.
    assert run["prefill"]["prompt_token_ids"] == prompt_ids
    assert run["prefill"]["token_ids"] == [expected[0][0]]
    # The decode's stream: the prompt's ids in the first chunk only, each chunk its tokens'.
    chunks = run["chunks"]
    assert chunks[0]["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == [t for t, _ in expected]
    assert "".join(c["text"] for c in chunks) == "".join(text for _, text in expected)


async def test_a_resubmitted_stream_continues_exactly_where_it_stopped(
    pair: tuple[Shim, Shim],
) -> None:
    prefill, decode = pair
    whole = await _run(prefill, decode, PROMPT, N)
    prompt_ids = whole["chunks"][0]["prompt_token_ids"]
    ids = [t for c in whole["chunks"] for t in c["token_ids"]]
    texts = [c["text"] for c in whole["chunks"]]
    logprobs = [c["logprobs"]["token_logprobs"] for c in whole["chunks"]]
    for k in (1, 9, N - 1):
        # As the gateway migrates a stream that broke after k tokens: prompt + those k ids
        # (a token-id prompt), k fewer tokens to go.
        rest = await _run(prefill, decode, prompt_ids + ids[:k], N - k)
        assert [t for c in rest["chunks"] for t in c["token_ids"]] == ids[k:], k
        assert "".join(c["text"] for c in rest["chunks"]) == "".join(texts[k:]), k
        assert [c["logprobs"]["token_logprobs"] for c in rest["chunks"]] == logprobs[k:], k
        assert rest["prefill"]["token_ids"] == [ids[k]]


async def test_chat_returns_token_ids_in_vllms_chat_shape(pair: tuple[Shim, Shim]) -> None:
    prefill, decode = pair
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "return_token_ids": True,
    }
    status, first, _ = await prefill.post(prefill_leg(chat), CHAT_PATH)
    assert status == 200, first
    assert first["object"] == "chat.completion"
    prompt_ids = first["prompt_token_ids"]  # top level in chat, as vLLM puts it
    assert len(first["choices"][0]["token_ids"]) == 1
    body = {
        **chat,
        "max_tokens": 5,
        "stream": True,
        "kv_transfer_params": first["kv_transfer_params"],
    }
    head, *chunks, done = await decode.stream(body, CHAT_PATH)
    assert done == "[DONE]"
    assert head["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert head["prompt_token_ids"] == prompt_ids
    ids = [t for e in chunks for t in e["choices"][0]["token_ids"]]
    assert len(ids) == 5 and ids[0] == first["choices"][0]["token_ids"][0]
    assert all("prompt_token_ids" not in e for e in chunks)


async def test_without_the_field_no_ids_are_sent(pair: tuple[Shim, Shim]) -> None:
    prefill, decode = pair
    first = await prefill.prefilled(PROMPT)
    assert "token_ids" not in first["choices"][0]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": True,
            "kv_transfer_params": first["kv_transfer_params"]}  # fmt: skip
    events = await decode.stream(body)
    assert all("token_ids" not in e["choices"][0] for e in events[:-1])
