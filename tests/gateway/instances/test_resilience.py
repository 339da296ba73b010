"""Outlier ejection, the retry budget, and per-try timeouts: failing instances are left out,
hung ones are given up on, and a fleet-wide failure is not multiplied by retries."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from typing import Any

import httpx
import pytest

from pdgate.config import Role
from pdgate.gateway.errors import BadGateway
from pdgate.gateway.instances.health import Ejection, Ejector, RetryBudget
from pdgate.gateway.placement.decode_attempt import client_error
from pdgate.gateway.placement.shared import ForwardingOptions
from pdgate.gateway.upstream.mock import Call, MockUpstream, Reply
from pdgate.registry import InstanceRecord, RedisRegistry
from tests._cluster import SIM_MODEL, Processes, instances_by_id, wait_instances
from tests.gateway._fakes import FakeCluster, forwarder, tracker_for, waiter


def failing(*bad: str) -> Any:
    ok = FakeCluster()

    async def handler(call: Call) -> Reply:
        if any(call.url.endswith(b) for b in bad):
            return Reply(unreachable=True)
        return await ok(call)

    return handler


async def test_consecutive_failures_eject_then_a_half_open_probe_decides() -> None:
    upstream = MockUpstream(failing("p0"))
    tracker = tracker_for([1, 1])
    fwd, metrics, background = forwarder(
        upstream, tracker, ejection=Ejection(consecutive=3, base_s=1.0, max_s=10)
    )

    def tries_at_p0() -> int:
        return sum(1 for c in upstream.calls if c.leg == "prefill" and c.url == "http://p0")

    # p0 ranks first (same load, lower id): it is tried and fails until ejected.
    for i in range(8):
        (await fwd.acquire(waiter(i))).close()
        await asyncio.sleep(0.06)  # past the reject hold, so p0 would be tried again
    assert tries_at_p0() == 3
    assert metrics.registry.get_sample_value("pdgate_ejections_total", {"role": "prefill"}) == 1
    # After the cool-down, one probe: it fails, and the next ejection is longer.
    await asyncio.sleep(0.8)
    for i in range(4):
        (await fwd.acquire(waiter(10 + i))).close()
        await asyncio.sleep(0.06)
    assert tries_at_p0() == 4
    assert metrics.registry.get_sample_value("pdgate_ejections_total", {"role": "prefill"}) == 2
    row = next(r for r in tracker.describe() if r["id"] == "p0")
    assert row["ejected"] is True
    await fwd.close()
    await background.aclose()


async def test_a_success_after_ejection_closes_the_circuit() -> None:
    tracker = tracker_for([1])
    _, metrics, _ = forwarder(MockUpstream(FakeCluster()), tracker)
    ejector = Ejector(tracker, metrics, Ejection(consecutive=2, base_s=0.1))

    def ejected() -> bool:
        return bool(next(iter(tracker.describe()))["ejected"])

    ejector.failure("p0", "prefill")
    assert not ejected()
    ejector.failure("p0", "prefill")
    assert ejected()
    await asyncio.sleep(0.12)
    assert not ejected()  # half-open: eligible again
    ejector.success("p0")  # its probe succeeded
    ejector.failure("p0", "prefill")
    assert not ejected()  # back to needing two failures in a row


async def test_when_every_prefill_fails_the_retry_budget_fails_requests_fast() -> None:
    upstream = MockUpstream(failing("p0", "p1"))
    tracker = tracker_for([1, 1])
    fwd, metrics, background = forwarder(
        upstream,
        tracker,
        ejection=Ejection(consecutive=100),
        budget=RetryBudget(ratio=0.0, burst=2),
    )
    # The instances' failure, not the 5 s deadline's 503, once the budget is spent.
    with pytest.raises(BadGateway, match="failing"):
        await fwd.acquire(waiter(0, deadline_s=5))
    assert sum(1 for c in upstream.calls if c.leg == "prefill") == 3  # first try + 2 retries
    assert metrics.registry.get_sample_value("pdgate_retry_budget_exhausted_total") == 1
    await fwd.close()
    await background.aclose()


async def test_a_hung_prefill_is_given_up_on_after_the_try_timeout() -> None:
    ok = FakeCluster()

    async def handler(call: Call) -> Reply:
        if call.url == "http://p0":
            await asyncio.sleep(30)  # accepted the connection, never answers
        return await ok(call)

    upstream = MockUpstream(handler)
    tracker = tracker_for([1, 1])
    fwd, _, background = forwarder(
        upstream, tracker, ForwardingOptions(try_timeout_s=0.2, client_error=client_error)
    )
    # Given up on p0 and placed on p1, long before p0's answer or the 10 s deadline.
    grant = await fwd.acquire(waiter(0, deadline_s=10))
    assert grant.instance.id == "p1"
    assert any(url.startswith("http://p0/") for url in upstream.released())  # its KV, if any
    grant.close()
    await fwd.close()
    await background.aclose()


class _BlackHole:
    """Accepts TCP connections and never answers (a hung server)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        self.sock.close()
        for c in self.accepted:
            c.close()


