"""The served models' tokenizers at the gateway, for token-exact prefix matching.

A prompt's blocks in an engine's prefix cache are runs of *tokens*; to know where they fall
in a request, the gateway tokenizes it as the engine does:

* sim models (instances that declare the sim tokenizer, or a model set to ``"sim"``): the
  sim's own deterministic tokenizer (config/sim_tokenizer.py);
* vLLM models: the model directory's ``tokenizer.json`` read by Hugging Face's `tokenizers`
  (the Rust library vLLM's own fast tokenizers are; no transformers, no torch). The
  directory is the one `tokenizers` names for the model, or the model name itself when it
  is a local directory (vLLM's default served name is the path it loaded).

`encode` gives the ids and, per token, the prompt characters up to its end, so a cached run
of tokens converts back to the characters the rest of the gateway counts in. A model with no
tokenizer (or one that fails to load, logged once) gets None: the index then falls back to
its character blocks. Chat requests are not tokenized here (the engine's chat template
decides their tokens): they take the fallback too.

Tokenizing is the largest cost per request here (docs/results/kv-events/), and prompts that
share a prefix would pay it again for the same text: `PrefixCachedTokenizer` cuts a prompt
into chunks at word boundaries (a single space between two words: no pre-tokenizer joins
across it) and keeps each chunk's tokens under the hash of all the text up to its end, so a
prompt only pays for what follows its longest known prefix. Whether a tokenizer really
tokenizes chunk by chunk as it does whole is checked on a probe text when it loads; one
that does not (a SentencePiece tokenizer that marks every start of input, say) is used
whole.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping
from hashlib import blake2b
from itertools import accumulate
from pathlib import Path
from typing import Protocol

from pdgate.config import sim_tokenizer

log = logging.getLogger("pdgate.gateway.tokens")

__all__ = [
    "Encoded",
    "HfTokenizer",
    "PrefixCachedTokenizer",
    "PromptTokenizer",
    "PromptTokenizers",
    "SimTokenizer",
]

SIM = "sim"
Encoded = tuple[list[int], list[int]]  # token ids, and each token's end in characters


class PromptTokenizer(Protocol):
    def encode(self, text: str, *, first: bool = True) -> Encoded:
        """Token ids of `text` (as the engine tokenizes a completion prompt) and, per token,
        the offset in `text` just past it. `first`: `text` starts the prompt (a tokenizer
        that adds a BOS token adds it only then)."""
        ...


class SimTokenizer:
    def encode(self, text: str, *, first: bool = True) -> Encoded:
        pieces = sim_tokenizer.pieces(text)
        return sim_tokenizer.ids(pieces), list(accumulate(map(len, pieces)))


class HfTokenizer:
    """A ``tokenizer.json`` with its post-processor (the BOS token vLLM adds to a completion
    prompt, as ``add_special_tokens=True`` does)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        file = Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        self._tok = Tokenizer.from_file(str(file))

    def encode(self, text: str, *, first: bool = True) -> Encoded:
        enc = self._tok.encode(text, add_special_tokens=first)
        return list(enc.ids), [end for _, end in enc.offsets]


_PROBE = (
    "Once upon a time, in a land far away, a gateway sent 12,345 prompts to 8 prefills; "
    "each prefill kept what it computed, and the next   prompt with the same start found it.\n"
) * 12


class PrefixCachedTokenizer:
    """`inner`, chunk by chunk, with each chunk's tokens cached under the hash of the prompt
    up to its end (see the module docstring). Bounded: `max_chunks` chunks, least recently
    used out."""

    def __init__(
        self, inner: PromptTokenizer, *, chunk_chars: int = 1024, max_chunks: int = 2048
    ) -> None:
        if chunk_chars < 16 or max_chunks <= 0:
            raise ValueError("chunk_chars >= 16 and max_chunks > 0 required")
        self._inner = inner
        self._chunk = chunk_chars
        self._max = max_chunks
        self._cache: OrderedDict[bytes, Encoded] = OrderedDict()
        self.hits = 0
        self.misses = 0
        # Chunked must equal whole on a probe, in small chunks (many cuts), else whole only.
        whole = inner.encode(_PROBE)
        self._chunked = self._split_encode(_PROBE, 48, cache=False) == whole

    @property
    def chunked(self) -> bool:
        return self._chunked

    def encode(self, text: str, *, first: bool = True) -> Encoded:
        if not self._chunked or not first or len(text) <= self._chunk:
            return self._inner.encode(text, first=first)
        return self._split_encode(text, self._chunk, cache=True)

    def _split_encode(self, text: str, chunk: int, *, cache: bool) -> Encoded:
        ids: list[int] = []
        ends: list[int] = []
        key = b""
        pos = 0
        while pos < len(text):
            cut = _cut(text, pos + chunk, pos + chunk // 2)
            part = text[pos:cut]
            key = blake2b(key + part.encode("utf-8", "surrogatepass"), digest_size=16).digest()
            hit = self._cache.get(key) if cache else None
            if hit is None:
                hit = self._inner.encode(part, first=pos == 0)
                if cache:
                    self.misses += 1
                    self._cache[key] = hit
                    if len(self._cache) > self._max:
                        self._cache.popitem(last=False)
            else:
                self.hits += 1
                self._cache.move_to_end(key)
            ids.extend(hit[0])
            ends.extend(map(pos.__add__, hit[1]))
            pos = cut
        return ids, ends


def _cut(text: str, want: int, floor: int) -> int:
    """Where to end a chunk: the last single space between two non-spaces at or before
    `want` and after `floor`; the end of the text when there is none."""
    if want >= len(text):
        return len(text)
    i = want
    while i > floor:
        if text[i] == " " and not text[i - 1].isspace() and not text[i + 1].isspace():
            return i
        i -= 1
    return len(text)


class PromptTokenizers:
    """Model -> its tokenizer, loaded on first use (see the module docstring)."""

    def __init__(self, configured: Mapping[str, str] | None = None) -> None:
        self._configured = dict(configured or {})
        self._loaded: dict[str, PromptTokenizer | None] = {}

    def use_sim(self, model: str) -> None:
        """Instances of `model` declared the sim tokenizer (unless configured otherwise)."""
        self._configured.setdefault(model, SIM)
        if self._loaded.get(model) is None:
            self._loaded.pop(model, None)

    def encode(self, model: str, text: str) -> Encoded | None:
        tok = self._loaded.get(model)
        if tok is None and model not in self._loaded:
            tok = self._loaded[model] = self._load(model)
        return None if tok is None else tok.encode(text)

    def _load(self, model: str) -> PromptTokenizer | None:
        source = self._configured.get(model)
        if source == SIM:
            return PrefixCachedTokenizer(SimTokenizer())
        if source is None:
            if not (Path(model) / "tokenizer.json").is_file():
                return None
            source = model
        try:
            return PrefixCachedTokenizer(HfTokenizer(source))
        except Exception as exc:
            log.warning(
                "no tokenizer for model %r from %r (%s): prefix matching by characters",
                model,
                source,
                exc,
            )
            return None
