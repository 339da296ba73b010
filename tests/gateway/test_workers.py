"""``pdgate gateway --workers N``: several processes on one port, restarted, stopped cleanly."""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests._cluster import SIM_MODEL, Processes, Subprocess, start, wait_for, wait_instances
from tests.registry._stock_server import FAST_PROBES, StockServer

PROBES = {**FAST_PROBES, "PDGATE_GATEWAY_TTFT_TIMEOUT_S": "30"}


def _children(pid: int) -> set[int]:
    raw = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return {int(x) for x in raw.split()}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]
    return state != "Z"


def _served(url: str) -> str:
    # A new connection per request, so the kernel may hand it to either worker.
    with httpx.Client(timeout=10) as client:
        resp = client.post(
            url + "/v1/completions", json={"model": SIM_MODEL, "prompt": "hi", "max_tokens": 2}
        )
        assert resp.status_code == 200, resp.text
        return str(client.get(url + "/health").json()["gateway_id"])


def test_workers_serve_share_the_fleet_restart_and_stop_cleanly(
    processes: Processes,
) -> None:
    processes.shim("prefill", "--capacity", "4")
    processes.shim("decode", "--capacity", "16")
    sup = start(
        processes.procs,
        ["gateway", "--host", "127.0.0.1", "--port", "0", "--workers", "2"],
        {**processes.env, "PDGATE_GATEWAY_GATEWAY_ID": "node1"},
    )
    line = next(x for x in sup.lines if x.startswith("pdgate gateway:"))
    assert "(2 workers)" in line
    url = line.split()[2].removesuffix("/v1")
    wait_instances(url, 2)
    workers = _children(sup.proc.pid)
    assert len(workers) == 2
    ids = {_served(url) for _ in range(20)}
    assert ids <= {"node1-w0", "node1-w1"} and ids
    # Both workers are members of one fleet.
    wait_for(
        lambda: httpx.get(url + "/health").json()["fleet"]["gateways"] == 2,
        what="two workers in the fleet",
    )

    # A worker that dies is replaced; meanwhile the other one serves.
    victim = min(workers)
    os.kill(victim, signal.SIGKILL)
    _served(url)
    wait_for(
        lambda: len(_children(sup.proc.pid) - {victim}) == 2, timeout=15, what="worker restarted"
    )
    wait_for(lambda: sum("ready" in x for x in sup.lines) >= 3, what="the new worker is ready")
    for _ in range(5):
        _served(url)

    # SIGTERM: every worker stops, then the supervisor, cleanly.
    current = _children(sup.proc.pid)
    assert sup.terminate(timeout=30) == 0
    assert not any(_alive(pid) for pid in current)


def _worker_index(pid: int) -> int:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(v for v in env if v.startswith(b"PDGATE_GATEWAY_WORKER_INDEX=")).split(b"=")[1])


def test_workers_without_redis_share_every_slot_and_never_overfill_a_prefill(
    procs: list[Subprocess],
) -> None:
    """``--workers 2`` with the in-memory registry, in front of a stock prefill that queues
    instead of answering 429: a one-slot prefill serves both workers (neither is left with a
    share of 0) and never holds more than its one slot; a worker killed with a prefill call
    in flight leaves no phantom lease behind."""
    model = f"stock-{uuid.uuid4().hex[:8]}"
    prefill = StockServer(model, prefill_s=0.1).start()
    decode = StockServer(model).start()
    sup: Subprocess | None = None
    try:
        args = ["gateway", "--host", "127.0.0.1", "--port", "0", "--workers", "2"]
        args += ["--prefill", f"{prefill.url} capacity=1", "--decode", decode.url]
        env = {**PROBES, "PDGATE_GATEWAY_GATEWAY_ID": "solo"}
        sup = start(procs, args, env)
        url = next(x for x in sup.lines if x.startswith("pdgate gateway:")).split()[2]
        url = url.removesuffix("/v1")
        assert httpx.get(url + "/health", timeout=5).json()["fleet"]["shared"] is False
        # Fresh connections land on both workers; each can use the one slot.
        ids = set()
        for _ in range(20):
            with httpx.Client(timeout=30) as client:
                resp = client.post(
                    url + "/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2}
                )
                assert resp.status_code == 200, resp.text
                ids.add(client.get(url + "/health").json()["gateway_id"])
        assert ids == {"solo-w0", "solo-w1"}
        # A burst from many connections at once: all served, one at a time in the prefill.
        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda i: _post_fresh(url, model, f"burst {i}"), range(8)))
        assert codes == [200] * 8
        assert prefill.stats()["prefill_max"] == 1

        # kill -9 the worker whose prefill call is in flight: its lease goes with it.
        prefill.set_prefill_s(3.0)
        with httpx.Client(timeout=30) as client:
            victim_id = client.get(url + "/health").json()["gateway_id"]
            victim = next(
                pid for pid in _children(sup.proc.pid) if f"-w{_worker_index(pid)}" in victim_id
            )
            with ThreadPoolExecutor(1) as pool:
                pending = pool.submit(
                    client.post,
                    url + "/v1/completions",
                    json={"model": model, "prompt": "doomed", "max_tokens": 2},
                )
                wait_for(lambda: prefill.stats()["prefill_now"] == 1, what="the call in flight")
                os.kill(victim, signal.SIGKILL)
                with contextlib.suppress(httpx.HTTPError):
                    pending.result()
        wait_for(lambda: prefill.stats()["prefill_now"] == 0, timeout=10, what="the call ended")
        prefill.set_prefill_s(0.1)
        # With its lease stuck the one slot would stay taken and this would time out (503).
        assert _post_fresh(url, model, "after the kill", ttft_ms=5000) == 200
    finally:
        if sup is not None:
            # SIGTERM stops the workers too; the SIGKILL `procs` sends would orphan them.
            sup.terminate(timeout=30)
        prefill.kill()
        decode.kill()


def _post_fresh(url: str, model: str, prompt: str, *, ttft_ms: int | None = None) -> int:
    headers = {"x-pdgate-ttft-timeout-ms": str(ttft_ms)} if ttft_ms else {}
    with httpx.Client(timeout=30) as client:
        body = {"model": model, "prompt": prompt, "max_tokens": 2}
        return client.post(url + "/v1/completions", json=body, headers=headers).status_code
