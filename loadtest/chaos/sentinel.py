"""A replicated Redis as operators run it, for a benchmark: a primary, a replica and three
sentinels (``redis-server --sentinel``, quorum 2), each a `Child` process, nothing on disk.

`url` is the ``redis+sentinel://`` URL every shim and gateway is given
(registry/_redis_url.py). The faults: `kill_primary` (SIGKILL, then the sentinels promote the
replica), `restart_old_primary` (the killed one back on its port; the sentinels turn it into
a replica of the new primary) and `wipe` (the primary emptied and every client cut off).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from redis.asyncio import Redis
from redis.exceptions import RedisError

from pdgate.loadtest.lib.children import Child, Children, free_port
from pdgate.loadtest.lib.redis import INSTALL_HINT, redis_binary, sentinel_confs, server_argv

__all__ = ["SentinelRedis"]

SERVICE = "pdgate-chaos"
_READY = "Ready to accept connections"
_SENTINEL_READY = r"Sentinel ID is|monitor master"


def _client(port: int) -> Redis:
    return Redis(host="127.0.0.1", port=port, socket_timeout=1.0, socket_connect_timeout=1.0)


class SentinelRedis(Children):
    """``async with SentinelRedis() as s:`` starts the five processes and waits until the
    sentinels know the replica and each other; stops them all on exit."""

    def __init__(self, *, down_after_ms: int = 1000, failover_timeout_ms: int = 5000) -> None:
        self._down_after_ms = down_after_ms
        self._failover_timeout_ms = failover_timeout_ms
        self._dir = Path(tempfile.mkdtemp(prefix="pdgate-bench-sentinel-"))
        self._nodes: dict[int, Child] = {}  # port -> data node
        self._sentinels: list[tuple[int, Child]] = []
        self.primary_port = 0
        self.replica_port = 0
        binary = redis_binary()
        if binary is None:
            raise RuntimeError(INSTALL_HINT)
        self._binary = binary

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port, _ in self._sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def children(self) -> list[Child]:
        return [*self._nodes.values(), *(c for _, c in self._sentinels)]

    async def _node(self, port: int, *extra: str) -> None:
        work = self._dir / f"node-{port}"
        work.mkdir(exist_ok=True)
        child = Child(f"redis-{port}", server_argv(self._binary, port, str(work), *extra))
        self._nodes[port] = child
        await child.start(_READY, timeout_s=10)

    async def _start(self) -> None:
        self.primary_port, self.replica_port = free_port(), free_port()
        await self._node(self.primary_port)
        await self._node(self.replica_port, "--replicaof", "127.0.0.1", str(self.primary_port))
        confs = sentinel_confs(
            self._dir, SERVICE, self.primary_port,
            down_after_ms=self._down_after_ms, failover_timeout_ms=self._failover_timeout_ms,
        )  # fmt: skip
        for i, (port, conf) in enumerate(confs):
            child = Child(f"sentinel-{i}", [self._binary, str(conf), "--sentinel"])
            self._sentinels.append((port, child))
            await child.start(_SENTINEL_READY, timeout_s=10)
        await self._until(self._all_know_all, 30.0, "the sentinels did not find each other")

    async def _all_know_all(self) -> bool:
        for port, _ in self._sentinels:
            client = _client(port)
            try:
                replicas = await client.execute_command("SENTINEL", "REPLICAS", SERVICE)  # type: ignore[no-untyped-call]
                sentinels = await client.execute_command("SENTINEL", "SENTINELS", SERVICE)  # type: ignore[no-untyped-call]
                if len(replicas) < 1 or len(sentinels) < 2:
                    return False
            except (RedisError, OSError):
                return False
            finally:
                await client.aclose()
        return True

    @staticmethod
    async def _until(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> float:
        deadline = time.monotonic() + timeout_s
        began = time.monotonic()
        while not await check():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} in {timeout_s:g} s")
            await asyncio.sleep(0.1)
        return time.monotonic() - began

    async def named_primary(self) -> int | None:
        """The primary's port as the sentinels name it now (None: none answers)."""
        for port, _ in self._sentinels:
            client = _client(port)
            try:
                addr = await client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)  # type: ignore[no-untyped-call]
                if addr:
                    return int(addr[1])
            except (RedisError, OSError):
                continue
            finally:
                await client.aclose()
        return None

    async def role(self, port: int) -> str | None:
        client = _client(port)
        try:
            info = await client.info("replication")
            role = str(info.get("role"))
            if role == "slave" and info.get("master_link_status") != "up":
                return "replica-syncing"
            return "replica" if role == "slave" else role
        except (RedisError, OSError):
            return None
        finally:
            await client.aclose()

    async def kill_primary(self, timeout_s: float = 30.0) -> float:
        """SIGKILL the primary; wait until the sentinels name the replica and it is primary.
        Returns the failover's seconds (kill -> promoted)."""
        old, new = self.primary_port, self.replica_port
        child = self._nodes[old]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        await child.stop(timeout_s=5)

        async def promoted() -> bool:
            return await self.named_primary() == new and await self.role(new) == "master"

        took = await self._until(promoted, timeout_s, "the sentinels did not promote the replica")
        self.primary_port, self.replica_port = new, old
        return took

    async def restart_old_primary(self, timeout_s: float = 30.0) -> float:
        """Start the killed node again on its port, empty, with no replicaof: the sentinels
        reconfigure it as a replica of the new primary. Returns the seconds until it is a
        synced replica."""
        port = self.replica_port
        await self._nodes[port].stop()
        await self._node(port)

        async def synced() -> bool:
            return await self.role(port) == "replica"

        return await self._until(synced, timeout_s, "the old primary did not rejoin as replica")

    async def wipe(self) -> None:
        """What a restart of the primary without persistence does to the registry, without
        the failover a real stop would start: FLUSHALL (replicated: the replica empties
        too), then every client connection (commands and pub/sub) is closed."""
        client = _client(self.primary_port)
        try:
            await client.flushall()
            for kind in ("normal", "pubsub"):
                with contextlib.suppress(RedisError, OSError):
                    await client.execute_command("CLIENT", "KILL", "TYPE", kind, "SKIPME", "yes")  # type: ignore[no-untyped-call]
        finally:
            await client.aclose()

    async def aclose(self) -> None:
        for child in self.children():
            with contextlib.suppress(Exception):
                await child.stop()
        shutil.rmtree(self._dir, ignore_errors=True)
