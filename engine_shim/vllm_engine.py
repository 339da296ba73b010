"""The ``vllm`` backend: vLLM's engine in-process (AsyncLLM), behind `pdgate.engine_shim.backend`.

One `AsyncLLM` per shim process (vLLM runs its EngineCore and worker in child processes), with
pdgate's KV connector (`vllm_connector.PdgateConnector`) configured on both roles. The shims in
front of it are the same as for the ``sim`` backend, so admission, the wire, registration and
the gateway cannot tell the two apart:

* `VllmPrefillEngine.prefill` runs the prompt with ``max_tokens=1`` and asks the connector to
  pack the prompt's KV into a buffer in the spool directory; it returns the first token and
  that buffer as the `KvSource` the prefill shim holds (one slot) until a decode pulls it.
  vLLM's own admission errors (``QueueOverflowError``, ``MaxQueuedTokensError``) and more
  in-flight prompts than batch slots become `EngineBusy`, which the shim answers with 429.
* `VllmDecodeEngine.kv_sink` receives a pulled buffer into the spool (the shim's retrieval
  workers do this while the running batch keeps decoding); `generate` then submits the prompt
  with the buffer's name, the connector scatters the KV into the request's blocks, and the
  tokens stream out. The buffer is deleted as soon as the first token shows it was loaded.
  Given `local_kv` instead (a plain request), `generate` submits the prompt without any KV:
  vLLM prefills it in its running batch (chunked prefill, its prefix cache first).

The model's context length is the engine's own (``max_model_len``, which
``vllm_engine_args`` may override), reported once the engine has started (`ReportsModel`).
LoRA adapters are out of reach here: no setting loads one into the shim's engine, so a
vllm shim reports none and refuses requests for one; a fleet that serves adapters runs
stock ``vllm serve --enable-lora`` behind ``--prefill/--decode/--aggregated`` or ``pdgate
announce``, whose ``GET /v1/models`` the gateway reads. ``/tokenize`` and ``/detokenize``
use the engine's tokenizer and chat template (`Tokenization`).

Cancelling `prefill` or closing a `generate` generator (the client left) aborts the vLLM
request: vLLM's ``AsyncLLM.generate`` aborts when its consumer is cancelled or closed, and the
backends count those aborts for ``/load``. Prompts are never logged.

vLLM is imported only here and only when this backend is built, so the rest of pdgate (and
its default test suite) runs without it. vLLM starts child processes: run shims with this
backend from a program whose ``__main__`` is guarded (``pdgate shim`` is).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from typing import Any

from vllm import SamplingParams
from vllm.config import KVTransferConfig
from vllm.config.kv_events import KVEventsConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import MaxQueuedTokensError, QueueOverflowError, VLLMClientError
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.metrics.loggers import StatLoggerBase

from pdgate.config import Role, ShimSettings
from pdgate.engine_shim import backend
from pdgate.engine_shim._vllm_spool import FileKvSink, FileKvSource, Spool
from pdgate.engine_shim.vllm_connector import LOAD_KEY, LOAD_TOKENS_KEY, SAVE_KEY

__all__ = [
    "VllmDecodeEngine",
    "VllmPrefillEngine",
    "cpu_memory_available",
    "engine_args",
    "make_vllm_backend",
]

log = logging.getLogger("pdgate.engine.vllm")

_CONNECTOR_MODULE = "pdgate.engine_shim.vllm_connector"
# Spool files older than this are orphans (see Spool.sweep); checked this often.
_SWEEP_INTERVAL_S = 30.0
_OVERLOAD = (QueueOverflowError, MaxQueuedTokensError)
# vLLM's OpenAI server clamps -inf the same way (JSON has no infinity).
_MIN_LOGPROB = -9999.0


def engine_args(settings: ShimSettings, spool_dir: str) -> AsyncEngineArgs:
    """vLLM's engine arguments for one shim: the model, batch size = the shim's capacity, and
    pdgate's KV connector. ``settings.vllm_engine_args`` is applied last and wins."""
    args: dict[str, Any] = {
        "model": settings.vllm_model or settings.model,
        "served_model_name": [settings.model],
        "dtype": settings.vllm_dtype,
        "enforce_eager": settings.vllm_enforce_eager,
        "max_model_len": settings.max_model_len,
        "max_num_seqs": settings.capacity,
        "enable_prefix_caching": True,
        "disable_log_stats": False,  # the stat logger below feeds /load
        "kv_transfer_config": KVTransferConfig(
            kv_connector="PdgateConnector",
            kv_connector_module_path=_CONNECTOR_MODULE,
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"spool_dir": spool_dir},
        ),
    }
    if settings.role == Role.PREFILL:
        # vLLM's own admission as a second line behind the shim's slots: it rejects rather
        # than queues once `capacity` prompts are in the engine.
        args["max_num_queued_reqs"] = settings.capacity
    if settings.vllm_kv_cache_bytes is not None:
        args["kv_cache_memory_bytes"] = settings.vllm_kv_cache_bytes
    if settings.role == Role.PREFILL and settings.kv_events_port is not None:
        # vLLM binds only a wildcard address (it connects to any other).
        args["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=f"tcp://*:{settings.kv_events_port}",
        )
    args.update(settings.vllm_engine_args)
    return AsyncEngineArgs(**args)


