"""``pdgate bench profile``: where the gateway's CPU goes on the hot path, with py-spy.

The same null-profile shims and pdgate process as ``pdgate bench gateway``; closed-loop
clients at a chosen concurrency for a while, and py-spy (``pip install py-spy``; a tool, not
a dependency) sampling only the gateway's process (``--front python_floor``: the bench's
Python floor instead, floor.py, to tell pdgate's own cost from its stack's). Prints the
functions with the most samples, by self time (where the CPU is spent) and inclusive time
(which call paths cost it), and keeps the raw collapsed stacks for a flame graph
(``--out``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from pdgate.loadtest.gateway_cost.bench import running_fronts
from pdgate.loadtest.gateway_cost.load import run_window
from pdgate.loadtest.gateway_cost.shims import ShimSpec
from pdgate.loadtest.lib.children import Child, find_binary
from pdgate.loadtest.lib.log import to_stderr
from pdgate.loadtest.lib.redis import private_redis

__all__ = ["ProfilePlan", "profile_gateway", "summarize_stacks"]


@dataclass(frozen=True, slots=True)
class ProfilePlan:
    concurrency: int = 1
    seconds: float = 15.0
    rate_hz: int = 1000
    max_tokens: int = 16
    top: int = 25
    out: Path = Path("gateway-profile.txt")
    engine: str = "shim"  # or "stock": plain OpenAI servers (stock.py), given by URL
    front: str = "pdgate"  # or "python_floor": the bench's floor (floor.py)


# Where a sample's innermost frame is, by the start of its path: the layers of a request's
# way through the gateway. pdgate's own folders are told apart; the rest is the stdlib.
_LAYERS = (
    (("asyncio/", "uvloop/"), "event loop (uvloop, asyncio)"),
    (("uvicorn/", "httptools/", "h11/"), "HTTP server (uvicorn)"),
    (
        ("aiohttp/", "multidict/", "yarl/", "propcache/", "aiohappyeyeballs/"),
        "HTTP client (aiohttp)",
    ),
    (("starlette/",), "starlette"),
    (("pydantic/", "pydantic_core/"), "request validation (pydantic)"),
    (("prometheus_client/", "opentelemetry/"), "metrics and tracing libraries"),
    (("gateway/stream/",), "pdgate: relay (gateway/stream)"),
    (("gateway/placement/",), "pdgate: placement (gateway/placement)"),
    (("gateway/api/", "config/openai_api.py"), "pdgate: endpoint and parsing"),
    (("gateway/upstream/h1.py",), "HTTP client (pdgate's h1)"),
    (("gateway/upstream/",), "pdgate: upstream calls (gateway/upstream)"),
    (("gateway/", "config/", "policies/", "registry/"), "pdgate: the rest"),
)


def _layer(frame: str) -> str:
    path = frame.rpartition(" (")[2].rstrip(")")
    for prefixes, layer in _LAYERS:
        if path.startswith(prefixes):
            return layer
    return "other (stdlib)"


def _frame_name(frame: str) -> str:
    # py-spy raw frames read "function (path/to/file.py:line)": keep function and file.
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    for marker in ("site-packages/", "lib/python3"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    else:
        path = path.rsplit("/main/", 1)[-1]
    return f"{name} ({path})"


def summarize_stacks(raw: str, top: int, *, requests: int = 0, rate_hz: int = 0) -> str:
    """Self samples by layer, then the top functions by self and inclusive samples, from
    py-spy's raw (collapsed) output. With the window's `requests` and the sampling rate, each
    layer's CPU per request too (py-spy samples a thread only while it runs)."""
    own: Counter[str] = Counter()
    layers: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_frame_name(f) for f in stack.split(";") if f and not f.startswith("process ")]
        if not frames:
            continue
        total += count
        own[frames[-1]] += count
        layers[_layer(frames[-1])] += count
        for name in set(frames):
            inclusive[name] += count
    if not total:
        return "no samples\n"
    per_request = requests > 0 and rate_hz > 0
    lines = [f"{total} samples\n", "self %" + ("   us/request" if per_request else "") + "   layer"]
    for name, n in layers.most_common():
        us = f"   {1e6 * n / rate_hz / requests:10.0f}" if per_request else ""
        lines.append(f"{100 * n / total:6.1f}{us}   {name}")
    lines += ["", "self %   function"]
    lines += [f"{100 * n / total:6.1f}   {name}" for name, n in own.most_common(top)]
    lines += ["", "incl %   function"]
    lines += [f"{100 * n / total:6.1f}   {name}" for name, n in inclusive.most_common(top)]
    return "\n".join(lines) + "\n"


async def profile_gateway(plan: ProfilePlan) -> str:
    pyspy = find_binary("py-spy")
    if pyspy is None:
        raise RuntimeError("py-spy not found (pip install py-spy)")

    async with (
        private_redis() as redis_url,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session,
    ):
        spec = ShimSpec(registry_url=redis_url, prefill_capacity=1024, decode_capacity=1024,
                        key_prefix="pdgate-profile", engine=plan.engine)  # fmt: skip
        floor = plan.front == "python_floor"
        async with running_fronts(session, spec, 256, False, to_stderr, floor=floor) as setup:
            spy = Child(
                "py-spy",
                [pyspy, "record", "--pid", str(setup.procs[plan.front].pid), "--format", "raw",
                 "--rate", str(plan.rate_hz), "--duration", str(round(plan.seconds)),
                 "--nonblocking", "--output", str(plan.out)],
            )  # fmt: skip
            try:
                await spy.start("")
                window = await run_window(
                    session, setup.fronts[plan.front], concurrency=plan.concurrency, warmup_s=0.5,
                    window_s=plan.seconds, max_tokens=plan.max_tokens,
                )  # fmt: skip
                # py-spy stops by itself after --duration; the bound covers a hung one.
                code = await spy.wait(plan.seconds + 30)
                if code != 0:
                    raise RuntimeError(f"py-spy failed: {spy.output_tail()}")
            finally:
                await spy.stop()
    head = (
        f"pdgate bench profile: {plan.front} on {plan.engine} engines, "
        f"concurrency {plan.concurrency}, "
        f"{window.requests} requests in {window.window_s:.1f} s "
        f"({window.requests / window.window_s:.0f}/s), raw stacks in {plan.out}\n"
    )
    # The window's requests over py-spy's whole run: it starts a little before the window
    # (the warm-up) and so over-counts CPU per request by that much.
    summary = summarize_stacks(
        plan.out.read_text(), plan.top, requests=window.requests, rate_hz=plan.rate_hz
    )
    return head + summary
