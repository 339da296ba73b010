"""Real Redis servers for tests: a private ``redis-server`` per test, or a shared one.

Tests talk to real Redis only (no fakeredis): registry behaviour depends on server-side
expiry, pub/sub delivery and what a restart forgets, which fakes would only imitate.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import redis
from redis.exceptions import RedisError

from pdgate.loadtest.lib.redis import sentinel_confs, server_argv

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
ENV_URL = "PDGATE_TEST_REDIS_URL"


class RedisServerError(RuntimeError):
    """No usable Redis (binary missing, server not starting, URL not answering)."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ping(url: str, timeout_s: float = 0.5) -> bool:
    """Whether the Redis at `url` answers PING (never raises)."""
    client = redis.Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=None
    )
    try:
        return bool(client.ping())
    except (RedisError, OSError):
        return False
    finally:
        client.close()


def record_ttl_ms(url: str, prefix: str, instance_id: str) -> int:
    """Milliseconds left to an instance's registry record under `prefix` (Redis PTTL:
    negative when there is none or it never expires)."""
    with redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2) as client:
        return int(client.pttl(f"{prefix}:instance:{instance_id}"))


def delete_prefix(url: str, prefix: str) -> int:
    """Delete every key under ``{prefix}:``; returns how many (best effort)."""
    client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    try:
        deleted = 0
        batch: list[bytes] = []
        for key in client.scan_iter(match=f"{prefix}:*", count=500):
            batch.append(key)
            if len(batch) >= 500:
                deleted += int(client.delete(*batch))
                batch.clear()
        if batch:
            deleted += int(client.delete(*batch))
        return deleted
    finally:
        client.close()


class RedisServer:
    """A private ``redis-server`` on 127.0.0.1 that can be stopped and restarted on the same
    port (an empty server again: nothing is persisted)."""

    def __init__(
        self,
        port: int | None = None,
        *,
        binary: str = "redis-server",
        startup_timeout_s: float = 10.0,
        password: str | None = None,
        tls: tuple[Path, Path] | None = None,
        args: Sequence[str] = (),
    ) -> None:
        """`password`: started with ``requirepass``. `tls`: (certificate, key) of a
        self-signed certificate; the server then speaks TLS only (``rediss://``). `args`:
        more flags (``--replicaof HOST PORT``)."""
        self.password = password
        self.tls = tls
        self._args = list(args)
        self._fixed_port = port is not None
        self.port = port if port is not None else free_port()
        self._binary = binary
        self._startup_timeout_s = startup_timeout_s
        self._dir = Path(tempfile.mkdtemp(prefix="pdgate-redis-"))
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls is None:
            return f"redis://{auth}127.0.0.1:{self.port}/0"
        return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls[0]}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start (or restart) the server and wait until it answers PING."""
        if self.running:
            return
        exe = shutil.which(self._binary)
        if exe is None:
            raise RedisServerError(f"{self._binary} not found on PATH")
        # A port picked by free_port() can be taken before redis binds it: pick another.
        for attempt in range(3):
            try:
                self._spawn(exe)
                return
            except RedisServerError:
                if self._fixed_port or attempt == 2:
                    raise
                self.port = free_port()

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL if it lingers; returns once the process is gone."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """SIGKILL: no goodbye to connected clients beyond the kernel closing sockets."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    async def astart(self) -> None:
        await asyncio.to_thread(self.start)

    async def astop(self) -> None:
        await asyncio.to_thread(self.stop)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _spawn(self, exe: str) -> None:
        log = self._dir / "redis.log"
        extra = ["--logfile", str(log)]
        if self.tls is not None:
            cert, key = self.tls
            extra += [
                "--tls-port", str(self.port), "--tls-cert-file", str(cert),
                "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert),
                "--tls-auth-clients", "no",
            ]  # fmt: skip
        if self.password:
            extra += ["--requirepass", self.password]
        # With TLS the plain port is off (0) and `port` is the TLS one.
        port = self.port if self.tls is None else 0
        args = server_argv(exe, port, str(self._dir), *extra, *self._args)
        proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + self._startup_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            if ping(self.url, timeout_s=0.2):
                self._proc = proc
                return
            time.sleep(0.02)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        tail = ""
        with contextlib.suppress(OSError):
            tail = log.read_text(errors="replace")[-500:]
        raise RedisServerError(f"redis-server on port {self.port} did not start: {tail}")