def cpu_memory_available() -> int | None:
    """Bytes of host memory free as vLLM's CPU worker counts them when it checks an explicit
    KV cache size (its first allowed CPU's NUMA node: free, file and reclaimable pages, capped
    by the cgroup), or None when vLLM does not run on the CPU (its KV cache is then device
    memory). That count can be far below the kernel's MemAvailable, e.g. on VMs whose node
    shows only the memory touched so far, and a size above it makes the engine refuse to
    start."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    # vLLM's own functions (CPUWorker.determine_available_memory uses them), so the count is
    # the one the engine will check against.
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info

    node = get_allowed_cpu_list()[0].numa_node
    return int(get_memory_node_info(node).available_memory)


class _Stats:
    """Engine load as of vLLM's last step, fed by `_StatLogger` (called on the event loop)."""

    __slots__ = ("aborted", "hit_tokens", "kv_usage", "query_tokens", "running", "waiting")

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0
        self.hit_tokens = 0  # cumulative: local prefix cache + tokens loaded by the connector
        self.query_tokens = 0
        self.aborted = 0

    def snapshot(self) -> backend.EngineStats:
        return backend.EngineStats(
            running=self.running,
            waiting=self.waiting,
            prefix_hit_tokens=self.hit_tokens,
            prefix_query_tokens=self.query_tokens,
            kv_cache_usage=self.kv_usage,
            aborted=self.aborted,
        )


def _stat_logger(stats: _Stats) -> Callable[[Any, int], StatLoggerBase]:
    class _StatLogger(StatLoggerBase):  # type: ignore[misc]  # vLLM is untyped
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if scheduler_stats is None:
                return
            stats.running = scheduler_stats.num_running_reqs
            stats.waiting = scheduler_stats.num_waiting_reqs
            stats.kv_usage = float(scheduler_stats.kv_cache_usage)
            stats.hit_tokens += scheduler_stats.prefix_cache_stats.hits
            stats.query_tokens += scheduler_stats.prefix_cache_stats.queries
            connector = scheduler_stats.connector_prefix_cache_stats
            if connector is not None:
                stats.hit_tokens += connector.hits

        def log_engine_initialized(self) -> None:
            return None

    return _StatLogger


