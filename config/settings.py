"""Settings models shared by every pdgate process.

Precedence, highest first: constructor arguments (CLI flags), environment variables
(``PDGATE_<TABLE>_<FIELD>``), the TOML file given with ``--config``, defaults.
Nothing here is instantiated at import time: ``load()`` is called once at start-up and the
result is passed down.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar, Self

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from config._toml import TomlTableSource


class _Settings(BaseSettings):
    """Base: one TOML table per model, set by ``_table``."""

    _table: ClassVar[str] = ""
    _toml_path: ClassVar[Path | None] = None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (
            init_settings,
            env_settings,
            TomlTableSource(settings_cls, cls._toml_path, cls._table),
        )

    @classmethod
    def load(cls, config_file: Path | None = None, **overrides: Any) -> Self:
        """Build settings from overrides, env and an optional TOML file."""
        # A throwaway subclass carries the path so concurrent loads never share state.
        bound = type(cls.__name__, (cls,), {"_toml_path": config_file})
        return cls.model_validate(bound(**overrides).model_dump())


class RegistrySettings(_Settings):
    """Where instances register and how liveness is judged."""

    model_config = SettingsConfigDict(env_prefix="PDGATE_REGISTRY_", extra="forbid")
    _table: ClassVar[str] = "registry"

    url: str | None = Field(
        default=None,
        description="redis://host:port/db for a shared Redis registry; "
        "unset = in-memory (one process).",
    )
    key_prefix: str = Field(default="pdgate", description="Prefix of every Redis key and channel.")
    heartbeat_interval_s: float = Field(
        default=1.0, gt=0, description="How often instances refresh."
    )
    ttl_s: float = Field(
        default=3.0, gt=0, description="A record expires this long after its last refresh."
    )
    poll_interval_s: float = Field(
        default=1.0,
        gt=0,
        description="Gateways re-read the full membership this often (source of truth).",
    )
    max_instances: int = Field(
        default=4096, gt=0, description="Upper bound on members read in one poll."
    )
    connect_timeout_s: float = Field(default=1.0, gt=0, description="Redis connect/socket timeout.")

    @model_validator(mode="after")
    def _ttl_covers_heartbeats(self) -> Self:
        if self.ttl_s <= self.heartbeat_interval_s:
            raise ValueError("registry ttl_s must be longer than heartbeat_interval_s")
        return self


class PrefillAdmission(StrEnum):
    REJECT = "reject"  # P/D-Serve: no local queue, 429 when every slot is taken
    QUEUE = "queue"  # the paper's "original version": a local FIFO queue (baseline)


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


class ShimSettings(_Settings):
    """One engine instance (prefill shim or decode worker)."""

    model_config = SettingsConfigDict(env_prefix="PDGATE_SHIM_", extra="forbid")
    _table: ClassVar[str] = "shim"

    role: Role = Field(
        default=Role.PREFILL, description="prefill (queue-less, holds KV) or decode."
    )
    engine: str = Field(
        default="sim",
        description="Engine backend: sim (timing model) or vllm (vLLM in-process; `make vllm`).",
    )
    host: str = Field(default="127.0.0.1", description="Address to listen on.")
    port: int = Field(
        default=8100, ge=0, le=65535, description="Port to listen on (0 = any free port)."
    )
    advertise_url: str | None = Field(
        default=None, description="URL others use to reach this shim; default http://host:port."
    )
    instance_id: str | None = Field(default=None, description="Default: role-host-port-random.")
    model: str = Field(default="sim-llama-3.1-8b", description="Model name served and registered.")
    group: str = Field(default="default", description="Scenario group this instance belongs to.")
    capacity: int = Field(
        default=8,
        gt=0,
        le=4096,
        description="Prefill: batch slots (a request holds one until its KV is fetched). "
        "Decode: max running sequences.",
    )
    admission: PrefillAdmission = Field(
        default=PrefillAdmission.REJECT, description="Prefill admission mode."
    )
    local_queue_size: int = Field(
        default=256, ge=0, description="Bound of the local queue (admission=queue)."
    )
    kv_hold_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="Prefill frees a slot whose KV nobody fetched after this long.",
    )
    kv_fetch_timeout_s: float = Field(
        default=10.0, gt=0, description="Decode gives up a KV pull after this."
    )
    kv_retrieval_queue: int = Field(
        default=64, gt=0, description="Bound of the decode's KV retrieval queue."
    )
    kv_retrieval_workers: int = Field(
        default=4, gt=0, description="Concurrent KV pulls per decode."
    )
    sim_profile: str = Field(
        default="llama-3.1-8b-h100", description="Timing profile of the sim engine."
    )
    sim_kv_wire_fraction: float = Field(
        default=1 / 64,
        gt=0,
        le=1,
        description="Fraction of the profile's real KV bytes actually sent over the wire "
        "(CPU boxes cannot move 128 KiB/token at test scale); transfer time is still "
        "modelled at full size.",
    )
    max_model_len: int = Field(
        default=32768,
        gt=0,
        description="Prompt + max_tokens limit (the vllm engine is started with it too).",
    )
    drain_timeout_s: float = Field(
        default=30.0,
        ge=0,
        description="On shutdown: stop taking requests (state draining) and wait this long for "
        "held KV and running streams to finish.",
    )
    vllm_model: str | None = Field(
        default=None,
        description="vllm engine: model directory (or Hugging Face id) to load; default: the "
        "`model` setting. Prefill and decode must load the same model with the same dtype.",
    )
    vllm_dtype: str = Field(
        default="auto",
        description="vllm engine: weight and KV dtype (auto = the model's; use float32 on CPU).",
    )
    vllm_enforce_eager: bool = Field(
        default=True,
        description="vllm engine: no torch.compile or CUDA graphs (fast start; set false on GPUs "
        "for speed).",
    )
    vllm_kv_cache_bytes: int | None = Field(
        default=None,
        gt=0,
        description="vllm engine: KV cache size in bytes; unset = vLLM's default for the device.",
    )
    vllm_kv_spool_dir: str | None = Field(
        default=None,
        description="vllm engine: where packed KV buffers live between engine and network; "
        "unset = a private directory under /dev/shm (or the temp dir).",
    )
    vllm_engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="vllm engine: more vLLM engine arguments (a JSON object), e.g. "
        '{"max_num_batched_tokens": 256, "gpu_memory_utilization": 0.4}.',
    )


class DispatchMode(StrEnum):
    QUEUE = "queue"  # P/D-Serve on-demand forwarding: gateway-held queue, retries to the deadline
    DIRECT = "direct"  # the paper's baseline gateway: one try at the top-ranked prefill, no retry


class QueueOrder(StrEnum):
    FIFO = "fifo"
    EDF = "edf"  # earliest deadline first


class GatewaySettings(_Settings):
    """The OpenAI-compatible front door."""

    model_config = SettingsConfigDict(env_prefix="PDGATE_GATEWAY_", extra="forbid")
    _table: ClassVar[str] = "gateway"

    host: str = Field(default="127.0.0.1", description="Address to listen on.")
    port: int = Field(
        default=8000, ge=0, le=65535, description="Port to listen on (0 = any free port)."
    )
    ttft_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=600,
        description="Per-request deadline to get a prefill accepted and a decode streaming.",
    )
    group_ttft_timeout_s: dict[str, float] = Field(
        default_factory=dict,
        description="Per-group deadline overriding ttft_timeout_s, e.g. {chat = 2.0, batch = 30}.",
    )
    dispatch: DispatchMode = Field(
        default=DispatchMode.QUEUE,
        description="queue: gateway-held queue + retries until the deadline (P/D-Serve); "
        "direct: one try at the top-ranked prefill, no retries (the paper's baseline).",
    )
    queue_size: int = Field(
        default=1024, gt=0, description="Bound of each (model, group) queue; full = 503."
    )
    queue_order: QueueOrder = Field(
        default=QueueOrder.FIFO, description="fifo or edf (earliest deadline first)."
    )
    early_drop: bool = Field(
        default=True,
        description="dispatch=queue: answer 503 at once, instead of sending it, a queued request "
        "whose remaining "
        "time is shorter than an optimistic estimate of its prefill (gateway/prefill_time.py): "
        "past capacity it would only occupy a prefill and fail.",
    )
    prefill_estimate_quantile: float = Field(
        default=0.1,
        ge=0.0,
        le=1.0,
        description="The prefill-time estimate behind early_drop: this "
        "quantile of recent prefill seconds per prompt character (per length class), times the "
        "prompt's length (lower = more optimistic = fewer drops).",
    )
    batch_forwarding: bool = Field(
        default=True,
        description="When a prefill accepts, keep sending it queued requests while it has room.",
    )
    prefill_batch_endpoint: bool = Field(
        default=True,
        description="Send each batch-forwarded run in one call to the shims' "
        "/v1/completions/batch (measured faster: docs/batch_forwarding.md); prefills without it "
        "(404/405, e.g. plain vLLM) get one call per request.",
    )
    prefill_policy: str = Field(
        default="least_sse", description="Prefill ranking policy (by name)."
    )
    prefill_policy_options: dict[str, int | float | str] = Field(
        default_factory=dict,
        description="Keyword arguments for the prefill policy, e.g. {load_guard = 4}.",
    )
    decode_policy: str = Field(
        default="least_loaded", description="Decode choice policy (by name)."
    )
    affinity_block_chars: int = Field(
        default=64, gt=0, description="Prefix-affinity index: characters per hashed prompt block."
    )
    affinity_max_blocks: int = Field(
        default=512, gt=0, description="Leading blocks of a prompt indexed."
    )
    affinity_max_entries: int = Field(
        default=200_000, gt=0, description="Bound of the prefix-affinity index (block hashes, LRU)."
    )
    backoff_initial_s: float = Field(
        default=0.005, gt=0, description="First wait after all candidates rejected."
    )
    backoff_max_s: float = Field(default=0.2, gt=0, description="Cap of the exponential back-off.")
    backoff_jitter: float = Field(
        default=0.5, ge=0, le=1, description="Fraction of each wait randomised."
    )
    max_candidates: int = Field(
        default=4, gt=0, description="Prefills tried per round before backing off."
    )
    max_pending: int = Field(
        default=4096,
        gt=0,
        description="Requests admitted at once (waiting + streaming); more get 503.",
    )
    max_body_bytes: int = Field(
        default=4 * 1024 * 1024, gt=0, description="Largest request body accepted."
    )
    max_tokens_limit: int = Field(default=32768, gt=0, description="Largest max_tokens accepted.")
    default_max_tokens: int = Field(
        default=16, gt=0, description="max_tokens when the client omits it."
    )
    retry_after_s: int = Field(default=1, ge=1, le=120, description="Retry-After sent with 503s.")
    upstream_connect_timeout_s: float = Field(
        default=2.0, gt=0, description="TCP connect timeout to instances."
    )
    upstream_read_timeout_s: float = Field(
        default=60.0, gt=0, description="Longest silence tolerated on an upstream stream."
    )
    upstream_connections: int = Field(
        default=1024, gt=0, description="aiohttp connection pool size."
    )
    stream_chunk_bytes: int = Field(
        default=64 * 1024, gt=0, description="Relay read size from upstream."
    )
    access_log: bool = Field(
        default=False, description="Log one line per request (method, path, status)."
    )


class ClusterSettings(_Settings):
    """``pdgate up``: the embedded cluster."""

    model_config = SettingsConfigDict(env_prefix="PDGATE_CLUSTER_", extra="forbid")
    _table: ClassVar[str] = "cluster"

    prefills: int = Field(default=2, ge=1, le=64, description="Prefill shims started by pdgate up.")
    decodes: int = Field(default=2, ge=1, le=64, description="Decode workers started by pdgate up.")
    shim_base_port: int = Field(default=0, ge=0, le=65535, description="0 = pick free ports.")
