"""``pdgate up``, the embedded cluster: a gateway plus prefill and decode shims (or, with
``--strategy aggregated``, instances that serve whole requests), one process.

It lives here, with the other harnesses that run whole clusters, because it depends on both
the gateway and the shim packages (which never import each other).

One event loop hosts every server, which is what lets the in-memory registry work; with
``PDGATE_REGISTRY_URL`` set, the same processes register in Redis instead and other gateways
or shims can join them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import secrets
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import SecretStr
from starlette.applications import Starlette

from pdgate.config import (
    ClusterSettings,
    GatewaySettings,
    RegistrySettings,
    Role,
    ServingStrategy,
    ShimSettings,
)
from pdgate.config.cli import overrides, registry_settings, serve_until_signalled
from pdgate.config.server import bind_socket, bound_port, serving
from pdgate.engine_shim.app import ENGINES, build_shim_app, drain_shim
from pdgate.gateway.app import build_gateway_app
from pdgate.registry import open_registry
from pdgate.registry.base import Registry


@dataclass(frozen=True)
class ClusterInfo:
    gateway_url: str
    prefill_urls: list[str] = field(default_factory=list)
    decode_urls: list[str] = field(default_factory=list)
    registry: str = "memory"
    aggregated_urls: list[str] = field(default_factory=list)


def _shim_port(cluster: ClusterSettings, index: int) -> int:
    return 0 if cluster.shim_base_port == 0 else cluster.shim_base_port + index


@contextlib.asynccontextmanager
async def embedded_cluster(
    gateway: GatewaySettings,
    registry_settings: RegistrySettings,
    shim: ShimSettings,
    cluster: ClusterSettings,
    *,
    registry: Registry | None = None,
) -> AsyncIterator[ClusterInfo]:
    """Start everything, yield where it listens, stop it all (gateway first) on exit."""
    async with contextlib.AsyncExitStack() as stack:
        if registry is None:
            registry = open_registry(registry_settings)
            stack.push_async_callback(registry.aclose)
        urls: dict[Role, list[str]] = {role: [] for role in Role}
        shim_apps: list[Starlette] = []
        roles = [Role.PREFILL] * cluster.prefills + [Role.DECODE] * cluster.decodes
        if cluster.strategy is not ServingStrategy.DISAGGREGATED:
            roles = [Role.AGGREGATED] * len(roles)  # as many GPUs, each doing both
        phases = cluster.strategy is ServingStrategy.PARTIAL
        for index, role in enumerate(roles):
            sock = bind_socket(shim.host, _shim_port(cluster, index))
            settings = shim.model_copy(
                update={
                    "role": role,
                    "port": bound_port(sock),
                    "instance_id": None,
                    "phases": phases or shim.phases,
                }
            )
            app = build_shim_app(settings, registry, registry_settings)
            await stack.enter_async_context(serving(app, sock))
            shim_apps.append(app)
            urls[role].append(f"http://{shim.host}:{settings.port}")

        async def drain() -> None:
            # Runs after the gateway stopped and before the shims close their sockets, so
            # held KV can still be pulled and running streams finish.
            await asyncio.gather(*(drain_shim(a, shim.drain_timeout_s) for a in shim_apps))

        stack.push_async_callback(drain)
        sock = bind_socket(gateway.host, gateway.port)
        gateway_app = build_gateway_app(gateway, registry, registry_settings)
        await stack.enter_async_context(serving(gateway_app, sock, access_log=gateway.access_log))
        yield ClusterInfo(
            gateway_url=f"http://{gateway.host}:{bound_port(sock)}",
            prefill_urls=urls[Role.PREFILL],
            decode_urls=urls[Role.DECODE],
            registry="memory" if registry_settings.url is None else "redis",
            aggregated_urls=urls[Role.AGGREGATED],
        )


MiB = 1 << 20
GiB = 1 << 30
# What one vLLM engine on the CPU takes besides its KV cache and its weights: its EngineCore
# process (torch, vLLM, the CPU attention backend's workspace) and its share of this process
# (its AsyncLLM client and tokenizer). About 1.2 GiB measured with the tiny model (PSS, see
# docs/vllm.md); the rest is room for a larger tokenizer and vLLM's buffers growing under load.
VLLM_ENGINE_OVERHEAD_BYTES = 1536 * MiB
# Left free for the rest of the machine (page cache, other programs, the gateway's growth).
VLLM_MEMORY_RESERVE = 0.1
# Fewer bytes than this hold too few blocks to serve anything: refuse to start instead.
VLLM_MIN_KV_CACHE_BYTES = 64 * MiB
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_HALF_DTYPES = ("bfloat16", "float16", "half")


def _gib(n: int) -> str:
    return f"{n / GiB:.1f}"


def kv_cache_per_engine(
    available: int,
    engines: int,
    weights: int = 0,
    *,
    overhead: int = VLLM_ENGINE_OVERHEAD_BYTES,
    reserve: float = VLLM_MEMORY_RESERVE,
) -> int:
    """Bytes of KV cache for each of `engines` vLLM engines started together on one machine
    with `available` bytes free, each also holding `weights` bytes of model weights.

    vLLM sizes each engine's cache as if it had the machine to itself (92% of its memory), so
    a second engine cannot start. Here the engines share what is left once `reserve` of the
    available memory and each engine's own weights and `overhead` are set aside; a whole
    number of MiB each. Raises ValueError when that leaves an engine less than
    `VLLM_MIN_KV_CACHE_BYTES`."""
    if engines <= 0:
        raise ValueError("no engines to size a KV cache for")
    usable = int(available * (1.0 - reserve)) - engines * (overhead + weights)
    share = max(usable, 0) // engines // MiB * MiB
    if share < VLLM_MIN_KV_CACHE_BYTES:
        need = engines * (overhead + weights + VLLM_MIN_KV_CACHE_BYTES) / (1.0 - reserve)
        raise ValueError(
            f"{engines} vLLM engines need about {need / GiB:.1f} GiB, {_gib(available)} GiB "
            "is available: start fewer engines or set PDGATE_SHIM_VLLM_KV_CACHE_BYTES"
        )
    return share


def model_weight_bytes(model: str, dtype: str) -> int:
    """Bytes the weights of the model directory `model` take in an engine's memory: the size
    of its weight files, twice that when half-precision files are loaded as float32. 0 when
    `model` is not a local directory (a Hugging Face id: its files are not known here)."""
    path = Path(model)
    if not path.is_dir():
        return 0
    size = sum(f.stat().st_size for f in path.iterdir() if f.name.endswith(_WEIGHT_SUFFIXES))
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        config = None
    stored = None
    if isinstance(config, dict):
        stored = config.get("torch_dtype") or config.get("dtype")
    if dtype in ("float32", "float") and stored in _HALF_DTYPES:
        size *= 2
    return size


def meminfo_available(path: str = "/proc/meminfo") -> int | None:
    """The kernel's estimate of memory available to new programs (MemAvailable), in bytes."""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key == "MemAvailable":
                    return int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _is_vllm(engine: str) -> bool:
    return ENGINES.get(engine, engine) == ENGINES["vllm"]


