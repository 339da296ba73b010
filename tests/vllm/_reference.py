"""Greedy output of the tiny model from one aggregated vLLM engine (no disaggregation, no KV
connector): the reference a disaggregated run must reproduce token for token.

Run as ``python -m tests.vllm._reference MODEL_DIR MAX_TOKENS PROMPT...``; prints one JSON
object per prompt (``token_ids``, ``text``, ``finish_reason``). A child process, because vLLM
spawns processes of its own and needs a guarded ``__main__``.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    from vllm import LLM, SamplingParams

    model, max_tokens, prompts = argv[0], int(argv[1]), argv[2:]
    llm = LLM(
        model=model,
        served_model_name="pdgate-tiny-llama",
        dtype="float32",
        enforce_eager=True,
        max_model_len=2048,
        kv_cache_memory_bytes=64 << 20,
        max_num_seqs=4,
    )
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    for out in llm.generate(prompts, params, use_tqdm=False):
        completion = out.outputs[0]
        record = {
            "token_ids": list(completion.token_ids),
            "text": completion.text,
            "finish_reason": completion.finish_reason,
        }
        print("REFERENCE " + json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
