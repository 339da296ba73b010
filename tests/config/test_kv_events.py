"""vLLM's KV-event wire format: what vLLM 0.32 sends (a batch array whose events are maps
tagged by ``type``), what older releases sent (events as arrays), and what is refused."""

from __future__ import annotations

import msgspec
import pytest

from pdgate.config.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    connectable_endpoint,
    decode_batch,
    encode_batch,
    parse_frames,
)

# As vLLM 0.32's ZmqEventPublisher encodes a KVEventBatch (msgspec: the batch array_like,
# each event a tagged map with every field, defaults omitted).
VLLM_0_32 = msgspec.msgpack.encode(
    [
        1764200000.25,
        [
            {
                "type": "BlockStored",
                "block_hashes": [b"\x01" * 32, b"\x02" * 32],
                "parent_block_hash": None,
                "token_ids": [1, 2, 3, 4],
                "block_size": 2,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "session_id": "ignored-field",
            },
            {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32], "medium": "GPU"},
            {"type": "AllBlocksCleared"},
            {"type": "SomethingNewer", "x": 1},
        ],
        None,
    ]
)


def test_vllm_batches_decode_with_unknown_fields_and_kinds_skipped() -> None:
    batch = decode_batch(VLLM_0_32)
    assert batch.ts == 1764200000.25 and batch.data_parallel_rank is None
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [b"\x01" * 32, b"\x02" * 32]
    assert (stored.parent_block_hash, stored.token_ids, stored.block_size) == (
        None,
        [1, 2, 3, 4],
        2,
    )
    assert stored.medium == "GPU" and stored.tokens_only
    assert removed == BlockRemoved([b"\x01" * 32], "GPU")
    assert cleared == AllBlocksCleared()


def test_older_array_events_decode_too() -> None:
    payload = msgspec.msgpack.encode(
        [
            1.0,
            [["BlockStored", [7, 8], 6, [1, 2, 3, 4], 2, None, "GPU"], ["BlockRemoved", [7], None]],
            3,
        ]
    )
    batch = decode_batch(payload)
    assert batch.data_parallel_rank == 3
    assert batch.events[0] == BlockStored([7, 8], 6, [1, 2, 3, 4], 2, "GPU")
    assert batch.events[1] == BlockRemoved([7], None)


def test_the_sim_encodes_what_it_decodes() -> None:
    batch = EventBatch(
        5.5, [BlockStored([1, 2], None, [9] * 32, 16), BlockRemoved([1]), AllBlocksCleared()]
    )
    assert decode_batch(encode_batch(batch)) == batch


def test_salted_or_lora_blocks_are_not_tokens_only() -> None:
    assert not BlockStored([1], None, [1], 1, extra_keys=[("salt",)]).tokens_only
    assert not BlockStored([1], None, [1], 1, lora_name="adapter").tokens_only
    assert BlockStored([1], None, [1], 1, extra_keys=[None]).tokens_only


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # not msgpack
        msgspec.msgpack.encode({"ts": 1, "events": []}),  # a map, not the batch array
        msgspec.msgpack.encode(["now", []]),
        msgspec.msgpack.encode([1.0, [{"block_hashes": [1]}]]),  # untagged event
        msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1]}]]),
        msgspec.msgpack.encode(
            [
                1.0,
                [
                    {
                        "type": "BlockStored",
                        "block_hashes": ["x"],
                        "parent_block_hash": None,
                        "token_ids": [1],
                        "block_size": 1,
                    }
                ],
            ]
        ),
        msgspec.msgpack.encode(
            [
                1.0,
                [
                    {
                        "type": "BlockStored",
                        "block_hashes": [1],
                        "parent_block_hash": None,
                        "token_ids": [1],
                        "block_size": 0,
                    }
                ],
            ]
        ),
    ],
)
def test_malformed_batches_are_refused(payload: bytes) -> None:
    with pytest.raises(ValueError, match=r"."):
        decode_batch(payload)


def test_frames_carry_topic_sequence_and_payload() -> None:
    assert parse_frames([b"kv", (41).to_bytes(8, "big"), b"p"]) == (b"kv", 41, b"p")
    with pytest.raises(ValueError, match="three frames"):
        parse_frames([b"", b"\x00", b"p"])
    with pytest.raises(ValueError, match="three frames"):
        parse_frames([b"p"])


@pytest.mark.parametrize(
    ("endpoint", "ok"),
    [
        ("", True),
        ("tcp://10.0.0.5:5557", True),
        ("tcp://prefill-0.pd.svc:5557", True),
        ("tcp://[::1]:5557", True),
        ("ipc:///run/vllm/kv", True),
        ("tcp://*:5557", False),  # a bind address, not one to connect to
        ("http://10.0.0.5:5557", False),
        ("tcp://10.0.0.5", False),
    ],
)
def test_only_connectable_endpoints_are_accepted(endpoint: str, ok: bool) -> None:
    if ok:
        assert connectable_endpoint(endpoint) == endpoint
    else:
        with pytest.raises(ValueError, match="connectable"):
            connectable_endpoint(endpoint)