def _register_decodes(redis_url: str, prefix: str, ports: dict[str, int]) -> None:
    """Decode records (id -> a loopback port) no shim stands behind."""

    async def register() -> None:
        reg = RedisRegistry(redis_url, key_prefix=prefix)
        for instance_id, port in ports.items():
            record = InstanceRecord(
                id=instance_id,
                role=Role.DECODE,
                url=f"http://127.0.0.1:{port}",
                model=SIM_MODEL,
                capacity=1000,
            )
            await reg.put(record, ttl_s=60, announce=True)
        await reg.aclose()

    asyncio.run(register())


def _completes_on_d_real(url: str, i: int) -> None:
    resp = httpx.post(
        url + "/v1/completions",
        json={"model": SIM_MODEL, "prompt": f"q{i}", "max_tokens": 2},
        timeout=10,
    )
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-pdgate-decode"] == "d-real"


def test_a_decode_that_never_answers_is_passed_over_and_ejected(
    redis_url: str, registry_prefix: str, processes: Processes
) -> None:
    processes.shim("prefill", "--capacity", "4")
    processes.shim("decode", "--capacity", "16", "--instance-id", "d-real")
    hole = _BlackHole()

    try:
        # Ranks before d-real.
        _register_decodes(redis_url, registry_prefix, {"a-hung-decode": hole.port})
        url = processes.gateway(
            env={
                "PDGATE_GATEWAY_DECODE_HEADER_TIMEOUT_S": "0.3",
                "PDGATE_GATEWAY_EJECT_AFTER_FAILURES": "2",
            }
        )
        wait_instances(url, 3)
        for i in range(4):
            time.sleep(0.25)  # past the reject hold: the hung decode ranks first again
            _completes_on_d_real(url, i)  # not left waiting on the hung one
        rows = instances_by_id(url)
        assert rows["a-hung-decode"]["ejected"] is True
        assert len(hole.accepted) == 2  # tried twice, then ejected
    finally:
        hole.close()


def test_a_stopped_prefill_costs_clients_a_pause_not_an_error(processes: Processes) -> None:
    """A prefill that is alive but answers nothing (SIGSTOP): the calls it holds are given
    up after the try timeout and placed again; it computes them forever as far as the fleet
    knows, so the `idle` rule sends it nothing new; its record expires. No client sees an
    error, under load, while it is stopped and after it comes back."""
    a100 = {"PDGATE_SHIM_SIM_PROFILE": "llama-3.1-8b-a100"}
    prefills = [
        processes.shim("prefill", "--capacity", "4", "--instance-id", f"p{i}", env=a100)
        for i in range(2)
    ]
    processes.shim("decode", "--capacity", "32", env=a100)
    url = processes.gateway(env={"PDGATE_GATEWAY_PREFILL_TRY_TIMEOUT_S": "1"})
    wait_instances(url, 3)
    stop = threading.Event()
    codes: list[int] = []

    def client(i: int) -> None:
        while not stop.is_set():
            body = {"model": SIM_MODEL, "prompt": f"client {i} " * 200, "max_tokens": 4}
            codes.append(httpx.post(url + "/v1/completions", json=body, timeout=30).status_code)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        os.kill(prefills[0].proc.pid, signal.SIGSTOP)
        time.sleep(4.0)  # past its record's TTL: it left the view
        os.kill(prefills[0].proc.pid, signal.SIGCONT)
        time.sleep(2.0)  # back, registered again
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert len(codes) > 30 and set(codes) == {200}, sorted(set(codes))


def test_decodes_that_refuse_connections_are_ejected_at_once_and_spend_no_budget(
    redis_url: str, registry_prefix: str, processes: Processes
) -> None:
    """Two decodes whose processes are gone (their ports refuse connections) rank first.
    With a retry budget of one retry and nothing deposited, every request still succeeds on
    the live decode: each refusal ejects its decode at once, and retrying past it takes
    nothing from the budget (the second refusal would otherwise find it empty: a 502)."""
    processes.shim("prefill", "--capacity", "4")
    processes.shim("decode", "--capacity", "16", "--instance-id", "d-real")
    ports = []
    for _ in range(2):
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        ports.append(closed.getsockname()[1])
        closed.close()  # bound, never listening, closed: connections to it are refused

    # Rank before d-real.
    _register_decodes(
        redis_url, registry_prefix, {f"a-dead-decode-{n}": port for n, port in enumerate(ports)}
    )
    url = processes.gateway(
        env={
            "PDGATE_GATEWAY_RETRY_BUDGET_RATIO": "0",
            "PDGATE_GATEWAY_RETRY_BUDGET_BURST": "1",
            "PDGATE_GATEWAY_EJECT_AFTER_FAILURES": "5",
            "PDGATE_GATEWAY_DECODE_CANDIDATES": "3",
        }
    )
    wait_instances(url, 4)
    for i in range(3):
        time.sleep(0.25)  # past the reject hold: were they not ejected, they would rank first
        _completes_on_d_real(url, i)
        rows = instances_by_id(url)
        assert rows["a-dead-decode-0"]["ejected"] and rows["a-dead-decode-1"]["ejected"]
    metrics = httpx.get(url + "/metrics", timeout=5).text
    assert "\npdgate_retry_budget_exhausted_total 0.0\n" in metrics
