"""``pdgate bench gateway``, ``profile``, ``compare``, ``hotpath``, ``stages`` and
``instructions``: the gateway's own cost.

``gateway`` (bench.py) prints one JSON line and, unless ``--quick`` or ``--no-doc``, writes
the generated block of docs/results/performance/README.md. ``profile`` (profile.py) prints
py-spy's view of the gateway's hot path. ``compare`` (compare.py) prints a markdown table of
gateway builds side by side; ``hotpath`` (hotpath.py) one of pdgate's own CPU per request,
without sockets; ``stages`` (stages.py) a lone request's time step by step, and
``instructions`` (instructions.py) valgrind's count of its machine instructions, both in
process.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson

from pdgate.loadtest.lib.args import positive_int, with_args
from pdgate.loadtest.lib.children import run_main
from pdgate.loadtest.lib.docs import update_block
from pdgate.loadtest.lib.log import to_stderr

__all__ = [
    "COMPARE_HELP",
    "GATEWAY_HELP",
    "HOTPATH_HELP",
    "INSTRUCTIONS_HELP",
    "PROFILE_HELP",
    "STAGES_HELP",
    "compare_main",
    "configure_compare",
    "configure_gateway",
    "configure_hotpath",
    "configure_instructions",
    "configure_profile",
    "configure_stages",
    "gateway_main",
    "hotpath_main",
    "instructions_main",
    "profile_main",
    "stages_main",
    "update_gateway_doc",
]

GATEWAY_HELP = "the gateway's own cost vs vllm-router, SMG and no router"
PROFILE_HELP = "py-spy profile of the gateway on the hot path"
HOTPATH_HELP = "pdgate's own CPU per request, in process over MockUpstream (no sockets)"
COMPARE_HELP = "gateway builds (e.g. two checkouts) in front of the same engines, same rates"
STAGES_HELP = "a lone request's time in pdgate, step by step, in process (no sockets)"
INSTRUCTIONS_HELP = "machine instructions per request in process, counted by valgrind"


def configure_gateway(g: argparse.ArgumentParser) -> None:
    g.add_argument("--quick", action="store_true", help="short windows, 1,000 idle streams (<90 s)")
    g.add_argument(
        "--doc", type=Path, help="default: docs/results/performance/README.md (not with --quick)"
    )
    g.add_argument("--no-doc", action="store_true")
    g.add_argument("--no-router", action="store_true", help="skip vllm-router")
    g.add_argument("--no-smg", action="store_true", help="skip SMG")
    g.add_argument(
        "--pin",
        action="store_true",
        help="the fronts on a CPU of their own, the engines, Redis and the load on the others",
    )
    g.add_argument(
        "--workers",
        help="comma-separated gateway worker counts, each its own front (default 1)",
    )
    g.add_argument(
        "--no-plain",
        action="store_true",
        help="skip pdgate_plain (pdgate without the shims' batch endpoint, like vllm-router)",
    )
    g.add_argument(
        "--aiohttp",
        action="store_true",
        help="also pdgate_aiohttp: pdgate on aiohttp's client (upstream_client = aiohttp)",
    )
    g.add_argument(
        "--floor",
        action="store_true",
        help="also python_floor: two legs and a byte relay on pdgate's server and client, "
        "nothing else (loadtest/gateway_cost/floor.py)",
    )
    g.add_argument(
        "--engine",
        choices=("shim", "stock", "both"),
        default="both",
        help="the engines behind every front: pdgate's sim shims, a plain OpenAI server "
        "with vLLM's handshake only (loadtest/gateway_cost/stock.py), or both in turn "
        "(default; the idle-stream phase runs on the first)",
    )
    g.add_argument(
        "--prefill-ms",
        type=float,
        help="engine time of each prefill leg (default 0; shims: the null profile's overhead)",
    )
    g.add_argument(
        "--token-ms", type=float, help="engine time before each decoded token (default 0)"
    )
    g.add_argument(
        "--router-policies",
        default="round_robin",
        help="comma-separated vllm-router --policy values, each its own front (default "
        "round_robin, front vllm_router; others are vllm_router_<policy>; the router's own "
        "default policy is cache_aware)",
    )
    g.add_argument(
        "--stock-no-tokenizer",
        action="store_true",
        help="stock engines answer 404 to vLLM's /tokenize and /v1/completions/render (as a "
        "plain OpenAI server does; vllm-router's cache_aware policy calls them)",
    )
    g.add_argument(
        "--apis",
        help="comma-separated APIs of chat, responses, messages: also pdgate_<api>, the same "
        "gateway asked through that API (the translation's cost beside completions'; shim "
        "engines only)",
    )
    g.add_argument("--idle-streams", type=int, help="open idle streams (default 10000; 0: skip)")
    g.add_argument("--ttft-requests", type=int, help="c=1 probes per front (default 300)")
    g.add_argument("--concurrencies", help="comma-separated (default 32,256)")
    g.add_argument("--rounds", type=int, help="windows per front and concurrency (default 3)")
    g.add_argument("--window-s", type=float, help="seconds per window (default 10)")


def configure_profile(pr: argparse.ArgumentParser) -> None:
    pr.add_argument("--concurrency", type=int, default=1)
    pr.add_argument("--seconds", type=float, default=15.0)
    pr.add_argument("--top", type=int, default=25, help="functions listed")
    pr.add_argument("--out", type=Path, default=Path("gateway-profile.txt"), help="raw stacks")
    pr.add_argument(
        "--engine",
        choices=("shim", "stock"),
        default="shim",
        help="pdgate's sim shims, or plain OpenAI servers (stock.py) given by URL",
    )
    pr.add_argument(
        "--front",
        choices=("pdgate", "python_floor"),
        default="pdgate",
        help="the process profiled: pdgate, or the bench's Python floor (floor.py)",
    )


def profile_main(args: argparse.Namespace, command: str) -> int:
    from pdgate.loadtest.gateway_cost.profile import ProfilePlan, profile_gateway

    print(run_main(profile_gateway(with_args(ProfilePlan(), args))), end="", flush=True)
    return 0


def configure_compare(c: argparse.ArgumentParser) -> None:
    c.add_argument(
        "--gateway",
        action="append",
        default=[],
        metavar="NAME=COMMAND",
        help="a gateway build (repeated; the first is the reference): NAME=COMMAND, "
        "e.g. 'before=env -C ../old ../old/.venv/bin/python -m pdgate.config.cli'",
    )
    c.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE",
        help="an environment variable of one gateway (repeated)",
    )
    c.add_argument("--rates", default="100,200", help="offered requests/s, comma-separated")
    c.add_argument("--rounds", type=int, default=3)
    c.add_argument("--window-s", type=float, default=10.0)
    c.add_argument("--max-tokens", type=int, default=16)
    c.add_argument(
        "--pin",
        action="store_true",
        help="the gateways on a CPU of their own, the engines, Redis and the load on the others",
    )


def compare_main(args: argparse.Namespace, command: str) -> int:
    from pdgate.loadtest.gateway_cost.compare import (
        ComparePlan,
        parse_builds,
        report,
        run_compare,
    )

    try:
        builds = parse_builds(args.gateway, args.set)
    except ValueError as exc:
        print(f"pdgate bench compare: {exc}", file=sys.stderr)
        return 2
    plan = ComparePlan(
        builds=builds,
        rates=tuple(float(r) for r in args.rates.split(",")),
        rounds=args.rounds,
        window_s=args.window_s,
        max_tokens=args.max_tokens,
        pin=args.pin,
    )
    windows = run_main(run_compare(plan, to_stderr))
    print(report(plan, windows, command), end="", flush=True)
    return 0


def configure_hotpath(h: argparse.ArgumentParser) -> None:
    h.add_argument("--requests", type=int, default=4000, help="per round")
    h.add_argument("--concurrency", type=int, default=8)
    h.add_argument("--rounds", type=int, default=5)
    h.add_argument("--tokens", type=int, default=16)
    h.add_argument("--whole", action="store_true", help="non-streaming requests")
    h.add_argument(
        "--instances",
        type=int,
        default=2,
        help="prefills, and as many decodes, registered (a request's cost as the fleet grows)",
    )
    h.add_argument("--profile", action="store_true", help="add cProfile's view of pdgate")
    h.add_argument(
        "--uvloop",
        action="store_true",
        help="run on uvloop, as a deployed gateway does (default: asyncio's own loop)",
    )


def hotpath_main(args: argparse.Namespace, command: str) -> int:
    from pdgate.loadtest.gateway_cost.hotpath import HotpathPlan, run_hotpath

    plan = with_args(HotpathPlan(), args, stream=not args.whole)
    if args.uvloop:
        import asyncio

        import uvloop

        before = asyncio.get_event_loop_policy()
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        try:
            result = run_main(run_hotpath(plan))
        finally:
            asyncio.set_event_loop_policy(before)
    else:
        result = run_main(run_hotpath(plan))
    print(result.report(plan, command), end="", flush=True)
    return 0


def configure_stages(s: argparse.ArgumentParser) -> None:
    s.add_argument("--rounds", type=positive_int, default=3)
    s.add_argument("--requests", type=positive_int, default=3000, help="per round")
    s.add_argument("--warmup", type=int, default=500)


def stages_main(args: argparse.Namespace, command: str) -> int:
    from pdgate.loadtest.gateway_cost.stages import run

    print(run(args.rounds, args.requests, args.warmup), end="", flush=True)
    return 0


def configure_instructions(i: argparse.ArgumentParser) -> None:
    i.add_argument(
        "--same-mock",
        action="store_true",
        help="the in-memory upstream's decode open without its timeout, as in older builds",
    )
    i.add_argument(
        "--no-drain",
        action="store_true",
        help="drain admission and the loop-lag timer off (settings older builds lack)",
    )


def instructions_main(args: argparse.Namespace, command: str) -> int:
    from pdgate.loadtest.gateway_cost.instructions import instructions_per_request

    print(instructions_per_request(same_mock=args.same_mock, no_drain=args.no_drain), flush=True)
    return 0


def gateway_main(args: argparse.Namespace, command: str) -> int:
    from pdgate.loadtest.gateway_cost.bench import QUICK, GatewayPlan, run_gateway_bench
    from pdgate.loadtest.gateway_cost.report import json_line, markdown

    def numbers(text: str | None, kind: type = int) -> tuple[Any, ...] | None:
        return tuple(kind(x) for x in text.split(",")) if text else None

    changed: dict[str, Any] = {
        "idle_streams": args.idle_streams,
        "ttft_requests": args.ttft_requests,
        "rounds": args.rounds,
        "window_s": args.window_s,
        "concurrencies": numbers(args.concurrencies),
        "with_router": False if args.no_router else None,
        "with_smg": False if args.no_smg else None,
        "pin": args.pin or None,
        "workers": numbers(args.workers),
        "plain": False if args.no_plain else None,
        "aiohttp": args.aiohttp or None,
        "floor": args.floor or None,
        "apis": numbers(args.apis, str),
        "prefill_s": None if args.prefill_ms is None else args.prefill_ms / 1000,
        "token_s": None if args.token_ms is None else args.token_ms / 1000,
        "router_policies": numbers(args.router_policies, str),
        "stock_tokenizer": False if args.stock_no_tokenizer else None,
        "engines": None if args.engine == "both" else (args.engine,),
    }
    # An option left out (None) keeps the plan's value.
    given = {k: v for k, v in changed.items() if v is not None}
    plan = replace(QUICK if args.quick else GatewayPlan(), **given)
    load_before = os.getloadavg()
    result = run_main(run_gateway_bench(plan, to_stderr))
    doc = args.doc or (None if args.quick else Path("docs/results/performance/README.md"))
    if doc is not None and not args.no_doc:
        load = f"load average before {load_before[0]:.2f}, after {result['load_avg_1m_after']:.2f}"
        update_gateway_doc(doc, markdown(result, command, load))
    print(orjson.dumps(json_line(result)).decode(), flush=True)
    return 0


def update_gateway_doc(doc: Path, block: str) -> None:
    """Replace the text between the doc's gateway markers, or write the block alone."""
    update_block(doc, "bench-gateway", block, append=True)
