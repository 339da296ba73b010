"""A small deterministic tokenizer for the sim backend (no vocabulary file, no downloads).

Text is cut into pieces by one regular expression, in the spirit of the pre-tokenizer of a
BPE tokenizer (GPT-2, Llama 3):

* an optional leading whitespace character followed by 1-5 letters (`` the``, ``Disag``),
* an optional leading whitespace character followed by 1-3 digits (Llama 3 splits numbers
  into groups of at most three digits too),
* an optional leading whitespace character followed by one other character (punctuation,
  symbols, ``_``),
* a run of whitespace that none of the above absorbed (``"\\n\\n"``, indentation).

On English prose a piece is about as long as a token of a real BPE vocabulary, so token
counts, prefix-cache blocks and KV sizes come out at realistic magnitudes. The pieces cover
the text exactly (``"".join(pieces(t)) == t``).

Each piece maps to an id in ``[0, VOCAB_SIZE)`` by CRC-32 of its UTF-8 bytes: stable across
processes, platforms and Python versions (unlike ``hash()``), so a prefill and a decode
tokenize a prompt identically, and the gateway could compute the same ids for cache
affinity. Collisions are possible and harmless: ids are only used for counting, prefix-cache
hashing and deriving deterministic bytes, never decoded back to text.
"""

from __future__ import annotations

import re
import zlib

__all__ = ["VOCAB_SIZE", "count", "encode", "ids", "piece_id", "pieces"]

# Llama 3's vocabulary size, so token-id prompts written for it validate here too.
VOCAB_SIZE = 128_256

_PIECE = re.compile(r"\s?[^\W\d_]{1,5}|\s?\d{1,3}|\s?[^\w\s]|\s?_|\s+")


def pieces(text: str) -> list[str]:
    """The text pieces that become tokens, in order."""
    return _PIECE.findall(text)


def piece_id(piece: str) -> int:
    """The id of `piece` as one token (what `encode` gives each piece it cuts)."""
    return zlib.crc32(piece.encode()) % VOCAB_SIZE


def encode(text: str) -> list[int]:
    """Token ids of `text`."""
    return ids(_PIECE.findall(text))


def ids(cut: list[str]) -> list[int]:
    """The ids of pieces `pieces` cut (each piece one token)."""
    crc32 = zlib.crc32
    return [crc32(piece.encode()) % VOCAB_SIZE for piece in cut]


def count(text: str) -> int:
    """Number of tokens in `text` (skips the hashing of `encode`)."""
    return len(_PIECE.findall(text))
