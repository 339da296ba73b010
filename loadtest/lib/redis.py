"""A throw-away ``redis-server`` on a free port: the registry of a cluster deployed as
separate processes (gateways and shims find each other through it, as in production)."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from pdgate.loadtest.lib.children import Child, find_binary, free_port

__all__ = [
    "INSTALL_HINT",
    "private_redis",
    "redis_binary",
    "sentinel_confs",
    "server_argv",
]

INSTALL_HINT = "redis-server not found (make redis-server installs Debian's package)"
_ATTEMPTS = 3  # a port picked free can be taken before redis binds it: pick another


def redis_binary() -> str | None:
    # Debian installs it in /usr/bin, which a trimmed PATH (cron, systemd) may lack.
    return find_binary("redis-server", "/usr/bin", "/usr/sbin", "/usr/local/bin")


def server_argv(binary: str, port: int, workdir: str, *extra: str) -> list[str]:
    """A redis-server on 127.0.0.1:`port` that keeps nothing on disk, in the foreground."""
    return [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", workdir, "--daemonize", "no", *extra]  # fmt: skip


def sentinel_confs(
    folder: Path,
    service: str,
    primary_port: int,
    *,
    down_after_ms: int,
    failover_timeout_ms: int,
) -> list[tuple[int, Path]]:
    """Three sentinels (quorum 2) watching `service`'s primary on 127.0.0.1:`primary_port`:
    each one's free port and config file, written in `folder` (a sentinel rewrites its file:
    one each)."""
    out = []
    for i in range(3):
        port, conf = free_port(), folder / f"sentinel{i}.conf"
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {folder}\n"
            f"sentinel monitor {service} 127.0.0.1 {primary_port} 2\n"
            f"sentinel down-after-milliseconds {service} {down_after_ms}\n"
            f"sentinel failover-timeout {service} {failover_timeout_ms}\n"
            f"sentinel parallel-syncs {service} 1\n"
        )
        out.append((port, conf))
    return out


@contextlib.asynccontextmanager
async def private_redis() -> AsyncIterator[str]:
    """Start a redis-server that keeps nothing on disk; yield its URL; stop it on exit."""
    binary = redis_binary()
    if binary is None:
        raise RuntimeError(INSTALL_HINT)
    with tempfile.TemporaryDirectory(prefix="pdgate-bench-redis-") as workdir:
        for attempt in range(_ATTEMPTS):
            port = free_port()
            redis = Child("redis", server_argv(binary, port, workdir))
            try:
                await redis.start("Ready to accept connections", timeout_s=10)
            except RuntimeError:
                if attempt == _ATTEMPTS - 1:
                    raise
                continue
            try:
                yield f"redis://127.0.0.1:{port}/0"
            finally:
                await redis.stop()
            return
