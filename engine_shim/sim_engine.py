"""The sim engine: a timing model of a real engine, run in real time (the ``sim`` backend).

Both engines are one loop task each, in the style of continuous batching:

* `SimPrefillEngine`: each iteration takes every pending prompt (up to the batch size),
  looks them up in the prefix cache, sleeps the profile's batch prefill time for their
  uncached tokens, and completes them together. Prompts that arrive meanwhile form the next
  batch.
* `SimDecodeEngine`: each iteration admits sequences whose KV has arrived, sleeps one decode
  step for the batch size and total context, and hands every running sequence one token.
  Sequences join and leave between steps. A plain request (`local_kv`: no KV was sent, the
  decode prefills it itself) is looked up in the decode's own prefix cache, which holds the
  prompts of every sequence that ran there; its uncached tokens are computed in chunks
  inside the decode steps (vLLM's chunked prefill, `SimProfile.mixed_step_s`), which makes
  those steps longer for every running sequence. It gets its first token from the step
  that completes its prompt, then decodes like the others.

Real work done inside an iteration (hashing, bookkeeping) counts against the modelled time
instead of adding to it.

Text is generated autoregressively over token ids (`_sim_text`): each token is a function of
the prompt's ids and the tokens before it, so a stream re-submitted as prompt + generated
ids continues exactly where it stopped.

Chat requests are rendered with one fixed template (`render_chat_text`) and tokenized
like any text prompt::

    <|tools|>\n[...tools as JSON...]<|end|>\n        (only when tools are given)
    <|system|>\nYou are terse.<|end|>\n
    <|user|>\nHello!<|end|>\n
    <|assistant|>\nHi.<tool_calls>[...]</tool_calls><|end|>\n   (tool calls when present)
    <|tool|>\n{"temp": 21}<|end|>\n
    <|assistant|>\n                               (add_generation_prompt, the default)

With ``continue_final_message`` the last (assistant) message is left open: no ``<|end|>``
and no generation prompt. ``chat_template_kwargs`` are accepted and unused (the template
has no variables).

Function tools (`ToolCalling`): given a chat's `ToolUse` (``sampling[TOOL_USE]``), the model
decides whether to call one from the prompt alone (`_sim_tools`: the rule and the
arguments). A call is generated as the tokens of its text in pdgate's syntax
(``<tool_call>NAME\n{"arg":"value"}</tool_call>``, cut by the sim tokenizer like any text),
then the sequence ends: a prefill's one token is the call's first, and a decode that computes
the same prompt generates the same call from its first token on.

LoRA adapters (``sim_lora_adapters``) are names: a request for one generates from contexts
salted with its name (engine_shim/_sim_text.py), so its text differs from the base model's
and is the same on every instance holding it. Its timing is the base model's.

``/detokenize``: the sim's tokenizer is a hash (config/sim_tokenizer.py), so only pieces it
can name are written back: its generated words, the chat template's markers, single
characters, digit groups and short runs of whitespace (`_known_pieces`); any other id is
refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import string
from collections import deque
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field

import orjson

from pdgate.config import Role, ShimSettings
from pdgate.config import sim_tokenizer as tokenizer
from pdgate.config.server import is_wildcard
from pdgate.engine_shim._sim_kv import KvLink, SimKvBuffer, SimKvSink
from pdgate.engine_shim._sim_text import WORDS, Context, adapter_salt, next_token, token_logprobs
from pdgate.engine_shim._sim_tools import tool_call
from pdgate.engine_shim.backend import (
    TOOL_USE,
    ChatPrompt,
    DecodeJob,
    EngineBusy,
    EngineStats,
    Generated,
    KvSink,
    LocalKv,
    PrefillOutput,
    Prompt,
    Sampling,
    ServedModel,
    ToolUse,
)
from pdgate.engine_shim.kv_events import KvEventPublisher
from pdgate.engine_shim.prefix_cache import PrefixCache
from pdgate.engine_shim.sim_profile import SimProfile, get_profile

__all__ = [
    "SimDecodeEngine",
    "SimPrefillEngine",
    "make_backend",
    "render_chat_text",
    "tokenize",
]

log = logging.getLogger("pdgate.engine.sim")


def make_backend(settings: ShimSettings) -> SimPrefillEngine | SimDecodeEngine:
    """The ``sim`` engine of `settings.role`, on the settings' timing profile."""
    profile = get_profile(settings.sim_profile)
    if settings.sim_prefix_cache_blocks is not None:
        profile = dataclasses.replace(profile, prefix_cache_blocks=settings.sim_prefix_cache_blocks)
    if settings.sim_kv_bandwidth_gbps is not None:
        profile = dataclasses.replace(
            profile, kv_bandwidth_bytes_s=settings.sim_kv_bandwidth_gbps * 1e9 / 8
        )
    served = ServedModel(settings.max_model_len, tuple(settings.sim_lora_adapters))
    if settings.role == Role.PREFILL:
        events = None
        if settings.kv_events_port is not None:
            events = KvEventPublisher(
                f"tcp://{_bind_host(settings.host)}:{settings.kv_events_port}"
            )
        return SimPrefillEngine(
            profile,
            max_batch=settings.capacity,
            kv_wire_fraction=settings.sim_kv_wire_fraction,
            events=events,
            served=served,
        )
    return SimDecodeEngine(profile, max_batch=settings.capacity, served=served)


