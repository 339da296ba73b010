"""Greedy output of the tiny model from one aggregated vLLM engine (no disaggregation, no KV
connector): the reference a disaggregated run must reproduce token for token.

Run as ``python -m tests.vllm._reference MODEL_DIR MAX_TOKENS PROMPT...``; prints one JSON
object per prompt (``token_ids``, ``text``, ``finish_reason``, and per token the sampled
token's text and logprob as ``logprobs``). An argument ``chat:<JSON messages>`` is a chat
instead, answered by ``LLM.chat`` (the model's chat template, as vLLM's chat API renders it)
and printed as ``REFERENCE_CHAT`` with its ``prompt_token_ids`` too. A child process,
because vLLM spawns processes of its own and needs a guarded ``__main__``.
"""

from __future__ import annotations

import json
import sys

LOGPROBS = 2
CHAT = "chat:"


def _record(out: object) -> dict[str, object]:
    completion = out.outputs[0]  # type: ignore[attr-defined]
    logprobs = []
    for token_id, candidates in zip(completion.token_ids, completion.logprobs, strict=True):
        chosen = candidates[token_id]
        logprobs.append({"token": chosen.decoded_token, "logprob": chosen.logprob})
    return {
        "prompt_token_ids": list(out.prompt_token_ids),  # type: ignore[attr-defined]
        "token_ids": list(completion.token_ids),
        "text": completion.text,
        "finish_reason": completion.finish_reason,
        "logprobs": logprobs,
    }


def main(argv: list[str]) -> int:
    from vllm import LLM, SamplingParams

    model, max_tokens, items = argv[0], int(argv[1]), argv[2:]
    prompts = [item for item in items if not item.startswith(CHAT)]
    chats = [json.loads(item.removeprefix(CHAT)) for item in items if item.startswith(CHAT)]
    llm = LLM(
        model=model,
        served_model_name="pdgate-tiny-llama",
        dtype="float32",
        enforce_eager=True,
        max_model_len=2048,
        kv_cache_memory_bytes=64 << 20,
        max_num_seqs=4,
    )
    # Asking for logprobs does not change greedy sampling: one reference serves both tests.
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=LOGPROBS)
    for out in llm.generate(prompts, params, use_tqdm=False):
        print("REFERENCE " + json.dumps(_record(out)), flush=True)
    for messages in chats:
        (out,) = llm.chat(messages, params, use_tqdm=False)
        print("REFERENCE_CHAT " + json.dumps(_record(out)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
