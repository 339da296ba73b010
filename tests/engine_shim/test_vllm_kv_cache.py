"""A layer's paged KV cache read and written as token rows and whole blocks, in each logical
shape vLLM's backends give a connector. Needs torch (the vllm extra), not vLLM.

The caches are made on ``PDGATE_TEST_DEVICE`` (default ``cpu``): on a machine with a GPU,
``PDGATE_TEST_DEVICE=cuda pytest -m vllm tests/engine_shim/test_vllm_kv_cache.py`` runs the
same copies between GPU caches and the host-memory buffer (docs/vllm.md, GPU).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

pytestmark = pytest.mark.vllm

DEVICE = os.environ.get("PDGATE_TEST_DEVICE", "cpu")
LAYERS, HEADS, HEAD_SIZE = 2, 2, 8


def _flash(blocks: int, size: int, dtype: object, *, hnd: bool = False) -> object:
    """FlashAttention's ``[2, blocks, size, heads, head size]``; with `hnd`, stored heads
    before tokens, as vLLM permutes a cache under the ``HND`` layout."""
    import torch

    if hnd:
        raw = torch.zeros(2, blocks, HEADS, size, HEAD_SIZE, dtype=dtype, device=DEVICE)
        return raw.permute(0, 1, 3, 2, 4)
    return torch.zeros(2, blocks, size, HEADS, HEAD_SIZE, dtype=dtype, device=DEVICE)


def _flashinfer(blocks: int, size: int, dtype: object) -> object:
    import torch

    return torch.zeros(blocks, 2, size, HEADS, HEAD_SIZE, dtype=dtype, device=DEVICE)


def _cpu_vec(blocks: int, size: int, dtype: object) -> object:
    import torch

    return torch.zeros(blocks, HEADS, size, 2 * HEAD_SIZE, dtype=dtype, device=DEVICE)


def test_the_cpu_vector_kernels_blocks_read_as_token_rows() -> None:
    """What vLLM's CPU kernel (ISA vec) writes where, as its reshape_and_cache does it: per
    kernel block and head, the keys column-major, then the values row-major. Token t of a
    prompt sits in scheduler block t // 128, kernel block t % 128 // 32 of it, at t % 32."""
    import torch

    from pdgate.engine_shim._vllm_kv_cache import Span, kernel_blocks, token_slots, token_views

    blocks, heads, size, head_size = 12, 2, 32, 4
    key = torch.randn(blocks, size, heads, head_size)  # by (kernel block, slot, head)
    value = torch.randn(blocks, size, heads, head_size)
    region = torch.empty(blocks, heads, 2, size * head_size)
    region[:, :, 0] = key.permute(0, 2, 3, 1).reshape(blocks, heads, -1)  # [head dim, slot]
    region[:, :, 1] = value.permute(0, 2, 1, 3).reshape(blocks, heads, -1)  # [slot, head dim]
    cache = region.view(blocks, heads, size, 2 * head_size)  # vLLM's logical per-layer view
    keys, values = token_views(cache)
    assert torch.equal(keys, key) and torch.equal(values, value)
    keys[3, 5] = 7.0  # the views write the cache
    assert torch.equal(token_views(cache)[0][3, 5], torch.full((heads, head_size), 7.0))

    kernel, slot = token_slots(cache, Span([2, 0], 120, 140, block_size=128))
    # Tokens 120-127: scheduler block 2 (kernel blocks 8-11), kernel block 11 at 24-31;
    # tokens 128-139: scheduler block 0, kernel block 0 at 0-11.
    assert kernel.tolist() == [11] * 8 + [0] * 12
    assert slot.tolist() == list(range(24, 32)) + list(range(12))
    first, last, ids = kernel_blocks(cache, Span([2, 0], 120, 140, block_size=128))
    assert (first, last, ids.tolist()) == (3, 5, [11, 0])


