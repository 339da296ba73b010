"""Deterministic "generated" text of the sim engine: an autoregressive model over token ids.

The next token is a word picked by a hash of the whole context so far (the prompt's token
ids and every token generated after them), like a real model's greedy choice, so:

* a prefill and a decode produce the same first token for the same prompt, repeated
  requests give identical output, and different prompts give different output;
* a request re-submitted with prompt = the original prompt's ids + the first k generated ids
  (and k fewer tokens to go) continues with exactly the tokens the uninterrupted run would
  have produced: what moving a stream to another decode mid-way needs.

`Context` is that hash, a 64-bit FNV-1a over the token ids, extended one token at a time
(hashing a prompt is one pass over its ids). A LoRA adapter's text differs from its base
model's: its name salts the hash's start (`adapter_salt`), so the same prompt continues
differently, and alike on every instance that holds the adapter. Each word of `WORDS` is
one token of the sim's vocabulary; its id is the tokenizer's id of the word as one piece
(`tokenizer.piece_id`), so a word the tokenizer also keeps whole (`` the``, ``.``) has the
same id both ways.
Whitespace, punctuation and newlines are in the word list so stop sequences have something
to match.

Log-probabilities come from the same kind of hash: the generated word is always the most
likely one (so greedy sampling would pick it: the sim's output is the greedy output of some
model), the alternatives are other words, less likely in order, and the probabilities of the
listed words sum to less than one, as top-k lists of a real model do.
"""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Sequence
from hashlib import blake2b

from pdgate.config import sim_tokenizer as tokenizer
from pdgate.engine_shim.backend import TokenLogprobs

# fmt: off
WORDS: tuple[str, ...] = (
    " the", " model", " prefill", " decode", " token", " cache", " batch", " stream",
    " gateway", " request", " slot", " queue", " latency", " of", " and", " to",
    " a", " in", " is", " on", " with", " for", " that", " it",
    " data", " time", " first", " next", " block", " buffer", " transfer", " key",
    " value", " layer", " head", " scheduler", " instance", " group", " rate", " load",
    " fast", " slow", " new", " old", " idle", " busy", " each", " all",
    " one", " two", " we", " they", " runs", " waits", " sends", " reads",
    ".", ",", ";", ":", "!", "?", "\n", " -",
)
# fmt: on


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32s (the same bytes on every platform)."""
    packed = array("I", tokens)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


WORD_IDS: tuple[int, ...] = tuple(tokenizer.piece_id(word) for word in WORDS)

_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_MASK = (1 << 64) - 1


class Context:
    """The hash of a token sequence, extended token by token (see the module docstring)."""

    __slots__ = ("value",)

    def __init__(self, tokens: Sequence[int] = (), salt: int = 0) -> None:
        value = _FNV_OFFSET ^ salt
        for token in tokens:
            value = ((value ^ (token + 1)) * _FNV_PRIME) & _MASK
        self.value = value

    def append(self, token: int) -> None:
        self.value = ((self.value ^ (token + 1)) * _FNV_PRIME) & _MASK

    @property
    def key(self) -> bytes:
        return self.value.to_bytes(8, "little")


def adapter_salt(adapter: str | None) -> int:
    """The salt of a LoRA adapter's contexts (0: the base model)."""
    if adapter is None:
        return 0
    digest = blake2b(adapter.encode(), digest_size=8, person=b"pdgate-lora").digest()
    return int.from_bytes(digest, "little") or 1


def next_word(context: Context) -> int:
    """Index in `WORDS` of the token that follows `context`."""
    h = blake2b(context.key, digest_size=4, person=b"pdgate-next").digest()
    return int.from_bytes(h, "little") % len(WORDS)


def next_token(context: Context) -> tuple[int, str]:
    """The token id and text that follow `context`."""
    word = next_word(context)
    return WORD_IDS[word], WORDS[word]


def token_logprobs(context: Context, top: int, forced: str | None = None) -> TokenLogprobs:
    """Log-probabilities of the token that follows `context`, with the `top` most likely
    words (at least the generated one). `forced`: the generated token is this text instead
    of the context's word (a tool call's), still the most likely one."""
    h = blake2b(context.key, digest_size=32, person=b"pdgate-logprobs").digest()
    token = WORDS[next_word(context)] if forced is None else forced
    # p(generated) in [0.35, 0.95); alternative j gets at most half of what j-1 could get, so
    # every alternative is less likely than the generated word and the list sums below 1.
    p = 0.35 + 0.6 * h[0] / 256
    rest = 1.0 - p
    entries = [(token, math.log(p))]
    start, stride = h[1], 2 * h[2] + 1  # an odd stride visits all 64 words once
    j = 0
    while len(entries) < max(top, 1):
        word = (start + j * stride) % len(WORDS)
        j += 1
        if WORDS[word] == token:
            continue
        share = 0.5 + 0.5 * h[3 + len(entries) % 29] / 256
        entries.append((WORDS[word], math.log(rest * share / 2 ** len(entries))))
    return TokenLogprobs(token, entries[0][1], tuple(entries))  # best first by construction
