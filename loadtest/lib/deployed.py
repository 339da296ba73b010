"""A P/D cluster as deployed: every shim and every gateway its own OS process
(``pdgate shim``, ``pdgate gateway``), membership through a private Redis.

This is how pdgate runs in production, and what measurements from outside see: each
process has its own event loop, its own CPU and memory, and the gateways know the shims
only through the registry. (The scheduling benchmark's default cluster hosts everything on
one event loop instead, which is cheaper to start and to run on two cores.)

Settings reach the processes as ``PDGATE_<TABLE>_<FIELD>`` environment variables, the way
an operator's deployment would set them, so no command-line flag of the servers is assumed
beyond the subcommand's name.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from pdgate.loadtest.lib.children import Child, Children, start_all
from pdgate.loadtest.lib.redis import private_redis

__all__ = [
    "GATEWAY_READY",
    "ROLES",
    "SHIM_READY",
    "DeployedCluster",
    "Deployment",
    "settings_env",
]

ROLES = ("prefill", "decode", "gateway")  # the kinds of server, for replacing one

# The servers' start-up lines (engine_shim/cli.py, gateway/cli.py), loosely: only the URL.
SHIM_READY = r"pdgate shim\b.*?(http://[\w.:\[\]-]+)"
GATEWAY_READY = r"pdgate gateway\b.*?(http://[\w.:\[\]-]+)"
_START_TIMEOUT_S = 60.0  # ten processes importing at once on two cores take a while


def settings_env(table: str, values: Mapping[str, Any]) -> dict[str, str]:
    """``{"capacity": 8}`` -> ``{"PDGATE_SHIM_CAPACITY": "8"}``; non-strings as JSON, which
    is how pydantic-settings reads numbers, booleans, lists and tables from the environment."""
    out: dict[str, str] = {}
    for key, value in values.items():
        text = value if isinstance(value, str) else orjson.dumps(value).decode()
        out[f"PDGATE_{table.upper()}_{key.upper()}"] = text
    return out


@dataclass(frozen=True, slots=True)
class Deployment:
    """What to start. The ``*_settings`` are fields of ShimSettings / GatewaySettings."""

    prefills: int
    decodes: int
    gateways: int = 1
    prefill_settings: Mapping[str, Any] = field(default_factory=dict)
    decode_settings: Mapping[str, Any] = field(default_factory=dict)
    gateway_settings: Mapping[str, Any] = field(default_factory=dict)
    # The role the prefill and decode places start in (both "aggregated": an aggregated
    # cluster of as many instances).
    prefill_role: str = "prefill"
    decode_role: str = "decode"
    key_prefix: str = "pdgate-bench"
    log_level: str = "WARNING"


class DeployedCluster(Children):
    """``async with DeployedCluster(d) as c:`` starts Redis, then every shim and gateway at
    once; on exit stops the gateways first (no new work), then the shims, then Redis.
    `redis_url`: register in that Redis instead (the caller runs it), e.g. a Sentinel
    group's."""

    def __init__(self, deployment: Deployment, redis_url: str | None = None) -> None:
        self.deployment = deployment
        self._given_redis_url = redis_url
        self.prefills: list[Child] = []
        self.decodes: list[Child] = []
        self.gateways: list[Child] = []
        self.prefill_urls: list[str] = []
        self.decode_urls: list[str] = []
        self.gateway_urls: list[str] = []
        self.redis_url = ""
        self._stack = contextlib.AsyncExitStack()
        self._envs: dict[str, dict[str, str]] = {}  # role -> its servers' settings
        self._started = 0  # servers started, for new names

    def children(self) -> list[Child]:
        return [*self.gateways, *self.prefills, *self.decodes]

    def check_alive(self) -> None:
        """Raise if a server died (its last output says why)."""
        for child in self.children():
            if not child.running:
                raise RuntimeError(f"{child.name} exited:\n{child.output_tail()}")

    def child(self, name: str, command: str, env: Mapping[str, str]) -> Child:
        """A `pdgate COMMAND` process of this cluster (not started), registered in its Redis."""
        argv = [sys.executable, "-m", "pdgate.config.cli", "--log-level",
                self.deployment.log_level, command]  # fmt: skip
        registry = {"PDGATE_REGISTRY_URL": self.redis_url,
                    "PDGATE_REGISTRY_KEY_PREFIX": self.deployment.key_prefix}  # fmt: skip
        return Child(name, argv, {**registry, **env})

    async def _start(self) -> None:
        d = self.deployment
        if self._given_redis_url is None:
            self.redis_url = await self._stack.enter_async_context(private_redis())
        else:
            self.redis_url = self._given_redis_url
        local = {"host": "127.0.0.1", "port": 0}
        shim = {"drain_timeout_s": 0, **local}  # the benchmark waited for its requests already
        for role, count, settings, into, starts_as in (
            ("prefill", d.prefills, d.prefill_settings, self.prefills, d.prefill_role),
            ("decode", d.decodes, d.decode_settings, self.decodes, d.decode_role),
        ):
            env = self._envs[role] = settings_env("shim", {**shim, **settings, "role": starts_as})
            into.extend(self.child(f"{role}-{i}", "shim", env) for i in range(count))
        env = self._envs["gateway"] = settings_env("gateway", {**d.gateway_settings, **local})
        self.gateways = [self.child(f"gateway-{i}", "gateway", env) for i in range(d.gateways)]
        self._started = d.prefills + d.decodes + d.gateways
        # Registered before starting, so a failed start stops whatever did start; the
        # gateways first (no new work), then the shims, each kind in parallel.
        self._stack.push_async_callback(self._stop_all)
        starts = [(c, SHIM_READY) for c in (*self.prefills, *self.decodes)]
        starts += [(c, GATEWAY_READY) for c in self.gateways]
        urls = [m.group(1) for m in await start_all(starts, _START_TIMEOUT_S)]
        self.prefill_urls = urls[: d.prefills]
        self.decode_urls = urls[d.prefills : d.prefills + d.decodes]
        self.gateway_urls = urls[d.prefills + d.decodes :]

    def members(self, role: str) -> tuple[list[Child], list[str]]:
        """The servers of `role` (one of `ROLES`) and their URLs, index for index."""
        if role == "prefill":
            return self.prefills, self.prefill_urls
        if role == "decode":
            return self.decodes, self.decode_urls
        if role == "gateway":
            return self.gateways, self.gateway_urls
        raise ValueError(f"unknown role {role!r}; known: {', '.join(ROLES)}")

    async def stop_member(self, role: str, index: int, timeout_s: float) -> int | None:
        """SIGTERM server `index` of `role` and wait until it exits, SIGKILL after
        `timeout_s`; its exit status (0: it stopped by itself, e.g. after a shim's drain;
        -9: killed). Its place stays for `start_member`."""
        child = self.members(role)[0][index]
        await child.stop(timeout_s=timeout_s)
        return child.returncode

    async def start_member(self, role: str, index: int, timeout_s: float = _START_TIMEOUT_S) -> str:
        """Start a new server of `role`, with the settings of the first ones, in place `index`
        (of one `stop_member` stopped); its URL. It is in the cluster before it starts, so
        the cluster's exit stops it on every path, a failed or cancelled start included."""
        children, urls = self.members(role)
        old = children[index]
        if old.running:
            raise RuntimeError(f"{old.name} is still running: stop it first")
        name = f"{role}-{self._started}"
        self._started += 1
        command, ready = ("gateway", GATEWAY_READY) if role == "gateway" else ("shim", SHIM_READY)
        child = children[index] = self.child(name, command, self._envs[role])
        url = (await child.start(ready, timeout_s)).group(1)
        urls[index] = url
        return url

    async def _stop_all(self) -> None:
        # Every stop runs to its end even if one fails; the first failure is raised after.
        failed: list[BaseException] = []
        for kind in (self.gateways, [*self.prefills, *self.decodes]):
            results = await asyncio.gather(*(c.stop() for c in kind), return_exceptions=True)
            failed += [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise failed[0]

    async def aclose(self) -> None:
        """Stop the gateways, then the shims, then Redis."""
        await self._stack.aclose()
