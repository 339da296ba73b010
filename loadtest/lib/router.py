"""The Rust routers pdgate is compared with, as child processes in front of a set of
engines, in their vLLM P/D modes: vllm-router (vllm-project/router, ``pip install
vllm-router``, ``--vllm-pd-disaggregation``) and SMG (lightseekorg/smg, ``pip install smg``,
``smg launch --pd-disaggregation --backend vllm``).

The shims speak vLLM's P/D handshake (``kv_transfer_params``), so both front them unchanged:
vllm-router sends the prompt to a prefill with ``max_tokens=1`` and ``do_remote_decode=true``,
SMG as a plain one-token request (the shims take both as a prefill leg), then each streams
from a decode with the parameters the prefill returned. Used by ``pdgate bench gateway``
(their cost) and ``pdgate bench scheduling`` (their scheduling on a queue-less cluster; SMG
with its prefill admission queue). They are comparison points, not dependencies: when a
binary is missing the benchmarks say so and go on without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import aiohttp

from pdgate.loadtest.lib.children import Child, find_binary, free_port
from pdgate.loadtest.lib.probes import wait_http

__all__ = [
    "INSTALL_HINT",
    "ROUTERS",
    "SMG",
    "RouterOptions",
    "install_hint",
    "router_binary",
    "running_router",
]

VLLM_ROUTER, SMG = "vllm-router", "smg"
ROUTERS = {  # binary -> its pinned version (pyproject.toml's loadtest extra)
    VLLM_ROUTER: "vllm-router==0.1.17",
    SMG: "smg==1.13.0",
}
INSTALL_HINT = f"vllm-router not installed (pip install {ROUTERS[VLLM_ROUTER]})"


@dataclass(frozen=True, slots=True)
class RouterOptions:
    binary: str = VLLM_ROUTER  # which router (a key of ROUTERS)
    policy: str = "round_robin"  # --policy (prefill and decode)
    # None: the router's default retry settings; 0: ``--disable-retries``; n: up to n retries
    # of a failed call (a prefill's 429 among them), back-off from `retry_initial_ms` doubling
    # up to `retry_max_ms`.
    retries: int | None = None
    retry_initial_ms: int = 25
    retry_max_ms: int = 500
    max_concurrent: int = 4096
    request_timeout_s: int = 7200
    # SMG only: its prefill admission queue, on when `prefill_inflight` is set (the requests
    # each prefill computes at once, its slots), each request waiting in it at most
    # `prefill_queue_timeout_s`; and a policy for the prefills apart from `policy`.
    prefill_inflight: int | None = None
    prefill_queue_size: int = 4096
    prefill_queue_timeout_s: int = 60
    prefill_policy: str | None = None


def router_binary(name: str = VLLM_ROUTER) -> str | None:
    return find_binary(name)


def install_hint(name: str) -> str:
    return f"{name} not installed (pip install {ROUTERS[name]})"


def router_argv(
    binary: str, port: int, prefills: Sequence[str], decodes: Sequence[str], opts: RouterOptions
) -> list[str]:
    if opts.binary == SMG:
        argv = [binary, "launch", "--pd-disaggregation", "--backend", "vllm",
                "--log-level", "warn"]  # fmt: skip
    else:
        argv = [binary, "--vllm-pd-disaggregation", "--log-level", "warning"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--policy", opts.policy,
             "--max-concurrent-requests", str(opts.max_concurrent),
             "--queue-size", "4096",
             "--request-timeout-secs", str(opts.request_timeout_s),
             # Its metrics listener defaults to a fixed port (29000): a second router (or
             # anything else there) would make it fail at start-up.
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]  # fmt: skip
    if opts.binary == SMG and opts.prefill_inflight is not None:
        argv += ["--prefill-max-inflight-requests-per-worker", str(opts.prefill_inflight),
                 "--prefill-queue-size", str(opts.prefill_queue_size),
                 "--prefill-queue-timeout-secs", str(opts.prefill_queue_timeout_s)]  # fmt: skip
    if opts.binary == SMG and opts.prefill_policy is not None:
        argv += ["--prefill-policy", opts.prefill_policy]
    if opts.retries == 0:
        argv.append("--disable-retries")
    elif opts.retries is not None:
        argv += ["--retry-max-retries", str(opts.retries),
                 "--retry-initial-backoff-ms", str(opts.retry_initial_ms),
                 "--retry-max-backoff-ms", str(opts.retry_max_ms),
                 "--retry-backoff-multiplier", "2", "--retry-jitter-factor", "0.2"]  # fmt: skip
    for url in prefills:
        argv += ["--prefill", url]
    for url in decodes:
        argv += ["--decode", url]
    return argv


@contextlib.asynccontextmanager
async def running_router(
    session: aiohttp.ClientSession,
    prefills: Sequence[str],
    decodes: Sequence[str],
    opts: RouterOptions,
    argv_prefix: Sequence[str] = (),
) -> AsyncIterator[tuple[Child, str]]:
    """Start the router (under `argv_prefix`, e.g. ``taskset -c N``); yield the child and its
    base URL once ``/health`` answers.

    Raises RuntimeError (with the install hint or the router's last output) if it cannot."""
    binary = router_binary(opts.binary)
    if binary is None:
        raise RuntimeError(install_hint(opts.binary))
    port = free_port()
    argv = [*argv_prefix, *router_argv(binary, port, prefills, decodes, opts)]
    child = Child(opts.binary, argv)
    try:
        await child.start("")
        base = f"http://127.0.0.1:{port}"
        try:
            await wait_http(session, base + "/health")
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}: {child.output_tail()}") from None
        yield child, base
    finally:
        await child.stop()
