"""Deterministic "generated" text of the sim engine.

Token i of the completion of a prompt is a word picked by a keyed hash of (prompt, i), so a
prefill and a decode produce the same token 0 for the same prompt, repeated requests give
identical output, and different prompts give different output. Whitespace, punctuation and
newlines are in the word list so stop sequences have something to match.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from hashlib import blake2b

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


def prompt_key(tokens: Sequence[int]) -> bytes:
    """A 32-byte key naming a prompt; the seed of its completion."""
    return blake2b(pack_tokens(tokens), digest_size=32).digest()


def token_text(key: bytes, index: int) -> str:
    """Text of token `index` of the completion of the prompt named by `key`."""
    h = blake2b(index.to_bytes(8, "little"), key=key, digest_size=4).digest()
    return WORDS[int.from_bytes(h, "little") % len(WORDS)]
