"""Test helpers: real clusters on real sockets.

`ThreadedCluster` runs `pdgate up`'s embedded cluster on its own event loop in a thread, so
tests can drive it with blocking clients (the official openai client); `Subprocess` runs a
``pdgate`` command as a real child process (for kill -9 and registry tests), and
`Processes` starts a test's shims and gateways that way, on one shared registry.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
import openai

from pdgate.config import (
    ClusterSettings,
    GatewaySettings,
    RegistrySettings,
    ServingStrategy,
    ShimSettings,
)
from pdgate.loadtest.up import ClusterInfo, embedded_cluster

SIM_MODEL = "sim-llama-3.1-8b"  # what a sim shim serves unless told otherwise


class ThreadedCluster:
    def __init__(
        self,
        *,
        gateway: dict[str, Any] | None = None,
        shim: dict[str, Any] | None = None,
        prefills: int = 2,
        decodes: int = 2,
        registry: dict[str, Any] | None = None,
        strategy: str = "disaggregated",
    ) -> None:
        self.gateway_settings = GatewaySettings(port=0, **(gateway or {}))
        self.shim_settings = ShimSettings(port=0, **(shim or {}))
        self.cluster_settings = ClusterSettings(
            prefills=prefills, decodes=decodes, strategy=ServingStrategy(strategy)
        )
        self.registry_settings = RegistrySettings(**(registry or {}))
        self._thread = threading.Thread(target=self._main, name="pdgate-cluster", daemon=True)
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.info: ClusterInfo | None = None

    def _main(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            async with embedded_cluster(
                self.gateway_settings,
                self.registry_settings,
                self.shim_settings,
                self.cluster_settings,
            ) as info:
                self.info = info
                self._ready.set()
                await self._stop.wait()
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            raise

    def __enter__(self) -> ThreadedCluster:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("cluster did not start in 30 s")
        if self._error is not None:
            raise RuntimeError("cluster failed to start") from self._error
        self.wait_for(
            lambda: (
                len(self.instances())
                == self.cluster_settings.prefills + self.cluster_settings.decodes
            )
        )
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    @property
    def url(self) -> str:
        assert self.info is not None
        return self.info.gateway_url

    def instances(self) -> list[dict[str, Any]]:
        token = self.gateway_settings.admin_token
        return get_instances(self.url, token.get_secret_value() if token else None)

    def wait_for(
        self, predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition"
    ) -> None:
        wait_for(predicate, timeout, what)


def raw_post(url: str, body: bytes, length: int | None = None) -> socket.socket:
    """A client on a bare socket: ``POST /v1/completions`` to `url` with `body` sent and a
    Content-Length of `length` (default: the body's own; more makes an upload that stalls).
    The socket stays open for the test to read from or drop."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    size = len(body) if length is None else length
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {size}\r\n\r\n".encode()
        + body
    )
    return sock


def keyed_cluster(tmp_path: Path, keys: str, **gateway: Any) -> ThreadedCluster:
    """A one-prefill, one-decode cluster whose gateway reads its client keys from a keys file
    holding `keys` (`gateway`: more gateway settings; the admin token is "adm" unless
    they name another)."""
    keys_file = tmp_path / "keys"
    keys_file.write_text(keys)
    settings = {"api_keys_file": keys_file, "admin_token": "adm", **gateway}
    return ThreadedCluster(prefills=1, decodes=1, gateway=settings)


def openai_client(url: str, api_key: str = "unused") -> openai.OpenAI:
    """The official OpenAI client against the gateway at `url`; it never retries on its own,
    so a test sees every answer."""
    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=30)


