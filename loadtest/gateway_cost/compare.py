"""``pdgate bench compare``: several gateway builds in front of the same engines, at the same
request rates, as ratios of one run.

``pdgate bench gateway`` compares pdgate with vllm-router; comparing two versions of pdgate
with it means two runs, each with its own engines (which change between versions too) and a
closed loop, where a gateway that answers later is offered fewer requests per second, so each
of its loop iterations carries less work and its CPU per request rises for that reason alone.
Here every gateway (this checkout's, or any command that starts a pdgate gateway: another
checkout's virtual environment) fronts the same sim shims, registered in one private Redis,
and gets the same open-loop load: requests sent at a fixed rate whether or not earlier ones
have ended (``--rates``), fronts taking turns window by window. Reported per rate and
gateway: the rate achieved, the gateway process's CPU per request (min/median/max over
``--rounds``) and the ratio of medians to the first gateway.

Each gateway is ``NAME=COMMAND`` (``--gateway``, repeated; none: this checkout as ``this``),
where COMMAND runs pdgate's command line (``.../bin/python -m pdgate.config.cli``; an older
checkout's module path works too) and gets ``--log-level WARNING gateway --host 127.0.0.1
--port 0 --registry-url URL`` appended. ``--set NAME:KEY=VALUE`` gives one gateway an
environment variable (``--set this:PDGATE_GATEWAY_MAX_MIGRATIONS=0``). Every gateway is its
own fleet (``PDGATE_GATEWAY_FLEET=false`` unless set): they take turns, and gateways that
share a fleet lease every slot through Redis.

``--pin`` gives the gateways a CPU of their own and everything else (this process's load, the
engines, Redis) the others (loadtest/lib/pinning.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import statistics
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import aiohttp
import orjson

from pdgate.loadtest.gateway_cost.bench import gateway_env
from pdgate.loadtest.gateway_cost.load import Front, send, warm
from pdgate.loadtest.gateway_cost.shims import ShimSpec
from pdgate.loadtest.lib.children import Child, start_all
from pdgate.loadtest.lib.log import Log
from pdgate.loadtest.lib.pinning import Pinning
from pdgate.loadtest.lib.pinning import pinned as pin_fronts
from pdgate.loadtest.lib.probes import wait_instances
from pdgate.loadtest.lib.redis import private_redis

__all__ = ["ComparePlan", "GatewayBuild", "parse_builds", "report", "run_compare"]

_KEY_PREFIX = "pdgate-compare"
# An older gateway printed "pdgate gateway: http://host:port/v1", the current one more words.
_READY = r"pdgate gateway\b.*?(http://[\w.:]+)"


@dataclass(frozen=True, slots=True)
class GatewayBuild:
    name: str
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ComparePlan:
    builds: tuple[GatewayBuild, ...]
    rates: tuple[float, ...] = (100.0, 200.0)
    rounds: int = 3
    warmup_s: float = 1.0
    window_s: float = 10.0
    max_tokens: int = 16
    max_in_flight: int = 512  # past this the front is saturated: requests are counted lost
    pin: bool = False  # the gateways on a CPU of their own, everything else on the others


@dataclass(frozen=True, slots=True)
class Window:
    build: str
    rate: float  # offered, requests/s
    achieved: float  # completed in the window, requests/s
    failed: int
    lost: int  # not sent: max_in_flight were open
    cpu_ms: float  # the gateway process's CPU per completed request


def parse_builds(specs: Sequence[str], sets: Sequence[str]) -> tuple[GatewayBuild, ...]:
    """``NAME=COMMAND`` specs and ``NAME:KEY=VALUE`` settings; none: this checkout."""
    if not specs:
        specs = [f"this={shlex.quote(sys.executable)} -m pdgate.config.cli"]
    builds: dict[str, GatewayBuild] = {}
    for spec in specs:
        name, sep, command = spec.partition("=")
        if not sep or not name or not command.strip() or name in builds:
            raise ValueError(f"--gateway {spec!r}: expected a new NAME=COMMAND")
        builds[name] = GatewayBuild(name, tuple(shlex.split(command)), {})
    for item in sets:
        name, sep, setting = item.partition(":")
        key, eq, value = setting.partition("=")
        if not sep or not eq or name not in builds:
            raise ValueError(f"--set {item!r}: expected NAME:KEY=VALUE of a named gateway")
        builds[name].env[key] = value
    return tuple(builds.values())


def _env(build: GatewayBuild) -> dict[str, str]:
    return {
        **gateway_env(_KEY_PREFIX, 0),
        "PDGATE_GATEWAY_FLEET": "false",
        "PDGATE_GATEWAY_GATEWAY_ID": build.name,
        **build.env,
    }


@contextlib.asynccontextmanager
async def _running(
    session: aiohttp.ClientSession,
    plan: ComparePlan,
    redis_url: str,
    log: Log,
    pinned: Pinning | None,
) -> AsyncIterator[tuple[dict[str, Front], dict[str, Child]]]:
    spec = ShimSpec(registry_url=redis_url, prefill_capacity=1024, decode_capacity=1024,
                    key_prefix=_KEY_PREFIX)  # fmt: skip
    async with contextlib.AsyncExitStack() as stack:
        engines = Child(
            "engines",
            [sys.executable, "-m", "pdgate.loadtest.gateway_cost.shims",
             orjson.dumps(spec.to_json()).decode()],
            quits_on_eof=True,
        )  # fmt: skip
        stack.push_async_callback(engines.stop)
        gateways: dict[str, Child] = {}
        for build in plan.builds:
            argv = [*build.argv, "--log-level", "WARNING", "gateway", "--host", "127.0.0.1",
                    "--port", "0", "--registry-url", redis_url]  # fmt: skip
            if pinned is not None:
                argv = pinned.wrap(argv)
            gateways[build.name] = Child(build.name, argv, _env(build))
            stack.push_async_callback(gateways[build.name].stop)
        ready = await start_all(
            [(engines, r'\{"prefills".*\}'), *((g, _READY) for g in gateways.values())]
        )
        fronts: dict[str, Front] = {}
        for name, match in zip(gateways, ready[1:], strict=True):
            await wait_instances(session, match.group(1), spec.prefills + spec.decodes)
            fronts[name] = Front(name, url=match.group(1) + "/v1/completions")
        await warm(session, fronts)
        log(f"gateways up: {', '.join(fronts)}")
        if pinned is not None:
            log(pinned.describe({name: gateways[name].pid for name in fronts}))
        yield fronts, gateways


async def _open_loop(
    session: aiohttp.ClientSession, front: Front, proc: Child, rate: float, plan: ComparePlan
) -> Window:
    """Requests every 1/rate s for warmup + window; counts what ends inside the window and
    the gateway's CPU over it."""
    t0 = time.monotonic()
    opens, closes = t0 + plan.warmup_s, t0 + plan.warmup_s + plan.window_s
    tally = [0, 0, 0]  # ok, failed, lost
    open_tasks: set[asyncio.Task[None]] = set()
    cpu_at_open: float | None = None

    async def one(n: int) -> None:
        out = await send(session, front, f"compare {front.name} {n}", plan.max_tokens)
        if opens <= out.end < closes:
            tally[0 if out.ok else 1] += 1

    n = 0
    while (now := time.monotonic()) < closes:
        if cpu_at_open is None and now >= opens:
            cpu_at_open = proc.cpu_s()
        if len(open_tasks) >= plan.max_in_flight:
            tally[2] += opens <= now
        else:
            task = asyncio.create_task(one(n))
            open_tasks.add(task)
            task.add_done_callback(open_tasks.discard)
        n += 1
        # The schedule, not the previous send, sets the next start: no drift, no catch-up.
        await asyncio.sleep(max(0.0, t0 + n / rate - time.monotonic()))
    assert cpu_at_open is not None, "the schedule passes the window's opening before its end"
    cpu = proc.cpu_s() - cpu_at_open
    if open_tasks:  # what is still open ends after the window: not counted, not cut off
        await asyncio.wait(set(open_tasks), timeout=30)
    done = tally[0]
    return Window(front.name, rate, done / plan.window_s, tally[1], tally[2],
                  1000 * cpu / done if done else float("nan"))  # fmt: skip