def test_the_gpu_backends_caches_read_as_token_rows() -> None:
    """FlashAttention keeps keys and values on the first axis, FlashInfer and Triton on the
    second; under HND the strides differ, not the logical shape."""
    import torch

    from pdgate.engine_shim._vllm_kv_cache import heads, kernel_block_tokens, token_views

    for make, kv_axis in ((_flash, 0), (_flashinfer, 1)):
        cache = make(5, 16, torch.float32)
        assert heads(cache) == (HEADS, HEAD_SIZE) and kernel_block_tokens(cache) == 16
        keys, values = token_views(cache)
        keys[4, 15, 1] = 1.0
        values[0, 0, 0] = 2.0
        if kv_axis == 0:
            assert cache[0, 4, 15, 1].eq(1.0).all() and cache[1, 0, 0, 0].eq(2.0).all()
        else:
            assert cache[4, 0, 15, 1].eq(1.0).all() and cache[0, 1, 0, 0].eq(2.0).all()
    hnd = _flash(5, 16, torch.float32, hnd=True)
    token_views(hnd)[0][4, 15, 1] = 3.0
    assert hnd.permute(0, 1, 3, 2, 4)[0, 4, 1, 15].eq(3.0).all()  # as stored: heads first


def test_caches_of_no_known_shape_are_refused() -> None:
    import torch

    from pdgate.engine_shim._vllm_kv_cache import CacheShapeError, heads

    for shape in ((40, 16, 576), (2, 2, 16, 2, 8), (4, 2, 16, 7)):  # MLA, two blocks, odd
        with pytest.raises(CacheShapeError, match="not supported"):
            heads(torch.zeros(shape))


def _prompt_rows(tokens: int) -> object:
    import torch

    gen = torch.Generator().manual_seed(0)
    return torch.randn(LAYERS, tokens, 2, HEADS, HEAD_SIZE, generator=gen)


Maker = Callable[[int, int, object], object]


