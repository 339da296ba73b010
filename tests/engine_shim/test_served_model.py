"""What a shim says of its model, on real sockets: ``GET /v1/models`` in vLLM's shape with the
context length and the LoRA adapters, the registry record that declares them, requests for
an adapter through both legs, and ``/tokenize`` / ``/detokenize`` in vLLM's shapes."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from pdgate.config import Role
from pdgate.config import sim_tokenizer as tokenizer
from pdgate.engine_shim.backend import ChatPrompt
from pdgate.engine_shim.sim_engine import render_chat
from pdgate.registry.memory import MemoryRegistry
from tests.engine_shim.conftest import (
    MODEL,
    PROMPT,
    Shim,
    StartShim,
    assert_openai_error,
    prefill_leg,
)

ADAPTERS = ["sim-lora-sql", "sim-lora-poet"]
# vLLM 0.32's `ModelCard` (vllm/entrypoints/serve/engine/protocol.py), field by field.
MODEL_CARD = {
    "id",
    "object",
    "created",
    "owned_by",
    "root",
    "parent",
    "max_model_len",
    "permission",
}
FINAL, TEMPLATE = "continue_final_message", "chat_template"
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime number."},
]


async def _get(shim: Shim, path: str) -> Any:
    async with shim.http.get(shim.url + path) as resp:
        assert resp.status == 200
        return await resp.json()


@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE, Role.AGGREGATED])
async def test_models_lists_the_model_then_its_adapters_as_vllm_does(
    start_shim: StartShim, registry: MemoryRegistry, role: Role
) -> None:
    shim = await start_shim(role, max_model_len=4096, sim_lora_adapters=ADAPTERS)
    listed = await _get(shim, "/v1/models")
    assert listed["object"] == "list"
    base, *adapters = listed["data"]
    for card in listed["data"]:
        assert set(card) == MODEL_CARD, card
        assert (card["object"], card["owned_by"]) == ("model", "vllm")
        (permission,) = card["permission"]
        assert permission["object"] == "model_permission"
    assert (base["id"], base["parent"], base["max_model_len"]) == (MODEL, None, 4096)
    assert [(a["id"], a["parent"], a["max_model_len"]) for a in adapters] == [
        (name, MODEL, None) for name in ADAPTERS
    ]
    # The registry record says the same, and which side endpoints it answers.
    (record,) = await registry.snapshot()
    assert record.max_model_len == 4096
    assert record.adapters == tuple(ADAPTERS)
    assert record.endpoints == ("/tokenize", "/detokenize")


async def test_a_shim_without_adapters_lists_its_model_alone(start_shim: StartShim) -> None:
    shim = await start_shim(Role.DECODE)
    (card,) = (await _get(shim, "/v1/models"))["data"]
    assert card["id"] == MODEL and card["max_model_len"] == shim.settings.max_model_len


async def _generate(prefill: Shim, decode: Shim, model: str, prompt: str = PROMPT) -> str:
    """`prompt` through both legs for `model`: the decode's text (the prefill's first token
    is the decode's first too)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 8}
    status, first, _ = await prefill.post(prefill_leg(body))
    assert status == 200, first
    assert first["model"] == model
    status, answer, _ = await decode.post(
        {**body, "kv_transfer_params": first["kv_transfer_params"]}
    )
    assert status == 200, answer
    assert answer["model"] == model
    text: str = answer["choices"][0]["text"]
    assert text.startswith(first["choices"][0]["text"])
    return text


async def test_an_adapter_generates_text_of_its_own_through_both_legs(
    start_shim: StartShim,
) -> None:
    prefill = await start_shim(Role.PREFILL, sim_lora_adapters=ADAPTERS)
    decode = await start_shim(Role.DECODE, sim_lora_adapters=ADAPTERS)
    base = await _generate(prefill, decode, MODEL)
    sql = await _generate(prefill, decode, ADAPTERS[0])
    poet = await _generate(prefill, decode, ADAPTERS[1])
    assert len({base, sql, poet}) == 3
    assert await _generate(prefill, decode, ADAPTERS[0]) == sql  # deterministic
    # An adapter the shim does not hold is an unknown model.
    status, body, _ = await prefill.post(prefill_leg({"model": "other-lora", "prompt": PROMPT}))
    assert status == 404
    assert assert_openai_error(body)["code"] == "model_not_found"


