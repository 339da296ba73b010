"""vllm-router (vllm-project/router, Rust, ``pip install vllm-router``) as a child process in
front of a set of pdgate shims, in its vLLM P/D mode.

The shims speak vLLM's P/D handshake (``kv_transfer_params``), so the router fronts them
unchanged: it sends the prompt to a prefill with ``max_tokens=1`` and
``do_remote_decode=true``, then streams from a decode with the returned parameters. Used by
``pdgate bench gateway`` (its cost) and ``pdgate bench scheduling`` (its scheduling on a
queue-less cluster). It is a comparison point, not a dependency: when the binary is missing
the benchmarks say so and go on without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import aiohttp

from pdgate.loadtest.lib.children import Child, find_binary, free_port
from pdgate.loadtest.lib.probes import wait_http

__all__ = ["INSTALL_HINT", "RouterOptions", "router_binary", "running_router"]

INSTALL_HINT = "vllm-router not installed (pip install vllm-router==0.1.17)"


@dataclass(frozen=True, slots=True)
class RouterOptions:
    policy: str = "round_robin"  # vllm-router --policy (prefill and decode)
    # None: the router's default retry settings; 0: ``--disable-retries``; n: up to n retries
    # of a failed call (a prefill's 429 among them), back-off from `retry_initial_ms` doubling
    # up to `retry_max_ms`.
    retries: int | None = None
    retry_initial_ms: int = 25
    retry_max_ms: int = 500
    max_concurrent: int = 4096
    request_timeout_s: int = 7200


def router_binary() -> str | None:
    return find_binary("vllm-router")


def router_argv(
    binary: str, port: int, prefills: Sequence[str], decodes: Sequence[str], opts: RouterOptions
) -> list[str]:
    argv = [binary, "--vllm-pd-disaggregation", "--host", "127.0.0.1", "--port", str(port),
            "--policy", opts.policy, "--log-level", "warning",
            "--max-concurrent-requests", str(opts.max_concurrent),
            "--queue-size", "4096",
            "--request-timeout-secs", str(opts.request_timeout_s),
            # Its metrics listener defaults to port 29000: a second router (or anything else
            # there) would make it panic at start-up.
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]  # fmt: skip
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
) -> AsyncIterator[tuple[Child, str]]:
    """Start vllm-router; yield the child and its base URL once ``/health`` answers.

    Raises RuntimeError (with the install hint or the router's last output) if it cannot."""
    binary = router_binary()
    if binary is None:
        raise RuntimeError(INSTALL_HINT)
    port = free_port()
    child = Child("vllm-router", router_argv(binary, port, prefills, decodes, opts))
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