def assert_serves_openai(url: str, prompt: str) -> None:
    """The gateway at `url` answers the official client a whole completion of 6 tokens and a
    streamed chat with content."""
    client = openai_client(url)
    whole = client.completions.create(model=SIM_MODEL, prompt=prompt, max_tokens=6)
    assert whole.usage is not None and whole.usage.completion_tokens == 6
    chunks = client.chat.completions.create(
        model=SIM_MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=6,
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def get_instances(gateway_url: str, admin_token: str | None = None) -> list[dict[str, Any]]:
    headers = {"authorization": f"Bearer {admin_token}"} if admin_token else {}
    resp = httpx.get(gateway_url + "/admin/instances", headers=headers, timeout=5)
    resp.raise_for_status()
    rows: list[dict[str, Any]] = resp.json()["instances"]
    return rows


def counts_released(gateway_url: str) -> bool:
    """No open stream and no request in flight left at any instance, as the gateway counts."""
    return all(r["open_streams"] == 0 and r["inflight"] == 0 for r in get_instances(gateway_url))


def nothing_held(gateway_url: str) -> bool:
    """Nothing pending, streaming, in flight or queued at the gateway, and no count left at
    any instance."""
    health = httpx.get(gateway_url + "/health", timeout=5).json()
    counts = (health["pending"], health["open_streams"], health["inflight"], health["queued"])
    return counts == (0, 0, 0, 0) and counts_released(gateway_url)


def queued_heads(gateway_url: str, count: int, group: str | None = None) -> list[float]:
    """Once `count` requests (of `group`, if given) wait in the gateway's queues: each such
    queue's milliseconds to its head's deadline (``head_ms`` at ``GET /admin/queues``)."""
    heads: list[float] = []

    def queued() -> bool:
        rows = httpx.get(gateway_url + "/admin/queues", timeout=5).json()["queues"]
        rows = [r for r in rows if r["queued"] and group in (None, r["group"])]
        heads[:] = [float(r["head_ms"]) for r in rows]
        return sum(int(r["queued"]) for r in rows) == count

    wait_for(queued, what=f"{count} queued")
    return heads


def metric_by_label(url: str, name: str, label: str) -> dict[str, float]:
    """The samples of metric `name` at ``URL/metrics``, keyed by their `label`."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=5).text
    return {
        s.labels[label]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def prefills_at_rest(gateway_url: str) -> bool:
    """Every prefill free as its engine and as the gateway at `gateway_url` see it: no slot
    taken at the shim, none counted in flight by any gateway of the fleet (the others' leases
    arrive with the fleet's sync), none marked busy by a recent 429."""
    rows = [r for r in get_instances(gateway_url) if r["role"] == "prefill"]
    return all(
        not r["busy"] and r["fleet_inflight"] == 0 and shim_load(r["url"])["used"] == 0
        for r in rows
    )


def complete(url: str, prompt: str, max_tokens: int = 2) -> httpx.Response:
    """A completion of the sim model through the gateway at `url`; asserts a 200."""
    resp = httpx.post(
        url + "/v1/completions",
        json={"model": SIM_MODEL, "prompt": prompt, "max_tokens": max_tokens},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    return resp


def shim_load(url: str) -> dict[str, Any]:
    resp = httpx.get(url + "/load", timeout=5)
    resp.raise_for_status()
    data: dict[str, Any] = resp.json()
    return data


def wait_for(
    predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition"
) -> float:
    """Poll `predicate` until true; returns the seconds it took. Fails the test on timeout."""
    start = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def hold_prefill_slot(prefill_url: str, prompt: str = "hold this slot") -> dict[str, Any]:
    """Take a prefill slot directly, as another gateway would; the slot stays taken until the
    KV is fetched, released with DELETE, or the prefill's hold timeout passes."""
    resp = httpx.post(
        prefill_url + "/v1/completions",
        json={
            "prompt": prompt,
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
        },
        timeout=10,
    )
    assert resp.status_code == 200, resp.text
    params: dict[str, Any] = resp.json()["kv_transfer_params"]
    return params


def release_prefill_slot(held: dict[str, Any]) -> None:
    """Free a slot `hold_prefill_slot` took, as a decode does once it has the KV."""
    url = f"http://{held['remote_host']}:{held['remote_port']}/v1/kv/{held['remote_request_id']}"
    assert httpx.delete(url).status_code == 204


class Subprocess:
    """A ``pdgate`` child process; waits for its one "serving" line on stdout."""

    def __init__(
        self, args: list[str], env: dict[str, str] | None = None, ready_marker: str = "http://"
    ) -> None:
        full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdgate.config.cli", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=full_env,
        )
        self.lines: list[str] = []
        self.ready_at: float | None = None
        deadline = time.monotonic() + 30
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"pdgate {args} exited early:\n" + "".join(self.lines))
            self.lines.append(line)
            if ready_marker in line and line.startswith("pdgate"):
                self.ready_at = time.monotonic()
                break
        else:
            self.kill()
            raise RuntimeError(f"pdgate {args} did not start:\n" + "".join(self.lines))
        # Keep draining output so the child never blocks on a full pipe.
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if len(self.lines) < 2000:
                self.lines.append(line)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def terminate(self, timeout: float = 15) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


def refused(
    args: list[str], message: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``pdgate ARGS`` to its end and check that it refused to start as a command should:
    exit status 2 and `message` on stderr, never a traceback."""
    out = subprocess.run(
        [sys.executable, "-m", "pdgate.config.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr, out.stderr
    return out


def registry_env(
    url: str, prefix: str, *, ttl: float = 1.0, heartbeat: float = 0.25, poll: float = 0.25
) -> dict[str, str]:
    return {
        "PDGATE_REGISTRY_URL": url,
        "PDGATE_REGISTRY_KEY_PREFIX": prefix,
        "PDGATE_REGISTRY_TTL_S": str(ttl),
        "PDGATE_REGISTRY_HEARTBEAT_INTERVAL_S": str(heartbeat),
        "PDGATE_REGISTRY_POLL_INTERVAL_S": str(poll),
    }


def start(procs: list[Subprocess], args: list[str], env: dict[str, str]) -> Subprocess:
    p = Subprocess(args, env=env)
    procs.append(p)
    return p


def gateway_url(p: Subprocess) -> str:
    line = next(line for line in p.lines if line.startswith("pdgate gateway:"))
    return line.split()[-1].removesuffix("/v1")


def wait_instances(gateway_url: str, n: int, timeout: float = 10.0) -> None:
    """Until the gateway lists `n` instances."""
    wait_for(lambda: len(get_instances(gateway_url)) == n, timeout, f"{n} instances listed")


def instances_by_id(gateway_url: str) -> dict[str, dict[str, Any]]:
    return {row["id"]: row for row in get_instances(gateway_url)}


def instance_urls(gateway_url: str, role: str) -> list[str]:
    return [row["url"] for row in get_instances(gateway_url) if row["role"] == role]


class Processes:
    """A test's shims and gateways, each a ``pdgate`` process on loopback with settings `env`
    (a shared registry: `registry_env`), killed after the test with the rest of `procs`."""

    def __init__(self, procs: list[Subprocess], env: Mapping[str, str]) -> None:
        self.procs = procs
        self.env = dict(env)

    def shim(self, role: str, *args: str, env: Mapping[str, str] | None = None) -> Subprocess:
        """A sim shim of `role`; `args` are more flags, `env` more settings."""
        argv = ["shim", "--host", "127.0.0.1", "--port", "0", "--role", role, *args]
        return start(self.procs, argv, {**self.env, **(env or {})})

    def gateway(self, *args: str, env: Mapping[str, str] | None = None) -> str:
        """A gateway (`args`: more flags, `env`: more settings); its URL."""
        argv = ["gateway", "--host", "127.0.0.1", "--port", "0", *args]
        return gateway_url(start(self.procs, argv, {**self.env, **(env or {})}))

    def gateways(self, n: int, instances: int, env: Mapping[str, str]) -> list[str]:
        """`n` gateways named gw0, gw1, ... (`env`: more settings), returned once each sees
        `instances` instances; their URLs."""
        urls = [self.gateway(env={**env, "PDGATE_GATEWAY_GATEWAY_ID": f"gw{i}"}) for i in range(n)]
        for url in urls:
            wait_instances(url, instances)
        return urls
