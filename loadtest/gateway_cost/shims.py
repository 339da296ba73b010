"""The engines behind ``pdgate bench gateway``, as their own process:
``python -m pdgate.loadtest.gateway_cost.shims SPEC_JSON``.

Every front end under test (pdgate, vllm-router, the client itself) talks to the same engines,
so these run apart from all of them: one process, one event loop. Two kinds (``engine`` in
the spec): ``shim``, pdgate's sim shims, and ``stock``, the benchmark's plain OpenAI server
(stock.py: vLLM's handshake only, no registration). Unlike the scheduling experiment's
in-process cluster (loadtest/scheduling/cluster.py, which also hosts its gateways with an
in-memory registry) the shims here register in the Redis named by the spec, so a pdgate
gateway in another process can find them. With either engine the decode step time can be
replaced (no shim setting does that), which the idle-stream measurement uses to keep
thousands of streams open without tokens.

Protocol: the child prints ``{"prefills": [...], "decodes": [...]}`` once serving; ``quit`` or
end of input on stdin stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson

from pdgate.config import RegistrySettings, Role, ShimSettings
from pdgate.config.server import bind_socket, bound_port, run, serving
from pdgate.engine_shim.app import build_shim_app
from pdgate.engine_shim.sim_engine import SimDecodeEngine, SimPrefillEngine
from pdgate.engine_shim.sim_profile import get_profile
from pdgate.loadtest.gateway_cost.stock import StockOptions, serve_stock
from pdgate.registry import open_registry

__all__ = ["ENGINES", "ShimSpec", "serve_engines", "serve_shims"]

_HOST = "127.0.0.1"
ENGINES = ("shim", "stock")


@dataclass(frozen=True, slots=True)
class ShimSpec:
    registry_url: str | None
    profile: str = "null"
    decode_step_s: float | None = None  # replaces the profile's decode_base_s when set
    prefill_s: float | None = None  # replaces the profile's prefill_overhead_s when set
    prefills: int = 2
    decodes: int = 2
    prefill_capacity: int = 64
    decode_capacity: int = 1024
    key_prefix: str = "pdgate-bench"
    # "shim": the sim shims, registered in `registry_url`; "stock": stock.py's servers, not
    # registered anywhere (fronts are given their URLs).
    engine: str = "shim"
    tokenizer: bool = True  # stock engines: serve vLLM's /tokenize and /v1/completions/render

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@contextlib.asynccontextmanager
async def serve_shims(spec: ShimSpec) -> AsyncIterator[dict[str, list[str]]]:
    registry_settings = RegistrySettings(url=spec.registry_url, key_prefix=spec.key_prefix)
    profile = get_profile(spec.profile)
    if spec.decode_step_s is not None:
        profile = dataclasses.replace(profile, decode_base_s=spec.decode_step_s)
    if spec.prefill_s is not None:
        profile = dataclasses.replace(profile, prefill_overhead_s=spec.prefill_s)
    async with contextlib.AsyncExitStack() as stack:
        registry = open_registry(registry_settings)
        stack.push_async_callback(registry.aclose)
        urls: dict[str, list[str]] = {"prefills": [], "decodes": []}
        for role, count in ((Role.PREFILL, spec.prefills), (Role.DECODE, spec.decodes)):
            for _ in range(count):
                sock = bind_socket(_HOST, 0)
                prefill = role is Role.PREFILL
                settings = ShimSettings(
                    role=role,
                    host=_HOST,
                    port=bound_port(sock),
                    sim_profile=spec.profile,
                    capacity=spec.prefill_capacity if prefill else spec.decode_capacity,
                    # As many KV pulls may wait as there are slots: a full retrieval queue
                    # would turn away requests the decode has room for.
                    kv_retrieval_queue=spec.decode_capacity,
                    drain_timeout_s=0,
                )
                backend: SimPrefillEngine | SimDecodeEngine = (
                    SimPrefillEngine(
                        profile,
                        max_batch=settings.capacity,
                        kv_wire_fraction=settings.sim_kv_wire_fraction,
                    )
                    if prefill
                    else SimDecodeEngine(profile, max_batch=settings.capacity)
                )
                app = build_shim_app(settings, registry, registry_settings, backend=backend)
                await stack.enter_async_context(serving(app, sock))
                urls["prefills" if prefill else "decodes"].append(f"http://{_HOST}:{settings.port}")
        yield urls


def serve_engines(spec: ShimSpec) -> contextlib.AbstractAsyncContextManager[dict[str, list[str]]]:
    """The spec's engines, shims or stock servers; yields their base URLs."""
    if spec.engine == "stock":
        options = StockOptions(
            prefill_s=spec.prefill_s or 0.0,
            token_s=spec.decode_step_s or 0.0,
            tokenizer=spec.tokenizer,
        )
        return serve_stock(options, spec.prefills, spec.decodes)
    return serve_shims(spec)


async def _main(spec: ShimSpec) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    async with serve_engines(spec) as urls:
        print(orjson.dumps(urls).decode(), flush=True)
        while (await reader.readline()).strip() not in (b"quit", b""):
            pass


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m pdgate.loadtest.gateway_cost.shims SPEC_JSON", file=sys.stderr)
        return 2
    spec = ShimSpec(**orjson.loads(argv[0]))
    if spec.engine not in ENGINES:
        print(f"engine must be one of {ENGINES}", file=sys.stderr)
        return 2
    run(_main(spec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