async def run_compare(plan: ComparePlan, log: Log) -> list[Window]:
    windows: list[Window] = []
    with pin_fronts(plan.pin) as pinned:
        async with (
            private_redis() as redis_url,
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session,
            _running(session, plan, redis_url, log, pinned) as (fronts, procs),
        ):
            for round_ in range(plan.rounds):
                for rate in plan.rates:
                    # Who goes first turns with the round: drift hits every build alike.
                    names = list(fronts)
                    names = names[round_ % len(names) :] + names[: round_ % len(names)]
                    for name in names:
                        window = await _open_loop(session, fronts[name], procs[name], rate, plan)
                        log(
                            f"round {round_ + 1} rate {rate:g}/s {name}: "
                            f"{window.achieved:.0f}/s, {window.cpu_ms:.3f} ms CPU/request"
                        )
                        windows.append(window)
    return windows


def _spread(values: Sequence[float], fmt: str) -> str:
    return "/".join(format(v, fmt) for v in (min(values), statistics.median(values), max(values)))


def report(plan: ComparePlan, windows: Sequence[Window], command: str) -> str:
    """A markdown table: per rate and gateway, min/median/max over the rounds."""
    lines = [
        f"`{command}`",
        "",
        f"{plan.rounds} rounds of {plan.window_s:g} s windows (after {plan.warmup_s:g} s of "
        f"warm-up), {plan.max_tokens} tokens per request, gateways taking turns"
        f"{', each on a CPU of its own (--pin)' if plan.pin else ''}; "
        "min/median/max over the rounds.",
        "",
        "| offered req/s | gateway | achieved req/s | failed + not sent | gateway CPU ms per "
        "request | CPU ratio to the first (medians) |",
        "|---|---|---|---|---|---|",
    ]
    first = plan.builds[0].name
    for rate in plan.rates:
        of_rate = [w for w in windows if w.rate == rate]
        base = statistics.median(w.cpu_ms for w in of_rate if w.build == first)
        for build in plan.builds:
            mine = [w for w in of_rate if w.build == build.name]
            cpu = [w.cpu_ms for w in mine]
            # A window too short for one clock tick of the first build's CPU has no ratio.
            ratio = f"{statistics.median(cpu) / base:.2f}" if base > 0 else "n/a"
            lines.append(
                f"| {rate:g} | {build.name} | {_spread([w.achieved for w in mine], '.0f')} | "
                f"{sum(w.failed + w.lost for w in mine)} | {_spread(cpu, '.3f')} | {ratio} |"
            )
    return "\n".join(lines) + "\n"
