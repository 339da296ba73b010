"""A tiny random-weight Llama written to a directory: a real model for vLLM without downloads.

Tests, the ``vllm`` suite and ``pdgate up --engine vllm --model DIR`` need a model that vLLM
loads like any Hugging Face checkpoint, but models cannot be downloaded here and CI has two CPU
cores. `write_tiny_llama` writes one: ``config.json`` (LlamaForCausalLM: hidden 128, 2 layers,
2 heads of 64, float32), ``model.safetensors`` with seeded random weights, and a byte-level BPE
tokenizer trained with `tokenizers` on a fixed text, plus the ``tokenizer_config.json`` and
``generation_config.json`` that transformers and vLLM read, with a small chat template
(`CHAT_TEMPLATE`), so vLLM's chat API and the shims render conversations the same way.
Everything derives from `seed`, so two calls write byte-identical files and every process
that loads them computes the same logits.

Weights are drawn with a larger spread than a trained model's initialisation: near-uniform
logits would make greedy decoding flip between almost-tied tokens on float rounding (a prefill
of many tokens and a decode step that re-reads transferred KV round differently), and the point
of the model is a deterministic greedy output that a disaggregated run must reproduce exactly.

Run ``python -m pdgate.engine_shim.tiny_model DIR`` to write one by hand.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["CHAT_TEMPLATE", "TINY_MODEL_NAME", "TinyLlamaSpec", "write_tiny_llama"]

TINY_MODEL_NAME = "pdgate-tiny-llama"

# The tokenizer learns its merges from this text: ordinary English, so prompts tokenize into
# multi-byte pieces as with a real BPE vocabulary. Changing it changes every token id.
_CORPUS = (
    "Disaggregated serving splits an LLM request in two. A prefill instance computes the KV "
    "cache of the prompt and the first token; a decode instance takes that cache and generates "
    "the rest of the answer, one token per step, in a running batch. The gateway queues "
    "requests, tries prefill instances one after another, and retries those that were "
    "rejected until each request's deadline. Hello there, general Kenobi. The quick brown fox "
    "jumps over the lazy dog. Explain disaggregated serving in one paragraph. Once upon a "
    "time, in a land far away, there lived a small model with random weights and a big heart. "
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation: , . ; : ! ? ( ) [ ] { } - _ / "
)


class TinyLlamaSpec:
    """Shape of the tiny model; the defaults are what the tests use."""

    __slots__ = (
        "head_dim",
        "hidden_size",
        "intermediate_size",
        "max_position_embeddings",
        "num_attention_heads",
        "num_hidden_layers",
        "num_key_value_heads",
        "vocab_size",
        "weight_std",
    )

    def __init__(
        self,
        *,
        hidden_size: int = 128,
        num_hidden_layers: int = 2,
        num_attention_heads: int = 2,
        num_key_value_heads: int = 2,
        intermediate_size: int = 256,
        vocab_size: int = 512,
        max_position_embeddings: int = 2048,
        weight_std: float = 0.25,
    ) -> None:
        if hidden_size % num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if num_attention_heads % num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = hidden_size // num_attention_heads
        self.intermediate_size = intermediate_size
        self.vocab_size = vocab_size
        self.max_position_embeddings = max_position_embeddings
        self.weight_std = weight_std


_BOS, _EOS, _UNK = "<s>", "</s>", "<unk>"

# Jinja, as Hugging Face tokenizers carry it: BOS, the tools if any, one block per message,
# the assistant's header when a reply is wanted. Any role is rendered as itself.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|tools|>\n{{ tools | tojson }}<|end|>\n{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] or '' }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def write_tokenizer(directory: Path, vocab_size: int) -> int:
    """Train a byte-level BPE on `_CORPUS`; returns the real vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=_UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[_UNK, _BOS, _EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    bos_id = tokenizer.token_to_id(_BOS)
    # Llama prepends BOS; so does this tokenizer, in the tokenizer itself, so vLLM, transformers
    # and the shims all produce the same ids for the same text.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{_BOS} $A", pair=f"{_BOS} $A {_BOS} $B", special_tokens=[(_BOS, bos_id)]
    )
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": _BOS,
                "eos_token": _EOS,
                "unk_token": _UNK,
                "model_max_length": 2048,
                "clean_up_tokenization_spaces": False,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=1,
        )
    )
    return int(tokenizer.get_vocab_size())


def write_tiny_llama(
    directory: str | Path, *, seed: int = 0, spec: TinyLlamaSpec | None = None
) -> Path:
    """Write the tiny model into `directory` (created if missing); returns its path."""
    import numpy as np
    from safetensors.numpy import save_file

    spec = spec or TinyLlamaSpec()
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(path, spec.vocab_size)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    bos_id, eos_id = tok.token_to_id(_BOS), tok.token_to_id(_EOS)

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "vocab_size": vocab,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos_id, "eos_token_id": eos_id}, indent=1)
    )

    rng = np.random.default_rng(seed)
    h, kv = spec.hidden_size, spec.num_key_value_heads * spec.head_dim
    std = spec.weight_std

    def normal(*shape: int, scale: float = 1.0) -> Any:
        return (rng.standard_normal(shape) * std * scale).astype(np.float32)

    # Projections are scaled by 1/sqrt(fan_in) on top of `std`, so activations keep their
    # magnitude through the layers while the embedding and head stay spread out.
    tensors: dict[str, Any] = {"model.embed_tokens.weight": normal(vocab, h, scale=4.0)}
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        fan = 1 / np.sqrt(h)
        tensors[p + "self_attn.q_proj.weight"] = normal(h, h, scale=4 * fan)
        tensors[p + "self_attn.k_proj.weight"] = normal(kv, h, scale=4 * fan)
        tensors[p + "self_attn.v_proj.weight"] = normal(kv, h, scale=4 * fan)
        tensors[p + "self_attn.o_proj.weight"] = normal(h, h, scale=4 * fan)
        tensors[p + "mlp.gate_proj.weight"] = normal(spec.intermediate_size, h, scale=4 * fan)
        tensors[p + "mlp.up_proj.weight"] = normal(spec.intermediate_size, h, scale=4 * fan)
        tensors[p + "mlp.down_proj.weight"] = normal(
            h, spec.intermediate_size, scale=4 / np.sqrt(spec.intermediate_size)
        )
        tensors[p + "input_layernorm.weight"] = np.ones(h, dtype=np.float32)
        tensors[p + "post_attention_layernorm.weight"] = np.ones(h, dtype=np.float32)
    tensors["model.norm.weight"] = np.ones(h, dtype=np.float32)
    tensors["lm_head.weight"] = normal(vocab, h, scale=4.0)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m pdgate.engine_shim.tiny_model DIR", file=sys.stderr)
        return 2
    print(write_tiny_llama(args[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
