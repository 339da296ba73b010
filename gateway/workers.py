"""``pdgate gateway --workers N``: N gateway processes behind one listening socket.

A Python gateway uses one core per process, so a node runs several. The supervisor binds the
socket once and hands it to each worker (the kernel spreads connections between the
processes accepting on it); each worker is a whole gateway with its own fleet identity, so
they share load through the Redis registry like gateways on different hosts. Without Redis
they lease prefill slots from one `SlotTable` the supervisor creates and hands down with the
socket (registry/_slot_table.py); a worker that exits has its slots zeroed at once. The
supervisor restarts a worker that dies (with a back-off, so a worker that cannot start does
not spin) and, on SIGTERM or SIGINT, stops them all: SIGTERM, then SIGKILL after the grace
period.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence

from pdgate.config.aio import ExponentialBackoff
from pdgate.registry.fleet import SlotTable

log = logging.getLogger("pdgate.workers")

READY = "pdgate gateway worker"  # each worker's first line on stdout once it serves


class _Worker:
    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: asyncio.subprocess.Process | None = None
        self.started = 0.0
        self.restarts = 0


class Supervisor:
    def __init__(
        self,
        sock: socket.socket,
        workers: int,
        argv: Sequence[str],
        *,
        gateway_id: str | None,
        grace_s: float = 15.0,
    ) -> None:
        self._sock = sock
        self._argv = list(argv)  # the worker's own `pdgate gateway ...` arguments
        self._gateway_id = gateway_id or f"gw-{os.getpid()}"
        self._grace_s = grace_s
        self._workers = [_Worker(i) for i in range(workers)]
        self._ready: asyncio.Queue[int] = asyncio.Queue()
        self._stopping = False
        self._backoff = ExponentialBackoff(0.5, 10.0, jitter=0.2)
        self._relays: set[asyncio.Task[None]] = set()
        self._slots = SlotTable.create(workers)

    def _env(self, index: int) -> dict[str, str]:
        return {
            **os.environ,
            "PDGATE_GATEWAY_WORKERS": str(len(self._workers)),
            "PDGATE_GATEWAY_WORKER_INDEX": str(index),
            "PDGATE_GATEWAY_GATEWAY_ID": f"{self._gateway_id}-w{index}",
            "PDGATE_GATEWAY_WORKER_SLOTS_FD": str(self._slots.fd),
            "PYTHONUNBUFFERED": "1",
        }

    async def _spawn(self, worker: _Worker) -> None:
        fd = self._sock.fileno()
        worker.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "pdgate.config.cli",
            *self._argv,
            "--listen-fd",
            str(fd),
            pass_fds=(fd, self._slots.fd),
            env=self._env(worker.index),
            stdout=asyncio.subprocess.PIPE,
        )
        worker.started = time.monotonic()
        relay = asyncio.create_task(self._relay(worker, worker.proc))
        self._relays.add(relay)
        relay.add_done_callback(self._relays.discard)

    async def _relay(self, worker: _Worker, proc: asyncio.subprocess.Process) -> None:
        """Pass a worker's stdout through, noting when it is ready."""
        assert proc.stdout is not None
        async for line in proc.stdout:
            text = line.decode(errors="replace")
            if text.startswith(READY):
                self._ready.put_nowait(worker.index)
            sys.stdout.write(text)
            sys.stdout.flush()

    async def run(self, stop: asyncio.Event, announce: str) -> int:
        try:
            return await self._run(stop, announce)
        finally:
            self._slots.close()

    async def _run(self, stop: asyncio.Event, announce: str) -> int:
        for w in self._workers:
            await self._spawn(w)
        pending = {w.index for w in self._workers}
        while pending:
            waiting = asyncio.ensure_future(self._ready.get())
            exited = [asyncio.ensure_future(w.proc.wait()) for w in self._workers if w.proc]
            stopped = asyncio.ensure_future(stop.wait())
            done, _ = await asyncio.wait(
                [waiting, stopped, *exited], return_when=asyncio.FIRST_COMPLETED
            )
            for fut in (waiting, stopped, *exited):
                if fut not in done:
                    fut.cancel()
            if stopped in done:
                await self._stop_all()
                return 0
            if waiting in done:
                pending.discard(waiting.result())
                continue
            await self._stop_all()
            print("pdgate gateway: a worker exited during start-up", file=sys.stderr)
            return 1
        print(announce, flush=True)
        watch = asyncio.create_task(self._watch(stop))
        await stop.wait()
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
        await self._stop_all()
        return 0

    async def _watch(self, stop: asyncio.Event) -> None:
        """Restart workers that die, until told to stop."""
        while not stop.is_set():
            waits = {asyncio.ensure_future(w.proc.wait()): w for w in self._workers if w.proc}
            try:
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for fut in waits:
                    fut.cancel()
            for fut in done:
                worker = waits[fut]
                code = fut.result()
                # Its requests are gone with it: so are its slot leases.
                self._slots.clear_worker(worker.index)
                # A worker that lived a while earns a fresh back-off.
                if time.monotonic() - worker.started > 30:
                    worker.restarts = 0
                delay = self._backoff.delay(worker.restarts)
                worker.restarts += 1
                log.warning(
                    "gateway worker %d exited with %s; restarting in %.1f s",
                    worker.index,
                    code,
                    delay,
                )
                await asyncio.sleep(delay)
                if not stop.is_set():
                    await self._spawn(worker)

    async def _stop_all(self) -> None:
        procs = [w.proc for w in self._workers if w.proc and w.proc.returncode is None]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        if not procs:
            return
        _, slow = await asyncio.wait([asyncio.ensure_future(p.wait()) for p in procs],
                                     timeout=self._grace_s)  # fmt: skip
        for p in procs:
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
        for fut in slow:
            with contextlib.suppress(asyncio.CancelledError):
                await fut
