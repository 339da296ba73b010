"""The vllm backend's parts that need no engine: the spool and its KV source/sink, the packed
buffer format (needs torch), the sampling fields, the tiny model writer (needs tokenizers)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from hashlib import blake2b
from pathlib import Path

import orjson
import pytest

from pdgate.config.openai_api import OpenAIError
from pdgate.engine_shim._completion import parse_request
from pdgate.engine_shim._vllm_spool import FileKvSink, FileKvSource, Spool


@pytest.fixture
def spool(tmp_path: Path) -> Iterator[Spool]:
    s = Spool(str(tmp_path))
    yield s
    s.close()
    assert not s.path.exists()


async def test_sink_then_source_round_trip(spool: Spool) -> None:
    payload = os.urandom(700_000)
    sink = FileKvSink(spool, tokens=5, nbytes=len(payload))
    for off in range(0, len(payload), 65536):
        sink.write(payload[off : off + 65536])
    await sink.commit()
    assert sink.committed
    source = await FileKvSource.open(spool.file(sink.name), tokens=5)
    assert source.nbytes == len(payload)
    assert source.digest == blake2b(payload, digest_size=16).hexdigest()
    got = b"".join([c async for c in source.chunks(100_000)])
    assert got == payload
    source.release()
    source.release()  # idempotent
    assert spool.count() == 0


async def test_sink_refuses_wrong_sizes_and_cleans_up(spool: Spool) -> None:
    sink = FileKvSink(spool, tokens=1, nbytes=10)
    with pytest.raises(ValueError, match="more KV bytes"):
        sink.write(b"x" * 11)
    sink.discard()
    short = FileKvSink(spool, tokens=1, nbytes=10)
    short.write(b"x" * 4)
    with pytest.raises(ValueError, match="expected 10"):
        await short.commit()
    assert not short.committed
    assert spool.count() == 0


def test_sweep_removes_only_old_buffers(spool: Spool) -> None:
    old, new = spool.file(spool.new_name()), spool.file(spool.new_name())
    old.write_bytes(b"old")
    new.write_bytes(b"new")
    past = time.time() - 3600
    os.utime(old, (past, past))
    assert spool.sweep(60) == 1
    assert not old.exists()
    assert new.exists()


def _body(**extra: object) -> bytes:
    return orjson.dumps({"prompt": "hi", "max_tokens": 4, **extra})


def test_sampling_fields_are_collected_and_checked() -> None:
    # What an engine is handed: the sampling fields the client set, logprobs included.
    req = parse_request(
        _body(temperature=0, top_p=0.9, seed=7, ignore_eos=True, logprobs=2, stop="x", user="u"),
        max_model_len=100,
    )
    assert req.sampling() == {
        "temperature": 0,
        "top_p": 0.9,
        "seed": 7,
        "ignore_eos": True,
        "logprobs": 2,
    }
    assert parse_request(_body(), max_model_len=100).sampling() == {}
    for bad in ({"seed": 1.5}, {"ignore_eos": "yes"}, {"min_p": "0.1"}, {"max_tokens": 101}):
        with pytest.raises(OpenAIError) as err:
            parse_request(_body(**bad), max_model_len=100)
        assert err.value.status == 400


@pytest.mark.vllm
def test_kv_buffer_format(tmp_path: Path) -> None:
    # Needs torch (the vllm extra): runs in the vllm suite, which fails under CI=true without it.
    import torch

    from pdgate.engine_shim._vllm_kv_buffer import (
        KvBufferError,
        KvLayout,
        buffer_path,
        create_buffer,
        open_buffer,
    )

    layout = KvLayout(layers=2, kv_heads=3, head_size=4, dtype="float32", element_bytes=4)
    rows = torch.arange(2 * 6 * 2 * 3 * 4, dtype=torch.float32).view(2, 6, 2, 3, 4)
    path = buffer_path(tmp_path, "0123456789abcdef0123456789abcdef")
    buf = create_buffer(path, layout, tokens=6)  # token rows: no block size in the format
    assert tuple(buf.shape) == (2, 6, 2, 3, 4)
    buf.copy_(rows)
    del buf
    assert path.stat().st_size == layout.nbytes(6) == 128 + rows.numel() * 4
    back, theirs = open_buffer(path, layout, min_tokens=5)
    assert torch.equal(back, rows) and theirs == layout
    with pytest.raises(KvBufferError, match="holds 6 tokens"):
        open_buffer(path, layout, min_tokens=7)
    # An engine of another cache dtype, or one that keeps whole blocks, reads rows in the
    # buffer's dtype (it casts them as it scatters), but never appends to them.
    for reader in (
        KvLayout(2, 3, 4, "bfloat16", 2),
        KvLayout(2, 3, 4, "float32", 4, form="blocks:cpu-amx", block_tokens=32),
    ):
        back, theirs = open_buffer(path, reader, min_tokens=6)
        assert back.dtype == torch.float32 and torch.equal(back, rows) and theirs.rows
        with pytest.raises(KvBufferError, match="layout mismatch"):
            open_buffer(path, reader, min_tokens=1, writable=True)
    for other in (KvLayout(3, 3, 4, "float32", 4), KvLayout(2, 6, 2, "float32", 4)):
        with pytest.raises(KvBufferError, match="same model"):
            open_buffer(path, other, min_tokens=1)  # another model: never loaded as garbage
    # Whole kernel blocks: only an engine of exactly that layout may load them.
    amx = KvLayout(2, 3, 4, "bfloat16", 2, form="blocks:cpu-amx", block_tokens=32)
    blocks = buffer_path(tmp_path, "f" * 31 + "e")
    assert tuple(create_buffer(blocks, amx, tokens=40).shape) == (2, 2, 32 * 2 * 3 * 4)
    assert open_buffer(blocks, amx, min_tokens=40)[1] == amx
    for reader in (
        layout,
        KvLayout(2, 3, 4, "bfloat16", 2, form="blocks:cpu-amx", block_tokens=64),
    ):
        with pytest.raises(KvBufferError, match="layout mismatch"):
            open_buffer(blocks, reader, min_tokens=1)
    with pytest.raises(KvBufferError, match="unreadable"):
        open_buffer(buffer_path(tmp_path, "f" * 32), layout, min_tokens=1)
    for bad in ("../../etc/passwd", "ABC", "0" * 31, 5):
        with pytest.raises(KvBufferError, match="invalid"):
            buffer_path(tmp_path, bad)  # type: ignore[arg-type]


@pytest.mark.vllm
def test_the_connector_reads_the_cpu_vector_kernels_blocks_as_token_rows() -> None:
    """What vLLM's CPU kernel (ISA vec) writes where, as its reshape_and_cache does it: per
    kernel block and head, the keys column-major, then the values row-major. Token t of a
    prompt sits in scheduler block t // 128, kernel block t % 128 // 32 of it, at t % 32."""
    import torch

    from pdgate.engine_shim.vllm_connector import PdgateConnector, _Job

    blocks, heads, size, head_size = 12, 2, 32, 4
    key = torch.randn(blocks, size, heads, head_size)  # by (kernel block, slot, head)
    value = torch.randn(blocks, size, heads, head_size)
    region = torch.empty(blocks, heads, 2, size * head_size)
    region[:, :, 0] = key.permute(0, 2, 3, 1).reshape(blocks, heads, -1)  # [head dim, slot]
    region[:, :, 1] = value.permute(0, 2, 1, 3).reshape(blocks, heads, -1)  # [slot, head dim]
    cache = region.view(blocks, heads, size, 2 * head_size)  # vLLM's logical per-layer view
    keys, values = PdgateConnector._rows(cache)
    assert torch.equal(keys, key) and torch.equal(values, value)
    keys[3, 5] = 7.0  # the views write the cache
    assert torch.equal(PdgateConnector._rows(cache)[0][3, 5], torch.full((heads, head_size), 7.0))

    connector = object.__new__(PdgateConnector)
    connector._block_size = 128
    job = _Job("0" * 32, block_ids=[2, 0], start=120, end=140, total=140)
    kernel, slot = connector._token_slots(job, cache)
    # Tokens 120-127: scheduler block 2 (kernel blocks 8-11), kernel block 11 at 24-31;
    # tokens 128-139: scheduler block 0, kernel block 0 at 0-11.
    assert kernel.tolist() == [11] * 8 + [0] * 12
    assert slot.tolist() == list(range(24, 32)) + list(range(12))
    first, last, ids = connector._kernel_blocks(job, cache)
    assert (first, last, ids.tolist()) == (3, 5, [11, 0])


@pytest.mark.vllm
def test_tiny_model_is_deterministic(tmp_path: Path) -> None:
    from pdgate.engine_shim.tiny_model import write_tiny_llama

    a, b = write_tiny_llama(tmp_path / "a"), write_tiny_llama(tmp_path / "b")
    names = sorted(p.name for p in a.iterdir())
    assert names == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n
    config = orjson.loads((a / "config.json").read_bytes())
    assert config["hidden_size"] == 128
    assert config["num_hidden_layers"] == 2
    assert config["head_dim"] == 64
