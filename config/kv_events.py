"""vLLM's KV-cache events on the wire: what an engine's prefix cache stored and evicted.

vLLM publishes them with ``--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://*:5557"}'`` on a ZeroMQ PUB socket, one message of
three frames per engine step: the topic (empty by default), an 8-byte big-endian sequence
number, and a msgpack payload. The payload is the batch as an array ``[ts, events,
data_parallel_rank]``; each event is a map tagged by ``type``:

* ``BlockStored``: ``block_hashes`` (the engine's hash of each new full block, bytes or a
  64-bit int), ``parent_block_hash`` (the block before the first, or nil), ``token_ids`` (all
  the new blocks' tokens, in order), ``block_size``, ``medium`` (``"GPU"`` for the engine's own
  cache), ``lora_name``, ``extra_keys`` (per block: what else its hash covered, e.g. a cache
  salt or image), and more fields this reader ignores;
* ``BlockRemoved``: ``block_hashes``, ``medium``;
* ``AllBlocksCleared``.

Older vLLM releases sent each event as an array ``[type, field, ...]`` in that field order;
`decode_batch` reads both. The sim engine publishes with `encode_batch`, the same bytes.
This module is the wire format only; the gateway's reader is gateway/instances/kv_events.py.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KvEvent",
    "connectable_endpoint",
    "decode_batch",
    "encode_batch",
    "parse_frames",
]

EngineHash = bytes | int
# The engine's own cache; offloading connectors report other tiers (``"CPU"``...).
MEDIUM_ENGINE = "GPU"


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: Sequence[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: Sequence[int]
    block_size: int
    medium: str | None = MEDIUM_ENGINE
    lora_name: str | None = None
    # Per block, what else its hash covered (None: tokens only).
    extra_keys: Sequence[Any] | None = None

    @property
    def tokens_only(self) -> bool:
        """Whether the blocks' hashes cover their tokens and nothing else (no LoRA, cache
        salt or multimodal input): only those can match a plain prompt's tokens."""
        return self.lora_name is None and not any(k for k in self.extra_keys or ())


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: Sequence[EngineHash]
    medium: str | None = MEDIUM_ENGINE


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float  # the engine's wall clock when it published the batch
    events: Sequence[KvEvent]
    data_parallel_rank: int | None = None


def encode_batch(batch: EventBatch) -> bytes:
    events: list[dict[str, Any]] = []
    for e in batch.events:
        if isinstance(e, BlockStored):
            events.append(
                {
                    "type": "BlockStored",
                    "block_hashes": list(e.block_hashes),
                    "parent_block_hash": e.parent_block_hash,
                    "token_ids": list(e.token_ids),
                    "block_size": e.block_size,
                    "lora_id": None,
                    "medium": e.medium,
                    "lora_name": e.lora_name,
                }
            )
        elif isinstance(e, BlockRemoved):
            events.append(
                {"type": "BlockRemoved", "block_hashes": list(e.block_hashes), "medium": e.medium}
            )
        else:
            events.append({"type": "AllBlocksCleared"})
    return msgspec.msgpack.encode([batch.ts, events, batch.data_parallel_rank])


def decode_batch(payload: bytes) -> EventBatch:
    """One message's payload; raises ValueError if it is not a KV event batch. Events of a
    kind this reader does not know are skipped (a newer engine may add some)."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not msgpack: {exc}") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise ValueError("a KV event batch is an array [ts, events, ...]")
    ts = raw[0]
    if not isinstance(ts, int | float):
        raise ValueError("a KV event batch starts with its timestamp")
    rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else None
    events = [e for e in map(_event, raw[1]) if e is not None]
    return EventBatch(float(ts), events, rank)


_ARRAY_FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def _event(raw: object) -> KvEvent | None:
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind = raw[0]
        fields = dict(zip(_ARRAY_FIELDS.get(kind, ()), raw[1:], strict=False))
    elif isinstance(raw, dict) and isinstance(raw.get("type"), str):
        kind, fields = raw["type"], raw
    else:
        raise ValueError("a KV event is a map with a type or an array starting with one")
    try:
        if kind == "BlockStored":
            hashes = _hashes(fields["block_hashes"])
            parent = fields.get("parent_block_hash")
            tokens = fields["token_ids"]
            size = fields["block_size"]
            if parent is not None and not isinstance(parent, bytes | int):
                raise ValueError("parent_block_hash")
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise ValueError("token_ids")
            if not isinstance(size, int) or size <= 0:
                raise ValueError("block_size")
            extra = fields.get("extra_keys")
            return BlockStored(
                hashes,
                parent,
                tokens,
                size,
                _medium(fields.get("medium")),
                _text(fields.get("lora_name")),
                extra if isinstance(extra, list) else None,
            )
        if kind == "BlockRemoved":
            return BlockRemoved(_hashes(fields["block_hashes"]), _medium(fields.get("medium")))
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
    except KeyError as exc:
        raise ValueError(f"{kind} without {exc.args[0]}") from None
    return None


def _hashes(raw: object) -> list[EngineHash]:
    if not isinstance(raw, list) or not all(isinstance(h, bytes | int) for h in raw):
        raise ValueError("block_hashes is a list of bytes or integers")
    return raw


def _medium(raw: object) -> str | None:
    return raw if isinstance(raw, str) else None


def _text(raw: object) -> str | None:
    return raw if isinstance(raw, str) and raw else None


def parse_frames(frames: Sequence[bytes]) -> tuple[bytes, int, bytes]:
    """A PUB message's frames: (topic, sequence number, payload)."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise ValueError("a KV event message has three frames: topic, 8-byte sequence, payload")
    return frames[0], int.from_bytes(frames[1], "big", signed=True), frames[2]


_ENDPOINT = re.compile(r"^(tcp://[A-Za-z0-9.\[\]:_-]+:[0-9]{1,5}|ipc:///?\S{1,200})?$")


def connectable_endpoint(raw: object) -> str:
    """A KV-event endpoint others can connect to: ``tcp://host:port`` (no wildcard) or
    ``ipc://path``; "" for none. Raises ValueError otherwise."""
    if not isinstance(raw, str) or len(raw) > 256 or not _ENDPOINT.fullmatch(raw) or "*" in raw:
        raise ValueError("kv_events must be tcp://host:port or ipc://path (a connectable address)")
    return raw
