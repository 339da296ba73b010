"""The decode's asynchronous KV retrieval: a bounded queue served by a few worker tasks.

P/D-Serve (section 3.6, "Asynchronous Retrieval"): KV transfers run concurrently with the
running batch and the space for pending transfers is a deliberately small local queue. Here
a request that was admitted queues a `PullJob`; a worker pulls ``GET {prefill}/v1/kv/{id}``,
checks the token count, length and blake2b digest while feeding the bytes to the backend's
`KvSink`, then commits the sink (which, in the sim, adds the modelled full-size transfer
time). The request awaits the job and then joins the running batch.

Who releases the KV at the prefill when a pull does not complete: once the prefill has
answered the GET, it took the KV out of its store and frees it when its response ends, so
closing the connection is enough. Before that (the job still queued, the connection still
being made or the request not yet read) the prefill still holds it and only a
``DELETE`` frees it; this side sends one, at once, off the workers' path. Either way the
prefill's slot does not wait for its hold timeout.

Both calls carry the cluster token (the prefill refuses them without it), and each pull is a
trace span (``pdgate.shim.kv_pull``: bytes, tokens, outcome) under its request's span.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from hashlib import blake2b

import aiohttp

from pdgate.config.aio import Background
from pdgate.config.tracing import Span, Tracing
from pdgate.config.wire import KV_DIGEST_HEADER, KV_TOKENS_HEADER, REQUEST_ID_HEADER
from pdgate.engine_shim.backend import DecodeBackend, KvSink

log = logging.getLogger("pdgate.shim.decode")

_RELEASE_TIMEOUT_S = 2.0


class KvTransferError(Exception):
    """The KV could not be pulled or failed verification."""


@dataclass(eq=False, slots=True)
class PullJob:
    url: str
    tokens: Sequence[int]
    request_id: str
    span: Span | None = None  # the request's trace span (the pull's is its child)
    future: asyncio.Future[KvSink] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    task: asyncio.Task[KvSink] | None = None
    abandoned: bool = False
    claimed: bool = False  # the sink was handed to the engine, which owns it from then on
    answered: bool = False  # the prefill answered the GET: it owns the release from then on
    released: bool = False  # a DELETE was sent


class KvRetriever:
    def __init__(
        self,
        backend: DecodeBackend,
        *,
        queue_size: int,
        workers: int,
        fetch_timeout_s: float,
        chunk_bytes: int = 256 * 1024,
        headers: Mapping[str, str] | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self._backend = backend
        self._headers = dict(headers or {})  # the cluster token
        self._tracing = tracing or Tracing.off()
        self._queue: asyncio.Queue[PullJob] = asyncio.Queue(maxsize=queue_size)
        self._n_workers = workers
        self._fetch_timeout_s = fetch_timeout_s
        self._chunk_bytes = chunk_bytes
        self._workers: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None
        self._releases = Background("kv-release", limit=4 * queue_size + 4 * workers)
        self._retrieving = 0
        self.failed = 0  # cumulative

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    @property
    def retrieving(self) -> int:
        return self._retrieving

    def start(self, session: aiohttp.ClientSession) -> None:
        self._session = session
        self._workers = [
            asyncio.create_task(self._work(), name=f"kv-retrieval-{i}")
            for i in range(self._n_workers)
        ]

    async def aclose(self) -> None:
        for worker in self._workers:
            worker.cancel()
        for worker in self._workers:
            with contextlib.suppress(asyncio.CancelledError):
                await worker
        self._workers = []
        while not self._queue.empty():
            job = self._queue.get_nowait()
            if not job.future.done():
                job.future.set_exception(KvTransferError("decode worker is shutting down"))
        await self._releases.aclose(grace_s=_RELEASE_TIMEOUT_S)

    def submit(
        self, url: str, tokens: Sequence[int], request_id: str, span: Span | None = None
    ) -> PullJob:
        """Queue a pull; raises `asyncio.QueueFull` when the retrieval queue is full."""
        job = PullJob(url, tokens, request_id, span)
        self._queue.put_nowait(job)
        return job

    async def wait(self, job: PullJob) -> KvSink:
        """The committed sink of `job`; the caller then owns it (see `claim`)."""
        try:
            sink = await job.future
        except asyncio.CancelledError:
            self.abandon(job)
            raise
        job.claimed = True
        return sink

    def abandon(self, job: PullJob) -> None:
        """The request no longer wants this KV. Idempotent; a no-op once claimed."""
        if job.claimed or job.abandoned:
            return
        job.abandoned = True
        if job.task is None:
            # Still queued: release it now rather than when a worker gets to it, which may
            # be a whole fetch timeout away if the workers are busy with slow prefills.
            self._release(job)
        elif not job.task.done():
            job.task.cancel()  # the worker releases it if the prefill had not answered
        if not job.future.done():
            job.future.cancel()
        elif not job.future.cancelled() and job.future.exception() is None:
            job.future.result().discard()

    async def _work(self) -> None:
        while True:
            job = await self._queue.get()
            if job.abandoned:
                continue  # released when it was abandoned
            self._retrieving += 1
            job.task = asyncio.create_task(self._pull(job))
            try:
                await asyncio.wait((job.task,))
            except asyncio.CancelledError:
                job.task.cancel()
                raise
            finally:
                self._retrieving -= 1
            if not job.answered and (job.task.cancelled() or job.task.exception() is not None):
                # Abandoned or failed before the prefill took the KV: it still holds it.
                self._release(job)
            if job.future.done():  # abandoned while pulling
                if not job.task.cancelled() and job.task.exception() is None:
                    job.task.result().discard()
                continue
            if job.task.cancelled():
                job.future.cancel()
            elif (exc := job.task.exception()) is not None:
                self.failed += 1
                job.future.set_exception(exc)
            else:
                job.future.set_result(job.task.result())

    async def _pull(self, job: PullJob) -> KvSink:
        span = self._tracing.start("pdgate.shim.kv_pull", parent=job.span)
        outcome = "failed"
        try:
            sink = await self._fetch(job, span)
            outcome = "ok"
            return sink
        except asyncio.CancelledError:
            outcome = "abandoned"
            raise
        finally:
            if span.is_recording():
                span.set_attribute("pdgate.outcome", outcome)
                span.set_attribute("pdgate.kv_tokens", len(job.tokens))
            span.end()

    async def _fetch(self, job: PullJob, span: Span) -> KvSink:
        assert self._session is not None, "retriever not started"
        sink: KvSink | None = None
        try:
            timeout = aiohttp.ClientTimeout(total=self._fetch_timeout_s)
            headers = {**self._headers, REQUEST_ID_HEADER: job.request_id}
            self._tracing.inject(span, headers)
            async with self._session.get(job.url, timeout=timeout, headers=headers) as resp:
                job.answered = True
                if resp.status != 200:
                    raise KvTransferError(f"prefill answered HTTP {resp.status} to the KV pull")
                tokens = resp.headers.get(KV_TOKENS_HEADER)
                digest = resp.headers.get(KV_DIGEST_HEADER)
                nbytes = resp.content_length
                if tokens is None or digest is None or nbytes is None:
                    raise KvTransferError("KV response lacks its token count, digest or length")
                held = int(tokens)
                # A continued stream's prompt (EXT_CONTINUATION) is the KV's prompt plus tokens
                # the client was already sent: the engine computes those after the KV.
                if not 0 < held <= len(job.tokens):
                    raise KvTransferError(
                        f"KV holds {tokens} tokens but the prompt has {len(job.tokens)}"
                    )
                sink = self._backend.kv_sink(job.tokens[:held], nbytes)
                hasher = blake2b(digest_size=16)
                received = 0
                async for chunk in resp.content.iter_chunked(self._chunk_bytes):
                    received += len(chunk)
                    hasher.update(chunk)
                    sink.write(chunk)
                if span.is_recording():
                    span.set_attribute("pdgate.kv_bytes", received)
                if received != nbytes:
                    raise KvTransferError(f"KV truncated: {received} of {nbytes} bytes")
                if hasher.hexdigest() != digest.lower():
                    raise KvTransferError("KV digest mismatch")
            await sink.commit()
            return sink
        except BaseException as exc:
            if sink is not None:
                sink.discard()
            if isinstance(exc, KvTransferError | asyncio.CancelledError):
                raise
            if isinstance(exc, aiohttp.ClientError | TimeoutError | OSError | ValueError):
                raise KvTransferError(f"KV pull failed: {type(exc).__name__}: {exc}") from exc
            raise

    def _release(self, job: PullJob) -> None:
        if not job.released:
            job.released = True
            self._releases.spawn(self._release_remote(job))

    async def _release_remote(self, job: PullJob) -> None:
        assert self._session is not None
        try:
            async with self._session.delete(
                job.url,
                headers={**self._headers, REQUEST_ID_HEADER: job.request_id},
                timeout=aiohttp.ClientTimeout(total=_RELEASE_TIMEOUT_S),
            ) as resp:
                await resp.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            log.info(
                "releasing abandoned KV %s failed (%s); its hold timeout frees it",
                job.request_id,
                exc,
            )