def _bind_host(host: str) -> str:
    if is_wildcard(host):
        return "*"
    return f"[{host}]" if ":" in host else host


def _top_logprobs(sampling: Sampling | None) -> int | None:
    """How many top logprobs the request asked for (None: none at all)."""
    value = (sampling or {}).get("logprobs")
    return None if value is None else int(value)


def _forced(tokens: Sequence[int], sampling: Sampling | None) -> list[str] | None:
    """The pieces (tokens) of the tool call the model makes after `tokens`, when the request
    gave it tools (`TOOL_USE`) and it calls one; None: it generates text."""
    use = (sampling or {}).get(TOOL_USE)
    if not isinstance(use, ToolUse):
        return None
    text = tool_call(tokens, use)
    return None if text is None else tokenizer.pieces(text)


def tokenize(prompt: Prompt) -> list[int]:
    """Token ids of a text or token-id prompt (ids must be inside the vocabulary)."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    ids = list(prompt)
    for t in ids:
        if not 0 <= t < tokenizer.VOCAB_SIZE:
            raise ValueError(f"token id {t} is outside the vocabulary [0, {tokenizer.VOCAB_SIZE})")
    return ids


def render_chat_text(chat: ChatPrompt) -> str:
    """`chat` in the sim's fixed chat template (see the module docstring)."""
    out: list[str] = []
    if chat.tools:
        out.append("<|tools|>\n" + orjson.dumps(list(chat.tools)).decode() + "<|end|>\n")
    last = len(chat.messages) - 1
    for i, message in enumerate(chat.messages):
        out.append(f"<|{message['role']}|>\n{message.get('content') or ''}")
        if message.get("tool_calls"):
            out.append(
                "<tool_calls>" + orjson.dumps(message["tool_calls"]).decode() + "</tool_calls>"
            )
        if not (chat.continue_final_message and i == last):
            out.append("<|end|>\n")
    if chat.add_generation_prompt and not chat.continue_final_message:
        out.append("<|assistant|>\n")
    return "".join(out)


def render_chat(chat: ChatPrompt) -> list[int]:
    return tokenizer.encode(render_chat_text(chat))


@functools.cache
def _known_pieces() -> dict[int, str]:
    """Token id -> text, for the pieces the sim can write back (see the module docstring);
    where two share an id, the first listed wins."""
    pieces: list[str] = list(WORDS)
    for role in ("tools", "system", "developer", "user", "assistant", "tool", "end"):
        pieces += tokenizer.pieces(f"<|{role}|>\n")
    pieces += tokenizer.pieces("<tool_calls></tool_calls>")
    for char in string.printable:
        pieces += [char, " " + char, "\n" + char]
    for n in range(1000):
        pieces += [str(n), " " + str(n), f"{n:02d}", f"{n:03d}"]
    for k in range(1, 9):
        pieces += [" " * k, "\n" * k, "\t" * k]
    known: dict[int, str] = {}
    for piece in pieces:
        if tokenizer.pieces(piece) == [piece]:  # the tokenizer cuts it as one token
            known.setdefault(tokenizer.piece_id(piece), piece)
    return known


