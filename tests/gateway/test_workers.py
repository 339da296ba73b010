"""``pdgate gateway --workers N``: several processes on one port, restarted, stopped cleanly."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx

from tests._cluster import Subprocess, get_instances, registry_env, start, wait_for

MODEL = "sim-llama-3.1-8b"


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
            url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}
        )
        assert resp.status_code == 200, resp.text
        return str(client.get(url + "/health").json()["gateway_id"])


def test_workers_serve_share_the_fleet_restart_and_stop_cleanly(
    redis_url: str, registry_prefix: str, procs: list[Subprocess]
) -> None:
    env = registry_env(redis_url, registry_prefix)
    shim = ["shim", "--host", "127.0.0.1", "--port", "0"]
    start(procs, [*shim, "--role", "prefill", "--capacity", "4"], env)
    start(procs, [*shim, "--role", "decode", "--capacity", "16"], env)
    sup = start(
        procs,
        ["gateway", "--host", "127.0.0.1", "--port", "0", "--workers", "2"],
        {**env, "PDGATE_GATEWAY_GATEWAY_ID": "node1"},
    )
    line = next(x for x in sup.lines if x.startswith("pdgate gateway:"))
    assert "(2 workers)" in line
    url = line.split()[2].removesuffix("/v1")
    wait_for(lambda: len(get_instances(url)) == 2, what="instances seen")
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
    began = time.monotonic()
    assert sup.terminate(timeout=30) == 0
    assert time.monotonic() - began < 20
    assert not any(_alive(pid) for pid in current)