def size_vllm_kv_cache(
    shim: ShimSettings,
    engines: int,
    available: Callable[[], int | None],
    env: Mapping[str, str],
) -> tuple[ShimSettings, str | None]:
    """`shim` with a KV cache size that lets `engines` vLLM engines run side by side, and a
    line that says what was chosen (None when the engine is not vLLM).

    A size the user chose wins: ``vllm_kv_cache_bytes`` (PDGATE_SHIM_VLLM_KV_CACHE_BYTES),
    ``kv_cache_memory_bytes`` or ``gpu_memory_utilization`` in ``vllm_engine_args``, or vLLM's
    own VLLM_CPU_KVCACHE_SPACE (which overrides any engine argument on the CPU). Otherwise
    `available` is asked for the host memory free for the engines: None means vLLM keeps its
    KV cache in device memory, which host memory says nothing about."""
    if not _is_vllm(shim.engine):
        return shim, None
    prefix = "KV cache per engine:"
    if shim.vllm_kv_cache_bytes is not None:
        return shim, f"{prefix} {_gib(shim.vllm_kv_cache_bytes)} GiB (as set)"
    chosen = [
        k for k in ("kv_cache_memory_bytes", "gpu_memory_utilization") if k in shim.vllm_engine_args
    ]
    if chosen:
        return shim, f"{prefix} as vllm_engine_args set it ({', '.join(chosen)})"
    if env.get("VLLM_CPU_KVCACHE_SPACE", ""):
        return shim, f"{prefix} {env['VLLM_CPU_KVCACHE_SPACE']} GiB (VLLM_CPU_KVCACHE_SPACE)"
    free = available()
    if free is None:
        return shim, f"{prefix} vLLM's default (device memory, not sized by pdgate up)"
    weights = model_weight_bytes(shim.vllm_model or shim.model, shim.vllm_dtype)
    size = kv_cache_per_engine(free, engines, weights)
    line = f"{prefix} {_gib(size)} GiB ({engines} engines, {_gib(free)} GiB available)"
    return shim.model_copy(update={"vllm_kv_cache_bytes": size}), line