class _EngineLoop:
    """What both sim engines are: a timing profile and a batch of at most `max_batch`, the
    sim tokenizer and chat template, the model it serves (`ReportsModel`, `Tokenization`),
    and a background loop task with a wake-up event; subclasses implement `_run`."""

    def __init__(
        self, profile: SimProfile, max_batch: int, served: ServedModel | None = None
    ) -> None:
        if max_batch <= 0:
            raise ValueError("max_batch must be positive")
        self._profile = profile
        self._max_batch = max_batch
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._served = served or ServedModel(0)

    def served_model(self) -> ServedModel:
        return self._served

    def tokenize(self, prompt: Prompt) -> list[int]:
        return tokenize(prompt)

    def render_chat(self, chat: ChatPrompt) -> list[int]:
        return render_chat(chat)

    def tool_call(self, tokens: Sequence[int], use: ToolUse) -> str | None:
        return tool_call(tokens, use)

    def tokenize_text(self, text: str, *, add_special_tokens: bool) -> tuple[list[int], list[str]]:
        pieces = tokenizer.pieces(text)  # no special tokens in the sim's vocabulary
        return tokenizer.ids(pieces), pieces

    def tokenize_chat(self, chat: ChatPrompt) -> tuple[list[int], list[str]]:
        return self.tokenize_text(render_chat_text(chat), add_special_tokens=False)

    def detokenize(self, ids: Sequence[int]) -> str:
        known = _known_pieces()
        out: list[str] = []
        for token in ids:
            piece = known.get(token)
            if piece is None:
                raise ValueError(
                    f"token id {token} has no text the sim can write (its tokenizer is a "
                    "hash: only its generated words and simple pieces are known)"
                )
            out.append(piece)
        return "".join(out)

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=type(self).__name__)

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _sleep_until(self, deadline: float) -> None:
        # sleep(0) still yields, so a zero-time profile cannot starve the event loop.
        await asyncio.sleep(max(0.0, deadline - asyncio.get_running_loop().time()))

    async def _run(self) -> None:
        raise NotImplementedError


@dataclass(eq=False, slots=True)
class _PrefillJob:
    tokens: Sequence[int]
    future: asyncio.Future[PrefillOutput]
    top_logprobs: int | None
    forced: str | None  # the first token of the tool call the model makes, if it makes one
    salt: int  # the LoRA adapter's (0: the base model)
    # Set when the job's batch is over (or the engine stopped): the prompt has left the engine.
    left: asyncio.Event = field(default_factory=asyncio.Event)