@pytest.mark.parametrize(
    ("prefill", "decode"),
    [
        pytest.param((_flash, 16), (_flash, 16), id="flash16-to-flash16"),
        pytest.param((_flash, 16), (_flashinfer, 32), id="flash16-to-flashinfer32"),
        pytest.param((_flashinfer, 64), (_cpu_vec, 32), id="flashinfer64-to-cpuvec32"),
        pytest.param((_cpu_vec, 32), (_flash, 16), id="cpuvec32-to-flash16"),
    ],
)
def test_token_rows_hand_a_prompt_between_caches_of_any_block_size(
    tmp_path: object, prefill: tuple[Maker, int], decode: tuple[Maker, int]
) -> None:
    """A prefill saves a 100-token prompt in two chunks, from scattered scheduler blocks of
    its cache into a buffer file of token rows; a decode of another backend and block size
    loads them into its own scattered blocks, cast to float16: every row arrives."""
    import torch

    from pdgate.engine_shim._vllm_kv_buffer import (
        KvLayout,
        buffer_path,
        create_buffer,
        open_buffer,
    )
    from pdgate.engine_shim._vllm_kv_cache import Span, load_rows, save_rows, token_views

    tokens, block = 100, 64  # scheduler blocks of 64 tokens on both sides
    rows = _prompt_rows(tokens)
    (make_p, size_p), (make_d, size_d) = prefill, decode
    p_blocks, d_blocks = [5, 1], [0, 3]  # each side's blocks for the prompt, out of order
    prefill_layers = [make_p(6 * block // size_p, size_p, torch.float32) for _ in range(LAYERS)]
    for layer, cache in enumerate(prefill_layers):  # the prefill's forward pass wrote these
        keys, values = token_views(cache)
        for t in range(tokens):
            kernel = p_blocks[t // block] * (block // size_p) + t % block // size_p
            keys[kernel, t % size_p] = rows[layer, t, 0].to(DEVICE)
            values[kernel, t % size_p] = rows[layer, t, 1].to(DEVICE)

    layout = KvLayout(LAYERS, HEADS, HEAD_SIZE, "float32", 4)
    path = buffer_path(str(tmp_path), "ab" * 16)
    buf = create_buffer(path, layout, tokens)
    for start, end in ((0, 70), (70, tokens)):  # chunked prefill: one save per step
        span = Span(p_blocks, start, end, block)  # one per step, as the connector's
        for layer, cache in enumerate(prefill_layers):
            save_rows(cache, buf[layer], span)
    del buf

    reader = KvLayout(LAYERS, HEADS, HEAD_SIZE, "float16", 2)
    data, theirs = open_buffer(path, reader, tokens - 1)
    assert theirs.rows and data.device.type == "cpu"
    decode_layers = [make_d(4 * block // size_d, size_d, torch.float16) for _ in range(LAYERS)]
    span = Span(d_blocks, 0, tokens - 1, block)  # n - 1 tokens
    for layer, cache in enumerate(decode_layers):
        load_rows(cache, data[layer], span)
    for layer, cache in enumerate(decode_layers):
        keys, values = token_views(cache)
        for t in range(tokens - 1):
            kernel = d_blocks[t // block] * (block // size_d) + t % block // size_d
            want = rows[layer, t].to(torch.float16)
            assert torch.equal(keys[kernel, t % size_d].cpu(), want[0]), (layer, t)
            assert torch.equal(values[kernel, t % size_d].cpu(), want[1]), (layer, t)
        # Nothing else was written: the last prompt token is the decode's to compute.
        t = tokens - 1
        kernel = d_blocks[t // block] * (block // size_d) + t % block // size_d
        assert not keys[kernel, t % size_d].any()


def test_rows_staged_and_written_with_pwrite_read_back_as_saved(tmp_path: object) -> None:
    """The GPU's save path: each chunk's rows cross into one reused staging tensor
    (page-locked when the cache is on a GPU) and go into the file with pwrite, the second
    chunk into the file the first created. A decode reads every row; a staging tensor grown
    for a larger chunk serves it; a writer of another layout or past the end is refused."""
    import torch

    from pdgate.engine_shim._vllm_kv_buffer import (
        BufferFile,
        KvBufferError,
        KvLayout,
        buffer_path,
        open_buffer,
    )
    from pdgate.engine_shim._vllm_kv_cache import HostStaging, Span, stack_rows, token_views

    tokens, block, ids = 100, 16, [6, 1, 4, 0, 7, 2, 5]
    rows = _prompt_rows(tokens)
    caches = [_flash(8, block, torch.bfloat16) for _ in range(LAYERS)]
    for layer, cache in enumerate(caches):
        keys, values = token_views(cache)
        for t in range(tokens):
            keys[ids[t // block], t % block] = rows[layer, t, 0].to(DEVICE, torch.bfloat16)
            values[ids[t // block], t % block] = rows[layer, t, 1].to(DEVICE, torch.bfloat16)
    layout = KvLayout(LAYERS, HEADS, HEAD_SIZE, "bfloat16", 2)
    path = buffer_path(str(tmp_path), "cd" * 16)
    staging = HostStaging()
    for start, end in ((0, 30), (30, tokens)):  # the second chunk is larger: staging grows
        out = BufferFile(path, layout, tokens, create=start == 0)
        span = Span(ids, start, end, block)
        for layer, cache in enumerate(caches):
            staged = staging.hold(stack_rows(cache, span))
            assert staged.device.type == "cpu" and staged.is_pinned() == (DEVICE != "cpu")
            out.write(layer, start, staged)
        out.close()
    data, _ = open_buffer(path, layout, tokens)
    assert torch.equal(data, rows.to(torch.bfloat16))
    with pytest.raises(KvBufferError, match="mismatch"):
        BufferFile(path, KvLayout(LAYERS, HEADS, HEAD_SIZE, "float16", 2), tokens, create=False)
    out = BufferFile(path, layout, tokens, create=False)
    with pytest.raises(ValueError, match="past the buffer's end"):
        out.write(0, tokens - 1, torch.zeros(2, 2, HEADS, HEAD_SIZE, dtype=torch.bfloat16))
    out.close()


def test_one_span_places_tokens_in_caches_of_each_kernel_block_size() -> None:
    """A span works out where its tokens live once per kernel block size: a second cache of
    another size gets its own places, not the first's."""
    import torch

    from pdgate.engine_shim._vllm_kv_cache import Span, kernel_blocks, token_slots

    span = Span([2, 0], 120, 140, block_size=128)
    kernel16, slot16 = token_slots(_flash(8, 16, torch.float32), span)
    kernel32, slot32 = token_slots(_cpu_vec(8, 32, torch.float32), span)
    positions = torch.arange(120, 140)
    blocks = torch.where(positions < 128, 2, 0)
    assert torch.equal(kernel16.cpu(), blocks * 8 + positions % 128 // 16)
    assert torch.equal(kernel32.cpu(), blocks * 4 + positions % 128 // 32)
    assert torch.equal(slot16.cpu(), positions % 16)
    assert torch.equal(slot32.cpu(), positions % 32)
    again = token_slots(_flash(8, 16, torch.float32), span)
    assert again[0] is kernel16  # kept, not worked out per layer
    blocks16 = kernel_blocks(_flash(8, 16, torch.float32), span)
    assert blocks16[:2] == (7, 9) and blocks16[2].tolist() == [23, 0]
    assert kernel_blocks(_flash(8, 16, torch.float32), span)[2] is blocks16[2]
    assert kernel_blocks(_cpu_vec(8, 32, torch.float32), span)[2].tolist() == [11, 0]


@pytest.mark.parametrize("staged", [False, True], ids=["mapped", "staged"])
def test_whole_blocks_hand_a_prompt_to_an_engine_of_the_same_interior(
    tmp_path: object, staged: bool
) -> None:
    """An fp8 or otherwise unreadable cache goes as whole kernel blocks: FlashAttention's
    blocks (keys and values on the first axis) land in the decode's blocks intact, written
    into the file's mapping or, as from a GPU, staged and written with pwrite."""
    import torch

    from pdgate.engine_shim._vllm_kv_buffer import (
        BufferFile,
        KvLayout,
        buffer_path,
        create_buffer,
        open_buffer,
    )
    from pdgate.engine_shim._vllm_kv_cache import (
        HostStaging,
        Span,
        load_blocks,
        save_blocks,
        stack_blocks,
    )

    tokens, block = 40, 16
    layout = KvLayout(1, HEADS, HEAD_SIZE, "float32", 4, form="blocks:device-x", block_tokens=16)
    prefill = torch.randn(2, 8, block, HEADS, HEAD_SIZE).to(DEVICE)
    path = buffer_path(str(tmp_path), "cd" * 16)
    if staged:
        out = BufferFile(path, layout, tokens, create=True)
        for start, end in ((0, 20), (20, tokens)):  # two chunks share the second block
            first, blocks = stack_blocks(prefill, Span([6, 2, 4], start, end, block))
            out.write(0, first, HostStaging().hold(blocks))
        out.close()
    else:
        buf = create_buffer(path, layout, tokens)
        save_blocks(prefill, buf[0], Span([6, 2, 4], 0, tokens, block))
        del buf
    data, theirs = open_buffer(path, layout, tokens)
    assert theirs == layout
    decode = _flash(8, block, torch.float32)
    load_blocks(decode, data[0], Span([1, 7, 3], 0, tokens, block))
    for mine, at_prefill in ((1, 6), (7, 2), (3, 4)):
        assert torch.equal(decode[:, mine], prefill[:, at_prefill])
    assert not decode[:, 0].any()


def test_each_rank_holds_vllms_split_of_the_kv_heads() -> None:
    from pdgate.engine_shim._vllm_kv_cache import CacheShapeError, rank_heads

    # 8 heads on 2 ranks: 4 each; 2 heads on 4 ranks: one each, each head on two ranks in a
    # row (vLLM replicates it), of which the first writes.
    assert [rank_heads(r, 2, 8, 4) for r in (0, 1)] == [(slice(0, 4), True), (slice(4, 8), True)]
    assert [rank_heads(r, 4, 2, 1) for r in range(4)] == [
        (slice(0, 1), True),
        (slice(0, 1), False),
        (slice(1, 2), True),
        (slice(1, 2), False),
    ]
    assert rank_heads(0, 1, 8, 8) == (slice(0, 8), True)
    for bad in ((0, 2, 8, 8), (2, 2, 8, 4), (0, 3, 8, 2), (0, 3, 2, 1)):
        with pytest.raises(CacheShapeError):
            rank_heads(*bad)


@pytest.mark.parametrize("ranks", [(2, 1), (1, 2)], ids=["tp2-to-tp1", "tp1-to-tp2"])
def test_tensor_parallel_ranks_hand_their_heads_over_whatever_the_other_side_splits(
    tmp_path: object, ranks: tuple[int, int]
) -> None:
    """Each rank of a prefill writes its own heads' columns of the token rows into one
    buffer (every rank creates it: the first file stands, the others write into it), and
    each rank of a decode reads its own: a TP-2 prefill feeds a TP-1 decode and the
    reverse, every row of every head arriving where it belongs (the connector's
    save and load, as `PdgateConnector` makes them per rank)."""
    import torch

    from pdgate.engine_shim._vllm_kv_buffer import KvLayout, buffer_path, create_buffer
    from pdgate.engine_shim._vllm_kv_buffer import open_buffer as open_
    from pdgate.engine_shim._vllm_kv_cache import (
        Span,
        load_rows,
        rank_heads,
        save_rows,
        token_views,
    )

    tokens, block, ids = 40, 16, [2, 0, 1]
    heads = 4
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(LAYERS, tokens, 2, heads, HEAD_SIZE, generator=gen)
    layout = KvLayout(LAYERS, heads, HEAD_SIZE, "float32", 4)  # every head, whatever the TP
    path = buffer_path(str(tmp_path), "ef" * 16)
    span = Span(ids, 0, tokens, block)
    p_ranks, d_ranks = ranks
    for rank in range(p_ranks):
        held, writes = rank_heads(rank, p_ranks, heads, heads // p_ranks)
        assert writes
        caches = [
            torch.zeros(4, 2, block, heads // p_ranks, HEAD_SIZE, dtype=torch.float32)
            for _ in range(LAYERS)
        ]
        for layer, cache in enumerate(caches):  # this rank's forward pass: its heads
            keys, values = token_views(cache)
            for t in range(tokens):
                keys[ids[t // block], t % block] = rows[layer, t, 0, held]
                values[ids[t // block], t % block] = rows[layer, t, 1, held]
        buf = create_buffer(path, layout, tokens)  # each rank: only the first creates
        for layer, cache in enumerate(caches):
            save_rows(cache, buf[layer][:, :, held], span)
        del buf
    data, theirs = open_(path, layout, tokens)
    assert theirs == layout and torch.equal(data, rows)
    for rank in range(d_ranks):
        held, _ = rank_heads(rank, d_ranks, heads, heads // d_ranks)
        for layer in range(LAYERS):
            cache = torch.zeros(4, 2, block, heads // d_ranks, HEAD_SIZE, dtype=torch.float16)
            load_rows(cache, data[layer][:, :, held], Span(ids, 0, tokens - 1, block))
            keys, values = token_views(cache)
            for t in range(tokens - 1):
                want = rows[layer, t, :, held].to(torch.float16)
                assert torch.equal(keys[ids[t // block], t % block], want[0]), (rank, t)
                assert torch.equal(values[ids[t // block], t % block], want[1]), (rank, t)