def find_shared_redis() -> tuple[str, RedisServer | None]:
    """A Redis tests may share, with the private server started for it (if any).

    ``$PDGATE_TEST_REDIS_URL`` if set (it must answer), else 127.0.0.1:6379 if it answers,
    else a private ``redis-server``. Raises `RedisServerError` when there is none.
    """
    url = os.environ.get(ENV_URL, "").strip()
    if url:
        if not ping(url, timeout_s=2.0):
            raise RedisServerError(f"${ENV_URL} is set but does not answer PING")
        return url, None
    if ping(DEFAULT_REDIS_URL):
        return DEFAULT_REDIS_URL, None
    server = RedisServer()
    try:
        server.start()
    except RedisServerError:
        server.close()
        raise
    return server.url, server


class SentinelGroup:
    """A replicated Redis as operators run it: a primary, a replica and three sentinels
    (``redis-server --sentinel``, quorum 2), quick to fail over (the primary is judged down
    after `down_after_ms`). `url` is the ``redis+sentinel://`` URL of its service."""

    SERVICE = "pdgate-test"

    def __init__(self, *, down_after_ms: int = 500) -> None:
        self._down_after_ms = down_after_ms
        self.primary = RedisServer()
        self.replica: RedisServer | None = None
        self._dir = Path(tempfile.mkdtemp(prefix="pdgate-sentinel-"))
        self._sentinels: list[tuple[int, subprocess.Popen[bytes]]] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port, _ in self._sentinels)
        return f"redis+sentinel://{hosts}/{self.SERVICE}/0"

    def start(self, timeout_s: float = 20.0) -> None:
        self.primary.start()
        self.replica = RedisServer(args=["--replicaof", "127.0.0.1", str(self.primary.port)])
        self.replica.start()
        exe = shutil.which("redis-server")
        if exe is None:
            raise RedisServerError("redis-server not found on PATH")
        confs = sentinel_confs(
            self._dir, self.SERVICE, self.primary.port,
            down_after_ms=self._down_after_ms, failover_timeout_ms=5000,
        )  # fmt: skip
        for i, (port, conf) in enumerate(confs):
            log = self._dir / f"sentinel{i}.log"
            proc = subprocess.Popen(
                [exe, str(conf), "--sentinel", "--logfile", str(log)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            self._sentinels.append((port, proc))
        # Ready for a failover once every sentinel knows the replica and the two others.
        deadline = time.monotonic() + timeout_s
        while not all(self._knows_all(port) for port, _ in self._sentinels):
            if time.monotonic() > deadline:
                raise RedisServerError("the sentinels did not find each other and the replica")
            time.sleep(0.1)

    def _knows_all(self, port: int) -> bool:
        client = redis.Redis(port=port, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            replicas = client.execute_command("SENTINEL", "REPLICAS", self.SERVICE)
            sentinels = client.execute_command("SENTINEL", "SENTINELS", self.SERVICE)
            return len(replicas) >= 1 and len(sentinels) >= 2
        except (RedisError, OSError):
            return False
        finally:
            client.close()

    def primary_port(self) -> int | None:
        """The primary's port as the sentinels name it now (None: none answers)."""
        for port, _ in self._sentinels:
            client = redis.Redis(port=port, socket_timeout=0.5, socket_connect_timeout=0.5)
            try:
                addr = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.SERVICE)
                if addr:
                    return int(addr[1])
            except (RedisError, OSError):
                continue
            finally:
                client.close()
        return None

    def fail_over(self, timeout_s: float = 20.0) -> RedisServer:
        """Kill -9 the primary; returns the replica once the sentinels promoted it."""
        assert self.replica is not None
        old, new = self.primary, self.replica
        old.kill()
        deadline = time.monotonic() + timeout_s
        while self.primary_port() != new.port or not _is_primary(new):
            if time.monotonic() > deadline:
                raise RedisServerError("the sentinels did not promote the replica")
            time.sleep(0.1)
        self.primary, self.replica = new, old
        return new

    def close(self) -> None:
        for _, proc in self._sentinels:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for server in (self.primary, self.replica):
            if server is not None:
                server.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _is_primary(server: RedisServer) -> bool:
    client = redis.Redis(port=server.port, socket_timeout=0.5, socket_connect_timeout=0.5)
    try:
        return bool(client.info("replication").get("role") == "master")
    except (RedisError, OSError):
        return False
    finally:
        client.close()
