"""A prefill lets go of the KV it holds for a gateway that left the fleet.

Real processes on a real Redis: a prefill (hold timeout 120 s), a decode and two gateways
sharing the fleet. Gateway A places a request while the decode is stopped (SIGSTOP), so the
prefill holds its KV for A; then A is killed (-9). Its fleet entry expires, and the prefill
releases that KV (and its slot) long before the hold timeout; KV it holds for gateway B,
alive, stays held. The in-memory watch's rules (two misses in a row, Redis away) are checked
beside it with `StaticLiveness`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Any

import httpx

from pdgate.config.wire import GATEWAY_ID_HEADER
from pdgate.engine_shim._gateway_watch import GatewayWatch, StaticLiveness
from pdgate.engine_shim._kv_store import HeldKv, KvStore
from pdgate.registry.base import RegistryUnavailable
from tests._cluster import (
    SIM_MODEL,
    Processes,
    instance_urls,
    shim_load,
    wait_for,
    wait_instances,
)


def test_the_kv_held_for_a_killed_gateway_is_released_and_a_live_one_s_kept(
    processes: Processes,
) -> None:
    hold = {"PDGATE_SHIM_KV_HOLD_TIMEOUT_S": "120"}
    processes.shim("prefill", "--capacity", "4", env=hold)
    decode = processes.shim("decode", "--capacity", "4")
    dying = processes.gateway()
    alive = processes.gateway()
    wait_instances(dying, 2)
    wait_instances(alive, 2)
    (prefill,) = instance_urls(alive, "prefill")
    alive_id = httpx.get(alive + "/health", timeout=5).json()["gateway_id"]
    assert httpx.get(dying + "/health", timeout=5).json()["fleet"]["shared"] is True

    # B's KV: a prefill call as gateway B makes it, never pulled.
    body: dict[str, Any] = {
        "model": SIM_MODEL,
        "prompt": "held for the live gateway",
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
    }
    resp = httpx.post(
        prefill + "/v1/completions", json=body, headers={GATEWAY_ID_HEADER: alive_id}, timeout=10
    )
    assert resp.status_code == 200, resp.text
    # A's KV: its request is prefilled, and its decode leg goes nowhere (the decode stopped).
    os.kill(decode.proc.pid, signal.SIGSTOP)
    try:
        request = threading.Thread(
            target=lambda: _quietly_post(dying, {"model": SIM_MODEL, "prompt": "for A"}),
            daemon=True,
        )
        request.start()
        wait_for(lambda: shim_load(prefill)["kv_held"] == 2, 10, "the prefill holding A's KV")
        dying_id = httpx.get(dying + "/health", timeout=5).json()["gateway_id"]
        assert shim_load(prefill)["kv_gateways"] == sorted([alive_id, dying_id])
        dead = [p for p in processes.procs if p.lines and _serves(p, dying)]
        assert len(dead) == 1
        dead[0].kill()
        # A's fleet entry expires (2 s), then two checks: far within the 120 s hold.
        wait_for(lambda: shim_load(prefill)["kv_held"] == 1, 30, "A's KV released")
        load = shim_load(prefill)
        assert load["kv_gateway_gone"] == 1 and load["used"] == 1  # B's still held
        assert load["kv_expired"] == 0 and load["kv_gateways"] == [alive_id]
    finally:
        os.kill(decode.proc.pid, signal.SIGCONT)


def _quietly_post(url: str, body: dict[str, Any]) -> None:
    with contextlib.suppress(httpx.HTTPError):  # its gateway is killed under it
        httpx.post(url + "/v1/completions", json={**body, "max_tokens": 2}, timeout=30)


def _serves(proc: Any, url: str) -> bool:
    return any(line.startswith("pdgate gateway:") and url in line for line in proc.lines)


class _Slot:
    def release(self) -> None:
        return None


class _Kv:
    nbytes = 0

    def release(self) -> None:
        return None


class _Away(StaticLiveness):
    async def live(self, gateway_ids: Any) -> set[str]:
        raise RegistryUnavailable("redis away")


async def test_the_watch_releases_on_the_second_miss_and_decides_nothing_without_redis() -> None:
    store = KvStore(hold_timeout_s=120)
    for n, gateway in enumerate(["gw-a", "gw-a", "gw-b", ""]):
        store.put(HeldKv(f"kv-{n}", _Kv(), _Slot(), gateway))  # type: ignore[arg-type]
    liveness = StaticLiveness({"gw-b"})
    watch = GatewayWatch(store, liveness, interval_s=1.0)
    assert await watch.check() == 0 and len(store) == 4  # one miss: maybe a late renewal
    assert await watch.check() == 2 and len(store) == 2  # gone twice: released
    assert store.gateways() == ["gw-b"]
    away = GatewayWatch(store, _Away(), interval_s=1.0)
    assert await away.check() == 0 and await away.check() == 0 and len(store) == 2
    liveness.gateways.clear()
    assert await watch.check() == 0  # gw-b's first miss
    liveness.gateways.add("gw-b")
    assert await watch.check() == 0 and len(store) == 2  # back: the miss is forgotten
    store.close()
