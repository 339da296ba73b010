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
def test_the_connector_picks_a_form_for_each_engines_cache_or_refuses_at_start() -> None:
    """A GPU backend's cache hands over token rows; a quantized one whole blocks; a cache of
    no known shape (MLA's latent cache) stops the engine at its start, not at its first
    prefill. (The CPU's forms run in tests/vllm/test_vllm_pd.py, inside a real engine.)"""
    import torch

    from pdgate.engine_shim.vllm_connector import PdgateConnector

    def connector(*, cpu: bool, cache_dtype: str = "auto") -> PdgateConnector:
        made = object.__new__(PdgateConnector)  # the worker side needs no vLLM config
        made._cpu, made._cache_dtype, made._layout = cpu, cache_dtype, None
        return made

    flash = {f"layer.{i}": torch.zeros(2, 10, 16, 8, 64, dtype=torch.bfloat16) for i in range(3)}
    gpu = connector(cpu=False)
    gpu.register_kv_caches(flash)
    assert gpu._layout is not None
    assert (gpu._layout.form, gpu._layout.model()) == ("rows", (3, 8, 64))
    assert gpu._layout.dtype == "bfloat16"

    forms = set()
    for cache_dtype in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        fp8 = connector(cpu=False, cache_dtype=cache_dtype)
        fp8.register_kv_caches({"layer.0": torch.zeros(10, 2, 16, 8, 64, dtype=torch.uint8)})
        assert fp8._layout is not None and fp8._layout.block_tokens == 16
        assert fp8._layout.form.startswith("blocks:") and len(fp8._layout.form) <= 16
        forms.add(fp8._layout.form)
    assert len(forms) == 3  # whole blocks load only into an engine of the same interior

    for cpu in (False, True):
        with pytest.raises(ValueError, match=r"cannot serve this engine.*not supported"):
            connector(cpu=cpu).register_kv_caches({"layer.0": torch.zeros(10, 16, 576)})


@pytest.mark.vllm
def test_a_tensor_parallel_rank_lays_out_every_head_and_keeps_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 1 of 2 of a model with 8 KV heads: its cache holds heads 4-7, its buffers all 8
    (a decode of any TP reads them); a cache read only as whole blocks refuses TP at start."""
    import torch
    import vllm.distributed.parallel_state as parallel_state

    from pdgate.engine_shim.vllm_connector import PdgateConnector

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 1)

    def connector(cache_dtype: str = "auto") -> PdgateConnector:
        made = object.__new__(PdgateConnector)
        made._cpu, made._cache_dtype, made._layout = False, cache_dtype, None
        made._ranks, made._total_heads = 2, 8
        return made

    rank1 = connector()
    rank1.register_kv_caches({"layer.0": torch.zeros(2, 10, 16, 4, 64, dtype=torch.bfloat16)})
    assert rank1._layout is not None and rank1._layout.model() == (1, 8, 64)
    assert (rank1._heads, rank1._writes) == (slice(4, 8), True)
    with pytest.raises(ValueError, match="tensor parallelism needs a cache read as token rows"):
        connector("fp8").register_kv_caches(
            {"layer.0": torch.zeros(10, 2, 16, 4, 64, dtype=torch.uint8)}
        )
    with pytest.raises(ValueError, match="not vLLM's split"):
        connector().register_kv_caches({"layer.0": torch.zeros(2, 10, 16, 8, 64)})


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