def host_memory_for_vllm() -> int | None:
    """Host memory free for vLLM engines: the least of the kernel's MemAvailable and what
    vLLM's CPU worker counts (it refuses a KV cache larger than that, and on some machines
    counts less than the kernel does); None when vLLM runs on another device."""
    from pdgate.engine_shim.vllm_engine import cpu_memory_available

    vllm_view = cpu_memory_available()
    if vllm_view is None:
        return None
    kernel_view = meminfo_available()
    return vllm_view if kernel_view is None else min(vllm_view, kernel_view)


HELP = "gateway + simulated prefill and decode shims in one process"


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--prefills", type=int)
    p.add_argument("--decodes", type=int)
    p.add_argument(
        "--strategy",
        choices=[s.value for s in ServingStrategy],
        help="disaggregated (prefills + decodes), aggregated (as many instances, each "
        "computing prompts and decoding them) or partial (those alternating prefill and "
        "decode phases, EcoServe)",
    )
    p.add_argument("--capacity", type=int, help="slots per shim")
    p.add_argument("--engine", help="engine backend by name (sim, vllm) or module:factory")
    p.add_argument("--model", help="served model; with --engine vllm, the model directory")
    p.add_argument("--sim-profile", dest="sim_profile")
    p.add_argument("--prefill-policy", dest="prefill_policy")


def with_cluster_token(settings: RegistrySettings) -> RegistrySettings:
    """`settings` with a freshly generated cluster token when none is set and the registry
    is this process's own (in-memory): the shims listen on real sockets, and only this
    process's gateway and decodes may use them. A Redis registry is shared with processes
    that must know the token, so there the operator sets one (the shims refuse to listen
    beyond loopback without it)."""
    if settings.cluster_token is not None or settings.url:
        return settings
    return settings.model_copy(update={"cluster_token": SecretStr(secrets.token_urlsafe(32))})


async def _up(args: argparse.Namespace, stop: asyncio.Event) -> None:
    gateway = GatewaySettings.load(
        args.config, **overrides(args, ["host", "port", "prefill_policy"])
    )
    shim = ShimSettings.load(
        args.config, **overrides(args, ["capacity", "sim_profile", "engine", "model"])
    )
    cluster = ClusterSettings.load(
        args.config, **overrides(args, ["prefills", "decodes", "strategy"])
    )
    engines = cluster.prefills + cluster.decodes
    # Without vLLM installed, building the first shim says how to install it.
    if engines and importlib.util.find_spec("vllm") is not None:
        # Every vLLM engine would otherwise reserve most of the machine for itself.
        shim, line = size_vllm_kv_cache(shim, engines, host_memory_for_vllm, os.environ)
        if line is not None:
            print(f"pdgate up: {line}", flush=True)
    registry = with_cluster_token(registry_settings(args))
    async with embedded_cluster(gateway, registry, shim, cluster) as info:
        print(
            f"pdgate up: send OpenAI requests to {info.gateway_url}/v1 "
            f"({_instances(info)}, {shim.engine} engine, {info.registry} registry); "
            "Ctrl-C stops",
            flush=True,
        )
        await stop.wait()
    print("pdgate up: stopped", flush=True)


def _instances(info: ClusterInfo) -> str:
    if info.aggregated_urls:
        return f"{len(info.aggregated_urls)} aggregated"
    return f"{len(info.prefill_urls)} prefill, {len(info.decode_urls)} decode"


def main(args: argparse.Namespace) -> int:
    return serve_until_signalled(lambda stop: _up(args, stop))