class _VllmEngine:
    """What both roles share: the AsyncLLM, its tokenizer, the spool, sampling, stats."""

    def __init__(self, settings: ShimSettings) -> None:
        self._settings = settings
        self._max_batch = settings.capacity
        self._stats = _Stats()
        self._spool: Spool | None = None
        self._llm: Any = None  # AsyncLLM; vLLM is untyped
        self._tokenizer: Any = None
        self._vocab = 0
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._llm is not None:
            return
        self._spool = Spool(self._settings.vllm_kv_spool_dir)
        args = engine_args(self._settings, str(self._spool.path))
        log.info("starting vLLM (%s) for the %s role", args.model, self._settings.role.value)
        # Blocking for as long as the model loads: the shim does not serve before this returns.
        self._llm = AsyncLLM.from_engine_args(args, stat_loggers=[_stat_logger(self._stats)])
        self._tokenizer = self._llm.get_tokenizer()
        self._vocab = len(self._tokenizer)
        self._sweeper = asyncio.create_task(self._sweep(), name="kv-spool-sweeper")

    async def aclose(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.shutdown()
        if self._spool is not None:
            self._spool.close()

    async def _sweep(self) -> None:
        assert self._spool is not None
        max_age = 2 * max(self._settings.kv_hold_timeout_s, self._settings.kv_fetch_timeout_s)
        while True:
            await asyncio.sleep(_SWEEP_INTERVAL_S)
            if removed := self._spool.sweep(max_age):
                log.warning("removed %d orphaned KV buffers", removed)

    @property
    def spool(self) -> Spool:
        if self._spool is None:
            raise RuntimeError("engine is not started")
        return self._spool

    def tokenize(self, prompt: backend.Prompt) -> list[int]:
        if self._tokenizer is None:
            raise RuntimeError("engine is not started")
        if isinstance(prompt, str):
            # The tokenizer's own special tokens (BOS), as vLLM's completions API adds them.
            return list(self._tokenizer.encode(prompt))
        ids = list(prompt)
        for t in ids:
            if not 0 <= t < self._vocab:
                raise ValueError(f"token id {t} is outside the vocabulary [0, {self._vocab})")
        return ids

    def served_model(self) -> backend.ServedModel:
        if self._llm is None:
            raise RuntimeError("engine is not started")
        return backend.ServedModel(int(self._llm.model_config.max_model_len))

    def _no_adapter(self, adapter: str | None) -> None:
        if adapter is not None:
            raise backend.InvalidRequest("this engine serves no LoRA adapters")

    def tokenize_text(self, text: str, *, add_special_tokens: bool) -> tuple[list[int], list[str]]:
        if self._tokenizer is None:
            raise RuntimeError("engine is not started")
        ids = list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))
        return ids, list(self._tokenizer.convert_ids_to_tokens(ids))

    def tokenize_chat(self, chat: backend.ChatPrompt) -> tuple[list[int], list[str]]:
        ids = self.render_chat(chat)
        return ids, list(self._tokenizer.convert_ids_to_tokens(ids))

    def detokenize(self, ids: Sequence[int]) -> str:
        if self._tokenizer is None:
            raise RuntimeError("engine is not started")
        return str(self._tokenizer.decode(self.tokenize(ids)))  # ids checked as a prompt's

    def render_chat(self, chat: backend.ChatPrompt) -> list[int]:
        """The conversation in the model's chat template, tokenized as vLLM's chat API does
        it: rendered to text, then encoded without adding special tokens (the template
        writes its own BOS)."""
        if self._tokenizer is None:
            raise RuntimeError("engine is not started")
        messages = [dict(m) for m in chat.messages]
        try:
            text = self._tokenizer.apply_chat_template(
                messages,
                tools=[dict(t) for t in chat.tools] if chat.tools else None,
                add_generation_prompt=chat.add_generation_prompt,
                continue_final_message=chat.continue_final_message,
                tokenize=False,
                **(chat.template_kwargs or {}),
            )
        except Exception as exc:  # jinja2 and transformers raise many kinds
            # The template's own words (e.g. "roles must alternate"), never the messages.
            raise ValueError(f"the chat template refused the conversation: {exc}") from None
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def stats(self) -> backend.EngineStats:
        return self._stats.snapshot()

    def _token_text(self, token_id: int, logprob: Any) -> str:
        decoded = getattr(logprob, "decoded_token", None)
        return decoded if decoded is not None else str(self._tokenizer.decode([token_id]))

    def _logprobs(self, completion: Any) -> list[backend.TokenLogprobs | None] | None:
        """vLLM's logprobs of the tokens of one (delta) output, in pdgate's shape. vLLM gives,
        per token, a mapping of candidate token id to ``Logprob`` (the top ones and the
        sampled one), or None for a token it has none for."""
        if completion.logprobs is None:
            return None
        out: list[backend.TokenLogprobs | None] = []
        for i, token_id in enumerate(completion.token_ids):
            candidates: Mapping[int, Any] | None = completion.logprobs[i]
            if candidates is None or token_id not in candidates:
                out.append(None)
                continue
            top = sorted(
                (
                    (self._token_text(tid, lp), max(float(lp.logprob), _MIN_LOGPROB))
                    for tid, lp in candidates.items()
                ),
                key=lambda entry: entry[1],
                reverse=True,
            )
            chosen = candidates[token_id]
            out.append(
                backend.TokenLogprobs(
                    self._token_text(token_id, chosen),
                    max(float(chosen.logprob), _MIN_LOGPROB),
                    tuple(top),
                )
            )
        return out

    def _params(
        self, max_tokens: int, sampling: backend.Sampling | None, kv: dict[str, Any]
    ) -> Any:
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                output_kind=RequestOutputKind.DELTA,
                extra_args={"kv_transfer_params": kv},
                **(sampling or {}),
            )
        except (ValueError, TypeError, VLLMClientError) as exc:
            raise backend.InvalidRequest(str(exc)) from None

    async def _outputs(self, tokens: Sequence[int], params: Any) -> AsyncGenerator[Any, None]:
        """vLLM's RequestOutputs; counts an abort when the consumer leaves early."""
        if self._llm is None:
            raise RuntimeError("engine is not started")
        outputs = self._llm.generate(
            {"prompt_token_ids": list(tokens)}, params, request_id=uuid.uuid4().hex
        )
        finished = False
        try:
            async for out in outputs:
                finished = out.finished
                yield out
        except _OVERLOAD as exc:
            raise backend.EngineBusy(str(exc) or type(exc).__name__) from None
        except VLLMClientError as exc:
            raise backend.InvalidRequest(str(exc)) from None
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:
                # Left while the request was in vLLM: AsyncLLM.generate aborts it.
                self._stats.aborted += 1
            raise
        finally:
            await outputs.aclose()


