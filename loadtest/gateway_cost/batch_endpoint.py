"""Does the shims' batch prefill endpoint beat one call per request?

Batch forwarding (the gateway sends a run of queued requests to one prefill) can make that
run one HTTP call (``prefill_batch_endpoint = true``) or one call per request. This runs the
same closed loop against both, interleaved, on a cluster of ``null``-profile engines (no
simulated compute, so the gateway's and the shims' own costs are what differ), and reports
requests/s, latency and CPU per request of the cluster process.

    python -m pdgate.loadtest.gateway_cost.batch_endpoint [--seconds 8] [--rounds 3] [--users 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from pdgate.loadtest.lib.children import Child, run_main


def _config(batch_endpoint: bool, capacity: int) -> str:
    return (
        "[gateway]\nbatch_forwarding = true\n"
        f"prefill_batch_endpoint = {str(batch_endpoint).lower()}\n"
        '[shim]\nsim_profile = "null"\n'
        f"capacity = {capacity}\n"
        "[cluster]\nprefills = 2\ndecodes = 2\n"
    )


def _write_config(batch_endpoint: bool, capacity: int) -> Path:
    fd, name = tempfile.mkstemp(suffix=".toml")
    with os.fdopen(fd, "w") as fh:
        fh.write(_config(batch_endpoint, capacity))
    return Path(name)


def _cluster(config: Path) -> Child:
    argv = [sys.executable, "-m", "pdgate.config.cli", "--log-level", "WARNING", "up",
            "--config", str(config), "--port", "0"]  # fmt: skip
    return Child("pdgate up", argv)


async def _user(session: aiohttp.ClientSession, url: str, stop_at: float, lat: list[float]) -> int:
    errors = 0
    body = orjson.dumps({"prompt": "batch endpoint benchmark " * 8, "max_tokens": 2})
    while time.monotonic() < stop_at:
        start = time.monotonic()
        async with session.post(url, data=body, headers={"content-type": "application/json"}) as r:
            await r.read()
            if r.status == 200:
                lat.append(time.monotonic() - start)
            else:
                errors += 1
    return errors


async def _round(batch_endpoint: bool, args: argparse.Namespace) -> dict[str, float]:
    cfg = _write_config(batch_endpoint, args.capacity)
    proc = _cluster(cfg)
    try:
        ready = await proc.start(r"pdgate up: send OpenAI requests to (http://[\w.:]+)", 60)
        url = ready.group(1) + "/v1/completions"
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            warm: list[float] = []
            await asyncio.gather(
                *(_user(session, url, time.monotonic() + 1, warm) for _ in range(8))
            )
            lat: list[float] = []
            cpu0, t0 = proc.cpu_s(), time.monotonic()
            stop_at = t0 + args.seconds
            errors = sum(
                await asyncio.gather(
                    *(_user(session, url, stop_at, lat) for _ in range(args.users))
                )
            )
            cpu, wall = proc.cpu_s() - cpu0, time.monotonic() - t0
        lat.sort()
        return {
            "rps": len(lat) / wall,
            "p50_ms": 1000 * lat[len(lat) // 2],
            "p99_ms": 1000 * lat[int(len(lat) * 0.99)],
            "cluster_cpu_ms_per_req": 1000 * cpu / max(len(lat), 1),
            "errors": float(errors),
        }
    finally:
        await proc.stop()
        cfg.unlink()


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, list[dict[str, float]]] = {"per_request": [], "batch_endpoint": []}
    for _ in range(args.rounds):  # interleaved: drift on a shared machine hits both alike
        runs["per_request"].append(await _round(False, args))
        runs["batch_endpoint"].append(await _round(True, args))
    summary = {
        name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()
    }
    summary["ratio_batch_over_per_request"] = {
        k: summary["batch_endpoint"][k] / summary["per_request"][k]
        for k in ("rps", "p50_ms", "p99_ms", "cluster_cpu_ms_per_req")
        if summary["per_request"][k]
    }
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pdgate.loadtest.gateway_cost.batch_endpoint", description=__doc__
    )
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--users", type=int, default=64)
    p.add_argument("--capacity", type=int, default=8, help="prefill slots (decode too)")
    args = p.parse_args(argv)
    print(orjson.dumps(run_main(_main(args)), option=orjson.OPT_INDENT_2).decode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
