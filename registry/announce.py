"""``pdgate announce``: register a server that cannot register itself (stock ``vllm serve``,
any OpenAI server with vLLM's ``kv_transfer_params`` handshake) in the Redis registry.

A sidecar next to the server:

1. waits until the server's ``GET /health`` answers 200, reads the served model from
   ``GET /v1/models`` (unless ``--model`` is given) with its ``max_model_len`` and LoRA
   adapters, and the side endpoints it answers from ``GET /openapi.json``, then registers
   the record and keeps it alive with a `Heartbeat` (a Mooncake prefill, ``--connector
   mooncake``, once its bootstrap server lists its engines, as for ``--prefill``);
2. while it runs, probes ``/health`` every ``--probe-interval-s`` and re-reads
   ``/v1/models`` (an adapter loaded or unloaded at run time changes the record at once);
   after ``--down-after``
   failed probes in a row it stops heartbeating and deregisters (the record is gone at once,
   or expires within the registry's ``ttl_s`` if Redis cannot take the removal), and
   registers again, model re-read, once the server answers;
3. on SIGTERM/SIGINT sets the record DRAINING (gateways send it nothing new), keeps it so
   while the server still answers, for at most ``--drain-s`` (a second signal cuts that
   short), then removes it and exits.

The gateways need no flag: an announced server is one more registered instance. Capacity
defaults as for ``--prefill``/``--decode`` (8 prefill slots, 64 decode sequences), and the
gateway keeps at most that many requests in the server (counted across the fleet), so a
stock prefill that queues still follows the queue-less rule.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from dataclasses import replace

import aiohttp

from pdgate.config.cli import registry_settings, serve_until_signalled
from pdgate.config.settings import (
    STATIC_DECODE_CAPACITY,
    STATIC_PREFILL_CAPACITY,
    RegistrySettings,
    StaticInstance,
)
from pdgate.config.wire import Role
from pdgate.registry import (
    Heartbeat,
    InstanceState,
    Registry,
    check_access,
    open_registry,
)
from pdgate.registry.redis import redact_url
from pdgate.registry.static import (
    ServedModels,
    StockInstance,
    check_health,
    reread_models,
    served_endpoints,
    served_kv_engines,
    served_model,
)

log = logging.getLogger("pdgate.announce")

HELP = "register a stock server (e.g. vllm serve) in the Redis registry and keep it there"
# The server's API key, for GET /v1/models (vLLM's --api-key guards /v1/*): read from the
# environment, never a flag (flags show in `ps`). vLLM itself reads the same variable.
API_KEY_ENV = "VLLM_API_KEY"
_VERSION = "announced"  # InstanceRecord.version of announced servers


def configure(p: argparse.ArgumentParser) -> None:
    # Required, but checked in main (a clear one-line error, like every bad setting).
    p.add_argument("--url", help="required: the server's base URL as gateways reach it")
    p.add_argument("--role", choices=[r.value for r in Role], help="required")
    p.add_argument(
        "--capacity",
        type=int,
        help=f"prefill slots (default {STATIC_PREFILL_CAPACITY}) or decode running sequences "
        f"(default {STATIC_DECODE_CAPACITY}); gateways never send more at once",
    )
    p.add_argument("--group", help="scenario group (default: default)")
    p.add_argument("--hardware", help="what the server runs on, GPU[/tpN][/ppN], e.g. l40s/tp2")
    p.add_argument("--model", help="served model name (default: the first in GET /v1/models)")
    p.add_argument(
        "--kv-events",
        dest="kv_events",
        help="where the server publishes its KV-cache events, as gateways reach it "
        "(tcp://HOST:PORT, the endpoint of vLLM's --kv-events-config)",
    )
    p.add_argument(
        "--connector",
        help="the KV connector the server's engine runs: nixl, nixl_push, mooncake, example "
        "or pdgate (default: none named, vLLM's pull handshake, paired only with the same)",
    )
    p.add_argument(
        "--bootstrap",
        help="a Mooncake prefill's bootstrap server, HOST:PORT (default: the URL's host, 8998)",
    )
    p.add_argument(
        "--instance-id", dest="instance_id", help="default: ROLE@HOST:PORT, as for --prefill"
    )
    p.add_argument(
        "--probe-interval-s",
        dest="probe_interval_s",
        type=float,
        help="how often /health is probed (default: the registry's heartbeat_interval_s)",
    )
    p.add_argument(
        "--probe-timeout-s", dest="probe_timeout_s", type=float, default=1.0, help="default 1"
    )
    p.add_argument(
        "--down-after",
        dest="down_after",
        type=int,
        default=2,
        help="failed probes in a row that deregister the server (default 2)",
    )
    p.add_argument(
        "--drain-s",
        dest="drain_s",
        type=float,
        default=10.0,
        help="on SIGTERM, longest the record stays draining while the server answers (10)",
    )


def _checked(args: argparse.Namespace, reg: RegistrySettings) -> tuple[StaticInstance, Role]:
    if not args.url or not args.role:
        raise ValueError("--url and --role are required")
    if not reg.url:
        raise ValueError(
            "needs a shared registry: --registry-url redis://... (or PDGATE_REGISTRY_URL); "
            "an in-memory registry would be this process's alone"
        )
    interval = args.probe_interval_s
    if interval is not None and interval <= 0:
        raise ValueError("--probe-interval-s must be positive")
    if args.probe_timeout_s <= 0 or args.down_after < 1 or args.drain_s < 0:
        raise ValueError("--probe-timeout-s must be positive, --down-after >= 1, --drain-s >= 0")
    # The same checks and defaults as the gateway's --prefill/--decode.
    spec = StaticInstance.model_validate(
        {
            "url": args.url,
            "capacity": args.capacity,
            "group": args.group or "default",
            "model": args.model,
            "id": args.instance_id,
            "hardware": args.hardware or "",
            "kv_events": args.kv_events or "",
            "connector": args.connector or None,
            "bootstrap": args.bootstrap or None,
        }
    )
    return spec, Role(args.role)


class _Announcer:
    def __init__(
        self,
        args: argparse.Namespace,
        reg: RegistrySettings,
        spec: StaticInstance,
        role: Role,
    ) -> None:
        self._reg = reg
        self._interval_s: float = args.probe_interval_s or reg.heartbeat_interval_s
        self._timeout_s: float = args.probe_timeout_s
        self._down_after: int = args.down_after
        self._drain_s: float = args.drain_s
        key = os.environ.get(API_KEY_ENV)
        self._server = StockInstance(role, spec, {"authorization": f"Bearer {key}"} if key else {})
        self._name = f"{role.value} {spec.url}"
        self._heartbeat: Heartbeat | None = None  # while registered

    async def run(self, stop: asyncio.Event) -> None:
        registry = open_registry(self._reg)
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=2, force_close=True),
            timeout=aiohttp.ClientTimeout(total=self._timeout_s),
        )
        try:
            await check_access(registry)  # refused credentials: fail now, loudly
            print(
                f"pdgate announce: {self._name} as {self._server.id!r} into "
                f"{redact_url(self._reg.url or '')}",
                flush=True,
            )
            await self._follow(registry, session, stop)
            if self._heartbeat is not None:
                await self._drain(self._heartbeat, session)
        finally:
            # On every way out (errors included) the record is removed, not left to expire.
            heartbeat, self._heartbeat = self._heartbeat, None
            if heartbeat is not None:
                await heartbeat.stop()
                log.info("%s deregistered", self._name)
            await session.close()
            await registry.aclose()

    async def _follow(
        self, registry: Registry, session: aiohttp.ClientSession, stop: asyncio.Event
    ) -> None:
        """Registered (`_heartbeat`) while the server answers, until `stop`."""
        failures = 0
        warned = False
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            started = loop.time()
            model: str | None = None
            served: ServedModels | None = None
            endpoints: tuple[str, ...] = ()
            engines: tuple[str, ...] = ()
            try:
                async with asyncio.timeout(self._timeout_s):
                    await check_health(session, self._server.spec.url, self._server.headers)
                    if self._heartbeat is None:
                        model, served = await served_model(session, self._server, self._name)
                        engines = await served_kv_engines(session, self._server, self._timeout_s)
                    else:
                        served = await reread_models(session, self._server)
                if self._heartbeat is None:  # its routes change only with a restart
                    endpoints = await served_endpoints(
                        session, self._server, self._name, self._timeout_s
                    )
            except Exception as exc:  # whatever the server does, the sidecar carries on
                failures += 1
                reason = "timed out" if isinstance(exc, TimeoutError) else str(exc) or repr(exc)
                heartbeat = self._heartbeat
                if heartbeat is not None and failures >= self._down_after:
                    log.warning(
                        "%s failed %d probes in a row (%s): deregistering until it answers",
                        self._name,
                        failures,
                        reason,
                    )
                    self._heartbeat = None
                    await heartbeat.stop()
                elif heartbeat is None and not warned:
                    warned = True  # once per outage
                    log.warning("%s is not ready (%s); registering once it is", self._name, reason)
            else:
                failures, warned = 0, False
                if self._heartbeat is not None and served is not None:
                    await self._follow_models(self._heartbeat, served)
                if self._heartbeat is None:
                    assert model is not None
                    record = self._server.ready_record(
                        model, _VERSION, served=served, endpoints=endpoints, kv_engines=engines
                    )
                    heartbeat = Heartbeat(
                        registry,
                        record,
                        interval_s=self._reg.heartbeat_interval_s,
                        ttl_s=self._reg.ttl_s,
                    )
                    await heartbeat.start()
                    self._heartbeat = heartbeat
                    log.info(
                        "%s registered as %r: model %r (max_model_len %s, adapters %s), "
                        "capacity %d",
                        self._name,
                        self._server.id,
                        model,
                        record.max_model_len or "unknown",
                        list(record.adapters[:8]),
                        self._server.capacity,
                    )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, started + self._interval_s - loop.time())):
                    await stop.wait()

    async def _follow_models(self, heartbeat: Heartbeat, served: ServedModels) -> None:
        """The record as the server's model list now says (adapters loaded or unloaded)."""
        old = heartbeat.record
        record = replace(
            old,
            max_model_len=served.context.get(old.model, 0),
            adapters=served.adapters.get(old.model, ()),
        )
        if record != old:
            log.info(
                "%s now serves adapters %s (max_model_len %s)",
                self._name,
                list(record.adapters[:8]),
                record.max_model_len or "unknown",
            )
            await heartbeat.update(record)

    async def _drain(self, heartbeat: Heartbeat, session: aiohttp.ClientSession) -> None:
        """DRAINING while the server still answers, at most ``drain_s``; a second signal
        ends it at once."""
        await heartbeat.set_state(InstanceState.DRAINING)
        log.info("%s draining (at most %.1f s)", self._name, self._drain_s)
        again = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, again.set)
        deadline = loop.time() + self._drain_s
        while not again.is_set() and loop.time() < deadline:
            try:
                async with asyncio.timeout(self._timeout_s):
                    await check_health(session, self._server.spec.url, self._server.headers)
            except Exception:  # the server has stopped: nothing left to drain
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, min(self._interval_s, deadline - loop.time()))):
                    await again.wait()


def main(args: argparse.Namespace) -> int:
    reg = registry_settings(args)
    spec, role = _checked(args, reg)
    announcer = _Announcer(args, reg, spec, role)
    return serve_until_signalled(announcer.run)
