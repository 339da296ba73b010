"""`PdgateConnector`: vLLM's KV connector for pdgate's shims (any device, CPU included).

vLLM loads this class by module path inside its engine processes (scheduler side in the
EngineCore process, worker side in the worker process); the shims never import it. It moves KV
between vLLM's paged blocks and packed per-prompt buffers of token rows (`_vllm_kv_buffer`),
and the shims move those buffers over the network with pdgate's own wire
(``GET /v1/kv/{id}``). So vLLM does the gather and scatter, P/D-Serve's block-free transfer and
RecvScatter (section 3.6), and the shims keep everything that P/D-Serve puts outside the
engine: admission, holding the KV until a decode takes it, asynchronous retrieval while the
decode's batch keeps running, release. Where the engines' block interiors can be read as
token rows (`_interior`), the hand-over is independent of either side's block size and cache
dtype: a prefill of 128-token blocks feeds a decode of 32.

Requests opt in through ``kv_transfer_params`` (set by the shims, never taken from clients):

* ``{"pdgate_save": NAME}`` (prefill): every step that computes prompt tokens of the request
  copies their KV rows into buffer NAME, so when the request finishes (max_tokens=1) the
  buffer holds the whole prompt. The blocks are freed at once as usual (and stay in the prefix
  cache): the buffer, not the blocks, is what the prefill shim holds until it is fetched.
* ``{"pdgate_load": NAME, "pdgate_load_tokens": K}`` (decode): the scheduler counts the
  prompt's first ``min(n - 1, K)`` tokens as external hits when buffer NAME exists (K, the
  tokens the buffer holds, is less than the prompt's n when a stream is continued from
  prompt + tokens already generated: vLLM computes those after the loaded prefix), and the
  worker scatters them into the request's blocks before the forward pass of the step that
  computes the last prompt token (a synchronous load: the buffer is already local, so this is
  a memory copy, and the network transfer happened earlier, asynchronously, in the shim). A
  missing or mismatched buffer is reported as failed blocks, which vLLM recomputes
  (``kv_load_failure_policy=recompute``).

Under tensor parallelism every rank's worker saves and loads only the KV heads its cache
holds, into and out of token rows that hold the model's every head (`rank_heads`): a TP-2
prefill feeds a TP-1 decode, and the reverse. The ranks share one buffer file (the first to
create it wins; the others write their heads into it). Whole blocks hold one rank's heads
only, so an engine whose blocks cannot be read as rows refuses tensor parallelism at its
start. From a GPU under tensor parallelism a rank's columns are written through the file's
mapping, not staged (they are not contiguous in the file).

Configuration: ``kv_connector="PdgateConnector"``,
``kv_connector_module_path="pdgate.engine_shim.vllm_connector"``, ``kv_role="kv_both"`` and
``kv_connector_extra_config={"spool_dir": DIR}`` (`pdgate.engine_shim.vllm_engine` sets all of it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from pdgate.engine_shim._vllm_kv_buffer import (
    ROWS,
    BufferFile,
    KvBufferError,
    KvLayout,
    blocks_form,
    buffer_path,
    create_buffer,
    open_buffer,
)
from pdgate.engine_shim._vllm_kv_cache import (
    CacheShapeError,
    HostStaging,
    Span,
    heads,
    kernel_block_tokens,
    load_blocks,
    load_rows,
    rank_heads,
    save_blocks,
    save_rows,
    stack_blocks,
    stack_rows,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["LOAD_KEY", "LOAD_TOKENS_KEY", "SAVE_KEY", "PdgateConnector"]

log = logging.getLogger("pdgate.vllm.connector")

SAVE_KEY = "pdgate_save"
LOAD_KEY = "pdgate_load"
LOAD_TOKENS_KEY = "pdgate_load_tokens"


@dataclass(frozen=True, slots=True)
class _Job:
    """Copy the KV of prompt tokens [start, end) between blocks `block_ids` and buffer `name`."""

    name: str
    block_ids: list[int]
    start: int
    end: int
    total: int  # prompt tokens the buffer holds
    create: bool = False  # save: first chunk of this request, create the file


@dataclass
class _Meta(KVConnectorMetadata):  # type: ignore[misc]  # vLLM is untyped
    saves: list[_Job] = field(default_factory=list)
    loads: list[_Job] = field(default_factory=list)


@dataclass(slots=True)
class _SaveState:
    name: str
    total: int
    block_ids: list[int]
    saved: int = 0


def _params(obj: Any) -> dict[str, Any]:
    """kv_transfer_params of a Request or of NewRequestData's sampling params."""
    params = getattr(obj, "kv_transfer_params", None)
    if params is None:
        sampling = getattr(obj, "sampling_params", None)
        extra = getattr(sampling, "extra_args", None) or {}
        params = extra.get("kv_transfer_params")
    return params if isinstance(params, dict) else {}


