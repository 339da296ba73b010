"""The decode's asynchronous KV retrieval: a bounded queue served by a few worker tasks.

P/D-Serve (section 3.6, "Asynchronous Retrieval"): KV transfers run concurrently with the
running batch and the space for pending transfers is a deliberately small local queue. Here
a request that was admitted queues a `PullJob`; a worker pulls ``GET {prefill}/v1/kv/{id}``,
checks the token count, length and blake2b digest while feeding the bytes to the backend's
`KvSink`, then commits the sink (which, in the sim, adds the modelled full-size transfer
time). The request awaits the job and then joins the running batch.

A job abandoned while queued (the client left) is released at the prefill with a DELETE; one
abandoned mid-pull is cancelled, which closes the connection, and the prefill frees the KV
when its response ends. Either way the prefill's slot does not wait for its hold timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from hashlib import blake2b

import aiohttp

from engine_shim.backend import DecodeBackend, KvSink
from engine_shim.wire import KV_DIGEST_HEADER, KV_TOKENS_HEADER

log = logging.getLogger("pdgate.shim.decode")

_RELEASE_TIMEOUT_S = 2.0


class KvTransferError(Exception):
    """The KV could not be pulled or failed verification."""


@dataclass(eq=False, slots=True)
class PullJob:
    url: str
    tokens: Sequence[int]
    request_id: str
    future: asyncio.Future[KvSink] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    task: asyncio.Task[KvSink] | None = None
    abandoned: bool = False
    claimed: bool = False  # the sink was handed to the engine, which owns it from then on


class KvRetriever:
    def __init__(
        self,
        backend: DecodeBackend,
        *,
        queue_size: int,
        workers: int,
        fetch_timeout_s: float,
        chunk_bytes: int = 256 * 1024,
    ) -> None:
        self._backend = backend
        self._queue: asyncio.Queue[PullJob] = asyncio.Queue(maxsize=queue_size)
        self._n_workers = workers
        self._fetch_timeout_s = fetch_timeout_s
        self._chunk_bytes = chunk_bytes
        self._workers: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None
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

    def submit(self, url: str, tokens: Sequence[int], request_id: str) -> PullJob:
        """Queue a pull; raises `asyncio.QueueFull` when the retrieval queue is full."""
        job = PullJob(url, tokens, request_id)
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
        if job.task is not None and not job.task.done():
            job.task.cancel()
        if not job.future.done():
            job.future.cancel()
        elif not job.future.cancelled() and job.future.exception() is None:
            job.future.result().discard()

    async def _work(self) -> None:
        while True:
            job = await self._queue.get()
            if job.abandoned:
                await self._release_remote(job)
                continue
            self._retrieving += 1
            job.task = asyncio.create_task(self._pull(job))
            try:
                await asyncio.wait((job.task,))
            except asyncio.CancelledError:
                job.task.cancel()
                raise
            finally:
                self._retrieving -= 1
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
        assert self._session is not None, "retriever not started"
        sink: KvSink | None = None
        try:
            timeout = aiohttp.ClientTimeout(total=self._fetch_timeout_s)
            async with self._session.get(
                job.url, timeout=timeout, headers={"x-request-id": job.request_id}
            ) as resp:
                if resp.status != 200:
                    raise KvTransferError(f"prefill answered HTTP {resp.status} to the KV pull")
                tokens = resp.headers.get(KV_TOKENS_HEADER)
                digest = resp.headers.get(KV_DIGEST_HEADER)
                nbytes = resp.content_length
                if tokens is None or digest is None or nbytes is None:
                    raise KvTransferError("KV response lacks its token count, digest or length")
                if int(tokens) != len(job.tokens):
                    raise KvTransferError(
                        f"KV holds {tokens} tokens but the prompt has {len(job.tokens)}"
                    )
                sink = self._backend.kv_sink(job.tokens, nbytes)
                hasher = blake2b(digest_size=16)
                received = 0
                async for chunk in resp.content.iter_chunked(self._chunk_bytes):
                    received += len(chunk)
                    hasher.update(chunk)
                    sink.write(chunk)
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

    async def _release_remote(self, job: PullJob) -> None:
        assert self._session is not None
        try:
            async with self._session.delete(
                job.url, timeout=aiohttp.ClientTimeout(total=_RELEASE_TIMEOUT_S)
            ) as resp:
                await resp.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            log.info(
                "releasing abandoned KV %s failed (%s); its hold timeout frees it",
                job.request_id,
                exc,
            )