class SimPrefillEngine(_EngineLoop):
    """`PrefillBackend` of the sim engine."""

    def __init__(
        self,
        profile: SimProfile,
        *,
        max_batch: int,
        kv_wire_fraction: float,
        events: KvEventPublisher | None = None,
        served: ServedModel | None = None,
    ) -> None:
        super().__init__(profile, max_batch, served)
        self._wire_fraction = kv_wire_fraction
        self._cache = PrefixCache(profile.prefix_cache_blocks, events=events is not None)
        self._events = events
        self._pending: deque[_PrefillJob] = deque()
        self._computing = 0

    async def aclose(self) -> None:
        await super().aclose()
        if self._events is not None:
            self._events.close()
            self._events = None
        while self._pending:
            job = self._pending.popleft()
            job.left.set()
            if not job.future.done():
                job.future.set_exception(RuntimeError("prefill engine stopped"))

    def stats(self) -> EngineStats:
        return EngineStats(
            running=self._computing,
            waiting=len(self._pending),
            prefix_hit_tokens=self._cache.hit_tokens,
            prefix_query_tokens=self._cache.query_tokens,
        )

    async def prefill(
        self, tokens: Sequence[int], sampling: Sampling | None = None, *, adapter: str | None = None
    ) -> PrefillOutput:  # the sim does not sample: only `logprobs` is read
        if self._task is None:
            raise RuntimeError("engine is not started")
        # Bounded: the shim admits at most one batch of prompts at a time.
        if len(self._pending) >= self._max_batch:
            raise EngineBusy("prefill batch is full")
        forced = _forced(tokens, sampling)
        job = _PrefillJob(
            tokens,
            asyncio.get_running_loop().create_future(),
            _top_logprobs(sampling),
            None if forced is None else forced[0],
            adapter_salt(adapter),
        )
        self._pending.append(job)
        self._wakeup.set()
        try:
            return await job.future
        except asyncio.CancelledError:
            try:
                self._pending.remove(job)  # withdrawn before its batch started
            except ValueError:
                # Computing: the sim's step is the whole batch, so the prompt leaves the engine
                # when the batch ends, and the caller (the shim's slot) learns it only then.
                await job.left.wait()
            raise

    async def _run(self) -> None:
        while True:
            if not self._pending:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch: list[_PrefillJob] = []
            while self._pending and len(batch) < self._max_batch:
                job = self._pending.popleft()
                if job.future.done():
                    # Withdrawn and not yet woken: it leaves without a step, and its caller
                    # (who no longer finds it pending) waits for this.
                    job.left.set()
                else:
                    batch.append(job)
            if not batch:
                continue
            self._computing = len(batch)
            try:
                await self._compute(batch)
            except Exception as exc:
                log.exception("prefill batch of %d failed", len(batch))
                for job in batch:
                    if not job.future.done():
                        job.future.set_exception(RuntimeError(f"prefill failed: {exc}"))
            finally:
                self._computing = 0
                for job in batch:
                    job.left.set()

    async def _compute(self, batch: list[_PrefillJob]) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        cached = [self._cache.lookup_and_insert(job.tokens) for job in batch]
        duration = self._profile.prefill_batch_s(
            (len(job.tokens), hit) for job, hit in zip(batch, cached, strict=True)
        )
        outputs: list[PrefillOutput] = []
        for job, hit in zip(batch, cached, strict=True):
            nbytes = self._profile.kv_wire_bytes(len(job.tokens), self._wire_fraction)
            kv = await SimKvBuffer.build(job.tokens, nbytes)
            context = Context(job.tokens, job.salt)
            if job.forced is None:
                token_id, text = next_token(context)
            else:
                token_id, text = tokenizer.piece_id(job.forced), job.forced
            lp = (
                None
                if job.top_logprobs is None
                else token_logprobs(context, job.top_logprobs, job.forced)
            )
            outputs.append(PrefillOutput(text, len(job.tokens), hit, kv, lp, token_id))
        await self._sleep_until(started + duration)
        if self._events is not None:
            # As vLLM: what a step stored and evicted goes out when the step ends.
            self._events.publish(self._cache.take_events())
        for job, out in zip(batch, outputs, strict=True):
            if job.future.done():  # the client left while its batch was computing
                out.kv.release()
            else:
                job.future.set_result(out)


@dataclass(eq=False, slots=True)
class _Sequence:
    context: Context  # the prompt and every token generated so far
    prompt_len: int
    max_tokens: int
    top_logprobs: int | None
    forced: list[str] | None = None  # the tool call's tokens, when the model makes one
    produced: int = 0
    to_prefill: int = 0  # prompt tokens still to compute here (a local prefill)
    left: bool = False
    out: asyncio.Queue[Generated | None] = field(default_factory=asyncio.Queue)


