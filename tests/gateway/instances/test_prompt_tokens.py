"""The gateway's tokenizers: the sim's and a model directory's tokenizer.json give what the
engines give, and caching chunks of shared prefixes changes no token."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pdgate.config import sim_tokenizer
from pdgate.engine_shim.tiny_model import write_tokenizer
from pdgate.gateway.instances.prompt_tokens import (
    Encoded,
    HfTokenizer,
    PrefixCachedTokenizer,
    PromptTokenizers,
    SimTokenizer,
)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(path, 2048)
    return path


def _prompts(seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ["the", "gateway", "routes", "12,345", "prompts;", "each", "prefill", "keeps", "it."]
    prefixes = [
        " ".join(rng.choice(words) for _ in range(rng.randint(200, 1500))) for _ in range(5)
    ]
    tails = ["", " ", "  double  spaces", "\nnew line", " question?", " x" * 300]
    return [rng.choice(prefixes) + rng.choice(tails) for _ in range(120)]


def test_the_sim_tokenizer_gives_the_engine_ids_and_each_token_end() -> None:
    text = "Hello, disaggregated world: 2026 tokens!"
    ids, ends = SimTokenizer().encode(text)
    assert ids == sim_tokenizer.encode(text)
    assert ends[-1] == len(text)
    pieces = sim_tokenizer.pieces(text)
    assert [text[:e] for e in ends] == ["".join(pieces[: i + 1]) for i in range(len(pieces))]


def test_a_tokenizer_json_adds_bos_and_gives_character_ends(tokenizer_dir: Path) -> None:
    tok = HfTokenizer(tokenizer_dir)
    ids, ends = tok.encode("the gateway routes prompts")
    rest, _ = tok.encode("the gateway routes prompts", first=False)
    assert ids[1:] == rest and len(ids) == len(rest) + 1  # the BOS token, at offset 0
    assert ends[0] == 0 and ends[-1] == len("the gateway routes prompts")


@pytest.mark.parametrize("kind", ["sim", "hf"])
def test_chunked_with_cache_equals_whole_for_every_prompt(kind: str, tokenizer_dir: Path) -> None:
    inner = SimTokenizer() if kind == "sim" else HfTokenizer(tokenizer_dir)
    cached = PrefixCachedTokenizer(inner, chunk_chars=256)
    assert cached.chunked
    for prompt in _prompts(1):
        assert cached.encode(prompt) == inner.encode(prompt)
    assert cached.hits > cached.misses  # the shared prefixes were served from the cache


def test_a_tokenizer_that_differs_in_chunks_is_used_whole() -> None:
    class MarksEveryStart:
        """Like a SentencePiece tokenizer that prefixes every input with a marker."""

        def encode(self, text: str, *, first: bool = True) -> Encoded:
            ids, ends = SimTokenizer().encode(text)
            return [0, *ids], [0, *ends]

    cached = PrefixCachedTokenizer(MarksEveryStart(), chunk_chars=64)
    assert not cached.chunked
    text = "word " * 100
    assert cached.encode(text) == MarksEveryStart().encode(text)


def test_models_resolve_to_their_tokenizer_or_none(tokenizer_dir: Path, tmp_path: Path) -> None:
    tokenizers = PromptTokenizers({"configured": str(tokenizer_dir), "broken": str(tmp_path)})
    assert tokenizers.encode("configured", "hello") is not None
    assert tokenizers.encode(str(tokenizer_dir), "hello") is not None  # a local model path
    assert tokenizers.encode("broken", "hello") is None  # no tokenizer.json there: logged
    assert tokenizers.encode("unknown-model", "hello") is None
    tokenizers.use_sim("sim-model")
    assert tokenizers.encode("sim-model", "hello world") == SimTokenizer().encode("hello world")