async def _post(shim: Shim, path: str, body: Any) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with shim.http.post(shim.url + path, data=data) as resp:
        return resp.status, await resp.json()


async def test_tokenize_answers_as_vllm_and_as_the_engine_counts(start_shim: StartShim) -> None:
    shim = await start_shim(Role.PREFILL, max_model_len=4096, sim_lora_adapters=ADAPTERS)
    status, out = await _post(shim, "/tokenize", {"model": MODEL, "prompt": PROMPT})
    assert status == 200, out
    assert out == {
        "count": len(tokenizer.encode(PROMPT)),
        "max_model_len": 4096,
        "tokens": tokenizer.encode(PROMPT),
        "token_strs": None,
    }
    status, out = await _post(
        shim, "/tokenize", {"prompt": PROMPT, "return_token_strs": True, "model": ADAPTERS[1]}
    )
    assert status == 200, out
    assert out["token_strs"] == tokenizer.pieces(PROMPT)
    # A conversation is rendered with the chat template, as a chat request is: its count is
    # the prompt_tokens the engine reports for the same conversation.
    status, out = await _post(shim, "/tokenize", {"model": MODEL, "messages": CONVERSATION})
    assert status == 200, out
    assert out["tokens"] == render_chat(ChatPrompt(CONVERSATION))
    chat = {"model": MODEL, "messages": CONVERSATION}
    status, answer, _ = await shim.post(prefill_leg(chat), path="/v1/chat/completions")
    assert status == 200, answer
    assert answer["usage"]["prompt_tokens"] == out["count"]
    opened = [*CONVERSATION, {"role": "assistant", "content": "Seven is"}]
    status, out = await _post(
        shim,
        "/tokenize",
        {"messages": opened, "add_generation_prompt": False, "continue_final_message": True},
    )
    assert status == 200, out
    chat_prompt = ChatPrompt(opened, add_generation_prompt=False, continue_final_message=True)
    assert out["tokens"] == render_chat(chat_prompt)


async def test_detokenize_writes_back_what_the_engine_generated(start_shim: StartShim) -> None:
    shim = await start_shim(Role.PREFILL)
    status, answer, _ = await shim.post(prefill_leg({"prompt": PROMPT, "return_token_ids": True}))
    assert status == 200, answer
    (choice,) = answer["choices"]
    status, out = await _post(shim, "/detokenize", {"model": MODEL, "tokens": choice["token_ids"]})
    assert status == 200, out
    assert out == {"prompt": choice["text"]}
    words = "<|user|> the model, 12."
    status, out = await _post(shim, "/detokenize", {"tokens": tokenizer.encode(words)})
    assert (status, out) == (200, {"prompt": words})


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", b"not json", 400, None),
        ("/tokenize", b"[1, 2]", 400, None),
        ("/tokenize", {"model": MODEL}, 400, "prompt"),
        ("/tokenize", {"prompt": 7}, 400, "prompt"),
        ("/tokenize", {"prompt": "hi", "model": "nobody"}, 404, "model"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"messages": [{"role": "user"}]}, 400, "messages"),
        ("/tokenize", {"messages": CONVERSATION, "continue_final_message": True}, 400, FINAL),
        ("/tokenize", {"messages": CONVERSATION, "chat_template": "{{ x }}"}, 400, TEMPLATE),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": "12"}, 400, "tokens"),
        ("/detokenize", {"tokens": [tokenizer.piece_id(" Kenob")]}, 400, "tokens"),
        ("/detokenize", {"tokens": [1], "model": "nobody"}, 404, "model"),
    ],
)
async def test_bad_tokenize_requests_get_an_openai_error(
    start_shim: StartShim, path: str, body: Any, status: int, param: str | None
) -> None:
    shim = await start_shim(Role.DECODE)
    got, out = await _post(shim, path, body)
    assert got == status, out
    assert assert_openai_error(out)["param"] == param