class VllmPrefillEngine(_VllmEngine):
    """`PrefillBackend` over vLLM."""

    def __init__(self, settings: ShimSettings) -> None:
        super().__init__(settings)
        self._computing = 0

    async def prefill(
        self,
        tokens: Sequence[int],
        sampling: backend.Sampling | None = None,
        *,
        adapter: str | None = None,
    ) -> backend.PrefillOutput:
        self._no_adapter(adapter)
        # Bounded: the shim admits at most one batch of prompts (its slots) at a time.
        if self._computing >= self._max_batch:
            raise backend.EngineBusy("prefill batch is full")
        spool = self.spool
        name = spool.new_name()
        params = self._params(1, sampling, {SAVE_KEY: name})
        self._computing += 1
        done = False
        first_logprobs = None
        first_id: int | None = None
        try:
            last = None
            async for out in self._outputs(tokens, params):
                last = out
                logprobs = self._logprobs(out.outputs[0])
                if logprobs and first_logprobs is None:
                    first_logprobs = logprobs[0]
                if first_id is None and out.outputs[0].token_ids:
                    first_id = int(out.outputs[0].token_ids[0])
            if last is None or not last.finished:
                raise RuntimeError("vLLM ended the prefill without a result")
            kv = await FileKvSource.open(spool.file(name), len(tokens))
            done = True
        finally:
            self._computing -= 1
            if not done:  # withdrawn or failed: the connector may have written part of it
                spool.remove(name)
        return backend.PrefillOutput(
            first_token=last.outputs[0].text,
            prompt_tokens=len(tokens),
            cached_tokens=last.num_cached_tokens or 0,
            kv=kv,
            logprobs=first_logprobs,
            first_token_id=first_id,
        )


class VllmDecodeEngine(_VllmEngine):
    """`DecodeBackend` over vLLM."""

    def __init__(self, settings: ShimSettings) -> None:
        super().__init__(settings)
        self._active = 0

    def kv_sink(self, tokens: Sequence[int], nbytes: int) -> backend.KvSink:
        return FileKvSink(self.spool, len(tokens), nbytes)

    def local_kv(self, tokens: Sequence[int]) -> backend.KvSink:
        return backend.LocalKv()

    async def generate(self, job: backend.DecodeJob) -> AsyncGenerator[backend.Generated, None]:
        self._no_adapter(job.adapter)
        tokens, kv = job.tokens, job.kv
        load: dict[str, Any] = {}  # a local prefill: no KV to load, vLLM computes the prompt
        if isinstance(kv, FileKvSink) and kv.committed:
            # The KV may cover only a prefix of the prompt (a continued stream): vLLM
            # computes the rest.
            load.update({LOAD_KEY: kv.name, LOAD_TOKENS_KEY: kv.tokens})
        elif not isinstance(kv, backend.LocalKv):
            raise ValueError("generate needs a committed KV sink of this engine")
        if self._active >= self._max_batch:
            raise backend.EngineBusy("decode batch is full")
        params = self._params(job.max_tokens, job.sampling, load)
        self._active += 1
        try:
            async for out in self._outputs(tokens, params):
                kv.discard()  # loaded into the engine's blocks by now: free the buffer
                completion = out.outputs[0]
                logprobs = self._logprobs(completion)
                # One item per token: the delta's text on the first, empty on the rest (a
                # delta carries several tokens when the reader fell behind).
                for i, token_id in enumerate(completion.token_ids):
                    yield backend.Generated(
                        completion.text if i == 0 else "",
                        None if logprobs is None else logprobs[i],
                        int(token_id),
                    )
        finally:
            self._active -= 1
            kv.discard()


def make_vllm_backend(settings: ShimSettings) -> VllmPrefillEngine | VllmDecodeEngine:
    if settings.role == Role.PREFILL:
        return VllmPrefillEngine(settings)
    return VllmDecodeEngine(settings)