class SimDecodeEngine(_EngineLoop):
    """`DecodeBackend` of the sim engine."""

    def __init__(
        self, profile: SimProfile, *, max_batch: int, served: ServedModel | None = None
    ) -> None:
        super().__init__(profile, max_batch, served)
        self._link = KvLink(profile)
        # What ran here is in this engine's KV blocks: a local prefill reuses its prefix.
        self._cache = PrefixCache(profile.prefix_cache_blocks)
        self._hit_tokens = 0  # of local prefills, cumulative
        self._query_tokens = 0
        self._joining: deque[_Sequence] = deque()
        # Local prefills in arrival order (chunks go to the oldest first), then running.
        self._prefilling: dict[int, _Sequence] = {}
        self._running: dict[int, _Sequence] = {}

    async def aclose(self) -> None:
        await super().aclose()
        # Wake every consumer: None tells a sequence the engine is gone.
        for seq in [*self._running.values(), *self._prefilling.values(), *self._joining]:
            seq.out.put_nowait(None)
        self._running.clear()
        self._prefilling.clear()
        self._joining.clear()

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self._running) + len(self._prefilling),
            waiting=len(self._joining),
            prefix_hit_tokens=self._hit_tokens,
            prefix_query_tokens=self._query_tokens,
        )

    def kv_sink(self, tokens: Sequence[int], nbytes: int) -> KvSink:
        return SimKvSink(len(tokens), nbytes, self._link)

    def local_kv(self, tokens: Sequence[int]) -> KvSink:
        return LocalKv()

    async def generate(self, job: DecodeJob) -> AsyncGenerator[Generated, None]:
        tokens, kv = job.tokens, job.kv
        local = isinstance(kv, LocalKv)
        if not local and (not isinstance(kv, SimKvSink) or not kv.committed):
            raise ValueError("generate needs a committed KV sink of this engine")
        if self._task is None:
            raise RuntimeError("engine is not running")
        if len(self._running) + len(self._prefilling) + len(self._joining) >= self._max_batch:
            raise EngineBusy("decode batch is full")
        # The sim does not sample: of the sampling fields only ``logprobs`` is read.
        forced = _forced(tokens, job.sampling)
        # A tool call ends the sequence after its last token (the model's end of sequence).
        max_tokens = job.max_tokens if forced is None else min(job.max_tokens, len(forced))
        seq = _Sequence(
            Context(tokens, adapter_salt(job.adapter)),
            len(tokens),
            max_tokens,
            _top_logprobs(job.sampling),
            forced,
        )
        cached = self._cache.lookup_and_insert(tokens)
        if local:
            self._hit_tokens += cached
            self._query_tokens += len(tokens)
            seq.to_prefill = len(tokens) - cached
        self._joining.append(seq)
        self._wakeup.set()
        try:
            # At most max_tokens items are ever queued for a sequence: bounded.
            for _ in range(max_tokens):
                piece = await seq.out.get()
                if piece is None:
                    raise RuntimeError("decode engine stopped")
                yield piece
        finally:
            self._leave(seq)

    def _leave(self, seq: _Sequence) -> None:
        seq.left = True
        if self._running.pop(id(seq), None) is None and self._prefilling.pop(id(seq), None) is None:
            # Still joining: drop it now so it does not count against the batch size.
            with contextlib.suppress(ValueError):
                self._joining.remove(seq)

    @staticmethod
    def _token(seq: _Sequence) -> Generated:
        """The sequence's next token; its context moves past it."""
        context = seq.context
        forced = None if seq.forced is None else seq.forced[seq.produced]
        if forced is None:
            token_id, text = next_token(context)
        else:
            token_id, text = tokenizer.piece_id(forced), forced
        lp = None if seq.top_logprobs is None else token_logprobs(context, seq.top_logprobs, forced)
        context.append(token_id)
        return Generated(text, lp, token_id)

    def _chunks(self, decoding: int) -> list[tuple[_Sequence, int]]:
        """This step's prompt chunks: the token budget left after one decode token per
        running sequence, oldest local prefill first (at least one token, so they progress)."""
        budget = max(1, self._profile.step_tokens - decoding)
        chunks: list[tuple[_Sequence, int]] = []
        for seq in self._prefilling.values():
            if budget <= 0:
                break
            n = min(seq.to_prefill, budget)
            chunks.append((seq, n))
            budget -= n
        return chunks

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        running = self._running
        prefilling = self._prefilling
        while True:
            while self._joining:
                seq = self._joining.popleft()
                if not seq.left:
                    (prefilling if seq.to_prefill else running)[id(seq)] = seq
            if not running and not prefilling:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            started = loop.time()
            context = sum(s.prompt_len + s.produced for s in running.values())
            chunks = self._chunks(len(running))
            done = [
                (s.prompt_len - s.to_prefill + n, s.prompt_len - s.to_prefill) for s, n in chunks
            ]
            step = self._profile.mixed_step_s(len(running), context, done)
            await self._sleep_until(started + step)
            finished: list[_Sequence] = []
            for seq, n in chunks:
                seq.to_prefill -= n
                if seq.to_prefill == 0 and prefilling.pop(id(seq), None) is not None:
                    finished.append(seq)  # the step that completes a prompt samples its token
            for key, seq in [*running.items(), *((id(s), s) for s in finished)]:
                seq.out.put_nowait(self._token(seq))
                seq.produced += 1
                if seq.produced >= seq.max_tokens:
                    running.pop(key, None)
                elif key not in running:
                    running[key] = seq