class PdgateConnector(KVConnectorBase_V1):  # type: ignore[misc]  # vLLM is untyped
    # Tensor parallelism: ranks, and the model's KV heads (0: the cache's, one rank).
    _ranks = 1
    _total_heads = 0
    # This rank's KV heads among the model's, and whether it writes them (`rank_heads`).
    _heads = slice(None)
    _writes = True

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        spool = extra.get("spool_dir")
        if not spool:
            raise ValueError("PdgateConnector needs kv_connector_extra_config.spool_dir")
        self._spool = Path(spool)
        self._block_size: int = vllm_config.cache_config.block_size
        from vllm.platforms import current_platform

        self._cpu = current_platform.is_cpu()  # see `_interior`
        self._cache_dtype = str(vllm_config.cache_config.cache_dtype)
        self._ranks = vllm_config.parallel_config.tensor_parallel_size
        if self._ranks > 1:
            self._total_heads = vllm_config.model_config.get_total_num_kv_heads()
        # Scheduler side: saves in progress and loads decided but not yet scheduled. Both are
        # bounded by the engine's running requests and emptied by request_finished.
        self._saves: dict[str, _SaveState] = {}
        self._loads: dict[str, tuple[str, int]] = {}
        # Worker side.
        self._layer_index: dict[str, int] = {}
        self._layout: KvLayout | None = None
        # This step's save buffers and spans (one per request, shared by every layer), by name.
        self._open: dict[str, tuple[torch.Tensor | BufferFile, Span]] = {}
        self._staging = HostStaging()
        self._gone: set[str] = set()  # this step's saves whose buffer was removed
        self._load_errors: set[int] = set()

    # -- scheduler side ------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = _params(request)
        name = params.get(LOAD_KEY)
        if name is None:
            return 0, False
        try:
            if not buffer_path(self._spool, name).exists():
                return 0, False  # gone (a resumed request after the shim dropped it): recompute
        except KvBufferError:
            return 0, False
        # All prompt tokens but the last: the decode computes that one to get the logits of
        # the first token it samples (the prefill already returned that token). A buffer
        # shorter than the prompt covers its prefix only: the rest is computed here.
        end = request.num_prompt_tokens - 1
        held = params.get(LOAD_TOKENS_KEY)
        if isinstance(held, int) and held > 0:
            end = min(end, held)
        count = end - num_computed_tokens
        return (count, False) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens > 0:
            self._loads[request.request_id] = (
                _params(request)[LOAD_KEY],
                num_external_tokens,
            )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = _Meta()
        scheduled = scheduler_output.num_scheduled_tokens
        for req in scheduler_output.scheduled_new_reqs:
            block_ids = list(req.block_ids[0])
            load = self._loads.pop(req.req_id, None)
            if load is not None:
                name, count = load
                end = req.num_computed_tokens
                meta.loads.append(_Job(name, block_ids, end - count, end, end))
            save = _params(req).get(SAVE_KEY)
            if isinstance(save, str):
                new = _SaveState(save, req.prompt_len, block_ids)
                self._saves[req.req_id] = new
                self._add_save(meta, new, req.num_computed_tokens + scheduled[req.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            resumed = req_id in cached.resumed_req_ids
            load = self._loads.pop(req_id, None)
            if load is not None and resumed and new_blocks is not None:
                name, count = load
                end = cached.num_computed_tokens[i]
                meta.loads.append(_Job(name, list(new_blocks[0]), end - count, end, end))
            state = self._saves.get(req_id)
            if state is None:
                continue
            if resumed:
                # Preempted and rescheduled: its blocks were replaced, rows are written anew.
                state.block_ids = list(new_blocks[0]) if new_blocks is not None else []
                state.saved = 0
            elif new_blocks is not None:
                state.block_ids.extend(new_blocks[0])
            self._add_save(meta, state, cached.num_computed_tokens[i] + scheduled[req_id])
        return meta

    def _add_save(self, meta: _Meta, state: _SaveState, computed_after_step: int) -> None:
        end = min(computed_after_step, state.total)
        if end > state.saved:
            blocks = state.block_ids[: -(-end // self._block_size)]
            meta.saves.append(
                _Job(state.name, blocks, state.saved, end, state.total, create=state.saved == 0)
            )
            state.saved = end

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # The buffer already holds a copy of the KV: the blocks can be freed now.
        self._saves.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        return False, None

    # -- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # One fixed layer order on both sides: the same model gives the same names.
        self._layer_index = {name: i for i, name in enumerate(sorted(kv_caches))}
        rank = 0
        if self._ranks > 1:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
        # An engine whose cache cannot be handed over fails here, at its start, not at
        # its first prefill.
        try:
            self._layout_of(next(iter(kv_caches.values())), rank)
        except (KvBufferError, StopIteration) as exc:
            raise ValueError(f"PdgateConnector cannot serve this engine: {exc}") from None

    def _layout_of(self, kv_layer: torch.Tensor, rank: int = 0) -> KvLayout:
        """The buffers' layout for this engine (worked out at registration, for `rank`)."""
        if self._layout is None:
            if not self._layer_index:
                raise KvBufferError("KV caches were never registered with the connector")
            try:
                kv_heads, head_size = heads(kv_layer)
                size = kernel_block_tokens(kv_layer)
                if self._ranks > 1:
                    self._heads, self._writes = rank_heads(
                        rank, self._ranks, self._total_heads, kv_heads
                    )
                    kv_heads = self._total_heads
            except CacheShapeError as exc:
                raise KvBufferError(str(exc)) from None
            interior = self._interior(kv_layer, head_size)
            if interior is not None and self._ranks > 1:
                raise KvBufferError(
                    f"tensor parallelism needs a cache read as token rows, not {interior}"
                )
            self._layout = KvLayout(
                layers=len(self._layer_index),
                kv_heads=kv_heads,
                head_size=head_size,
                dtype=str(kv_layer.dtype).removeprefix("torch."),
                element_bytes=kv_layer.element_size(),
                form=ROWS if interior is None else blocks_form(interior),
                block_tokens=0 if interior is None else size,
            )
        return self._layout

    def _interior(self, kv_layer: torch.Tensor, head_size: int) -> str | None:
        """None where this engine's blocks can be read and written as token rows
        (`_vllm_kv_cache`); else a name for their interior, which only an engine of the
        same one can load.

        A GPU backend's cache (FlashAttention, FlashInfer, Triton) is token-major. On the
        CPU only the vector kernels' (ISA ``vec`` and ``vec16``) can be read as rows: AMX,
        NEON and the others tile blocks their own way. A quantized cache (fp8) keeps its
        scales in the engine, so its blocks are copied whole, as are unknown layouts."""
        platform = "cpu" if self._cpu else "device"
        if self._cache_dtype != "auto":
            return f"{platform}-{self._cache_dtype}"
        if not self._cpu:
            return None if kv_layer.dim() == 5 else platform
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = str(_get_attn_isa(kv_layer.dtype, kernel_block_tokens(kv_layer), head_size))
        return None if isa in ("vec", "vec16") else f"cpu-{isa}"

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, _Meta)
        if not meta.loads:
            return
        layers = {
            name: layer.kv_cache
            for name, layer in forward_context.no_compile_layers.items()
            if name in self._layer_index
            and isinstance(getattr(layer, "kv_cache", None), torch.Tensor)
        }
        for job in meta.loads:
            try:
                self._load(job, layers)
            except (KvBufferError, OSError, ValueError, RuntimeError) as exc:
                log.warning(
                    "KV buffer %s not loaded (%s); its tokens are recomputed", job.name, exc
                )
                first = job.start // self._block_size
                self._load_errors.update(job.block_ids[first : -(-job.end // self._block_size)])

    def _load(self, job: _Job, layers: dict[str, torch.Tensor]) -> None:
        if len(layers) != len(self._layer_index):
            raise KvBufferError("attention layers and registered KV caches differ")
        any_layer = next(iter(layers.values()))
        layout = self._layout_of(any_layer)
        data, theirs = open_buffer(buffer_path(self._spool, job.name), layout, job.end)
        if theirs.rows and not layout.rows:
            raise KvBufferError(f"token rows cannot be written into {layout.form}")
        # Token rows are cast to this engine's cache dtype where the prefill's differs.
        load = load_rows if theirs.rows else load_blocks
        span = Span(job.block_ids, job.start, job.end, self._block_size)
        for name, kv in layers.items():
            held = data[self._layer_index[name]]
            load(kv, held[:, :, self._heads] if theirs.rows else held, span)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are synchronous, done in start_load_kv

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, _Meta)
        if not meta.saves or layer_name not in self._layer_index or not self._writes:
            return
        layout = self._layout_of(kv_layer)
        index = self._layer_index[layer_name]
        # From a GPU, a layer's rows or blocks cross in one copy into page-locked memory and
        # are written with pwrite; written straight into the file's mapping they would take
        # about twice as long, inside the step (docs/vllm.md, "GPU"). A rank's heads are
        # not contiguous in the file: they go through the mapping.
        staged = kv_layer.device.type != "cpu" and self._ranks == 1
        for job in meta.saves:
            if job.name in self._gone:
                continue
            opened = self._open.get(job.name) or self._open_save(job, layout, staged)
            if opened is None:
                continue
            sink, span = opened
            try:
                if isinstance(sink, BufferFile):
                    if layout.rows:
                        first, data = span.start, stack_rows(kv_layer, span)
                    else:
                        first, data = stack_blocks(kv_layer, span)
                    sink.write(index, first, self._staging.hold(data))
                elif layout.rows:
                    save_rows(kv_layer, sink[index][:, :, self._heads], span)
                else:
                    save_blocks(kv_layer, sink[index], span)
            except OSError as exc:
                # The spool is full: a buffer written in part must never be loaded, so it
                # goes, and the prefill's request fails where the shim opens it.
                log.warning("KV buffer %s not saved (%s); it is removed", job.name, exc)
                self._drop(job.name)

    def _open_save(
        self, job: _Job, layout: KvLayout, staged: bool
    ) -> tuple[torch.Tensor | BufferFile, Span] | None:
        path = buffer_path(self._spool, job.name)
        sink: torch.Tensor | BufferFile
        try:
            if staged:
                sink = BufferFile(path, layout, job.total, create=job.create)
            elif job.create:
                sink = create_buffer(path, layout, job.total)
            else:  # the next chunk
                sink, _ = open_buffer(path, layout, job.total, writable=True)
        except (KvBufferError, OSError) as exc:
            # The prefill was withdrawn (its client left) and the shim removed its buffer
            # while a step with its next chunk was already on its way: nobody will read this
            # KV, and failing here would kill the engine and with it every other request in
            # the step.
            log.info("KV buffer %s gone (%s); its save is dropped", job.name, exc)
            self._gone.add(job.name)
            return None
        opened = self._open[job.name] = (
            sink,
            Span(job.block_ids, job.start, job.end, self._block_size),
        )
        return opened

    def _drop(self, name: str) -> None:
        sink, _ = self._open.pop(name)
        if isinstance(sink, BufferFile):
            sink.close()
        self._gone.add(name)
        buffer_path(self._spool, name).unlink(missing_ok=True)

    def wait_for_save(self) -> None:
        # Drop this step's mappings and files: the data is in the (shared) file already.
        for sink, _ in self._open.values():
            if isinstance(sink, BufferFile):
                sink.close()
        self._open.clear()
        self._gone.clear()

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
