"""Settings models shared by every pdgate process.

Precedence, highest first: constructor arguments (CLI flags), environment variables
(``PDGATE_<TABLE>_<FIELD>``), the TOML file given with ``--config``, defaults.
Nothing here is instantiated at import time: ``load()`` is called once at start-up and the
result is passed down.
"""

from __future__ import annotations

import re
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Self
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from pdgate.config._toml import TomlTableSource
from pdgate.config.kv_events import connectable_endpoint
from pdgate.config.wire import (
    HARDWARE_PATTERN,
    MAX_ADAPTERS,
    MAX_MODEL_NAME_CHARS,
    MOONCAKE_BOOTSTRAP_PORT,
    KvConnector,
    Role,
)


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
        description="redis://host:port/db for a shared Redis registry (rediss:// with TLS, "
        "unix://), or redis+sentinel://[:password@]host:port[,host:port...]/service[/db] for "
        "the primary of a replicated Redis that Sentinel names and follows through failovers "
        "(rediss+sentinel:// with TLS; docs/operations.md); unset = in-memory (one process).",
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
    cluster_token: SecretStr | None = Field(
        default=None,
        description="The fleet's shared secret: gateways send it to shims, decodes to prefills "
        "(Authorization: Bearer), and registry records are signed with it so that write "
        "access to Redis alone cannot add an instance (docs/security.md).",
    )

    @model_validator(mode="after")
    def _ttl_covers_heartbeats(self) -> Self:
        if self.ttl_s <= self.heartbeat_interval_s:
            raise ValueError("registry ttl_s must be longer than heartbeat_interval_s")
        return self


class PrefillAdmission(StrEnum):
    REJECT = "reject"  # P/D-Serve: no local queue, 429 when every slot is taken
    QUEUE = "queue"  # the paper's "original version": a local FIFO queue (baseline)


class ShimSettings(_Settings):
    """One engine instance (prefill shim or decode worker)."""

    model_config = SettingsConfigDict(env_prefix="PDGATE_SHIM_", extra="forbid")
    _table: ClassVar[str] = "shim"

    role: Role = Field(
        default=Role.PREFILL,
        description="prefill (queue-less, holds KV), decode, or aggregated (computes prompts "
        "and decodes them: a group of these is served aggregated).",
    )
    engine: str = Field(
        default="sim",
        description="Engine backend by name: sim (timing model), vllm (vLLM in-process; `make "
        'vllm`), or "package.module:factory" for one that lives outside pdgate.',
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
    local_prefill: bool = Field(
        default=True,
        description="Decode: also take plain requests (no kv_transfer_params) and prefill them "
        "here, in the running batch (chunked prefill); declared in the registry record so "
        "gateways with local_prefill_max_uncached_chars set send it short or cached prompts.",
    )
    phases: bool = Field(
        default=False,
        description="Aggregated: alternate prefill and decode phases (EcoServe's partial "
        "strategy, docs/strategies.md).",
    )
    tpot_slo_s: float = Field(
        default=0.1, gt=0, description="With phases: the TPOT SLO the decodes are held to."
    )
    ttft_slo_s: float = Field(
        default=2.0,
        gt=0,
        description="With phases: a waiting prompt goes in at the latest when it could still "
        "make this TTFT.",
    )
    hardware: str = Field(
        default="",
        pattern=HARDWARE_PATTERN,
        description="GPU[/tpN][/ppN] it runs on, in its record (sim: from MODEL@GPU).",
    )
    sim_profile: str = Field(
        default="llama-3.1-8b-h100",
        description="Timing profile of the sim engine, or MODEL@GPU[/tpN][/ppN] from the "
        "roofline (engine_shim/hardware.py).",
    )
    sim_kv_wire_fraction: float = Field(
        default=1 / 64,
        gt=0,
        le=1,
        description="Fraction of the profile's real KV bytes actually sent over the wire "
        "(CPU boxes cannot move 128 KiB/token at test scale); transfer time is still "
        "modelled at full size.",
    )
    sim_kv_bandwidth_gbps: float | None = Field(
        default=None,
        gt=0,
        description="KV transfer bandwidth the sim models between instances, in Gb/s (e.g. 25 "
        "for commodity Ethernet, 400 for an RDMA NIC per GPU); default: the profile's.",
    )
    sim_prefix_cache_blocks: int | None = Field(
        default=None,
        ge=0,
        description="Prefix-cache size of the sim engine (a prefill's, and a decode's for its "
        "local prefills), in blocks of 16 tokens (0 = no prefix cache); unset = the profile's.",
    )
    kv_events_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="A prefill publishes its prefix cache's KV events (what it stored and "
        "evicted, vLLM's wire format on a ZeroMQ PUB socket) on this port of `host` (0: a "
        "free one), and registers tcp://HOST:PORT (HOST from advertise_url) so that gateways "
        "with the precise_sse policy subscribe (docs/kv-events.md). Unset: no events.",
    )
    max_model_len: int = Field(
        default=32768,
        gt=0,
        description="Prompt + max_tokens limit (the vllm engine is started with it too).",
    )
    sim_lora_adapters: list[str] = Field(
        default_factory=list,
        max_length=MAX_ADAPTERS,
        description="sim engine: LoRA adapter names served on top of `model` (each answers "
        "in text of its own).",
    )
    drain_timeout_s: float = Field(
        default=30.0,
        ge=0,
        description="On shutdown: stop taking requests (state draining) and wait this long for "
        "held KV and running streams to finish.",
    )
    body_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="A request body not received whole within this long gets 408.",
    )
    sse_ping_interval_s: float = Field(
        default=15.0,
        ge=0,
        description="Decode: send an SSE comment (`: ping`) after this long without an event, so "
        "proxies keep a stream that waits for its KV open (0 = never).",
    )
    sse_send_timeout_s: float = Field(
        default=30.0,
        ge=0,
        description="Decode: drop a stream whose client has not taken an event for this long "
        "(it stopped reading), freeing its slot (0 = never).",
    )
    allow_unauthenticated: bool = Field(
        default=False,
        description="Allow listening on a non-loopback address without the registry's "
        "cluster_token (refused otherwise: anyone who can reach the port could run prompts "
        "and read or drop other requests' KV).",
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

    @model_validator(mode="after")
    def _adapters(self) -> Self:
        names = self.sim_lora_adapters
        if any(not 0 < len(n) <= MAX_MODEL_NAME_CHARS or n.strip() != n for n in names):
            raise ValueError(
                f"sim_lora_adapters: each name is 1 to {MAX_MODEL_NAME_CHARS} characters, "
                "without leading or trailing spaces"
            )
        if len(set(names)) != len(names) or self.model in names:
            raise ValueError("sim_lora_adapters: names must differ from each other and the model")
        return self


class DispatchMode(StrEnum):
    QUEUE = "queue"  # P/D-Serve on-demand forwarding: gateway-held queue, retries to the deadline
    DIRECT = "direct"  # the paper's baseline gateway: one try at the top-ranked prefill, no retry


class QueueOrder(StrEnum):
    FIFO = "fifo"
    EDF = "edf"  # earliest deadline first


# Slots of a static prefill whose capacity is not given: a stock vLLM prefill queues what it
# cannot batch, so the gateway keeps at most this many requests in it (the queue-less rule).
STATIC_PREFILL_CAPACITY = 8
# Running sequences of a static decode whose capacity is not given.
STATIC_DECODE_CAPACITY = 64
_STATIC_KEYS = (
    "capacity",
    "group",
    "model",
    "id",
    "api_key_env",
    "hardware",
    "kv_events",
    "connector",
    "bootstrap",
)
_MAX_NAME_CHARS = 128
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


class StaticInstance(BaseModel):
    """A server the gateway fronts by URL, without registration (``--prefill``/``--decode``,
    ``static_prefills``/``static_decodes``). Given as a table or as one string,
    ``"URL [capacity=N] [group=G] [model=M] [id=ID] [api_key_env=VAR] [hardware=GPU]
    [kv_events=tcp://HOST:PORT] [connector=NAME] [bootstrap=HOST:PORT]"`` (kv_events: where
    the server publishes its KV-cache events, vLLM's ``--kv-events-config`` endpoint as
    others reach it; connector: the KV connector its engine runs, ``nixl``, ``nixl_push``,
    ``mooncake``, ``example`` or ``pdgate``, unnamed: vLLM's pull handshake, paired only
    with unnamed others; bootstrap: a Mooncake prefill's bootstrap server, default the URL's
    host on port 8998); the model defaults to the first the server lists at
    ``GET /v1/models``, the id to one derived from role and URL (the same on every gateway,
    so the fleet shares its slots)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str
    capacity: int | None = Field(default=None, gt=0, le=4096)
    group: str = "default"
    model: str | None = None
    id: str | None = None
    # The name of an environment variable holding this server's own API key (vLLM's
    # --api-key), sent to it instead of upstream_api_key / the cluster token: the key itself
    # never appears in flags, config files or the registry.
    api_key_env: str | None = None
    hardware: str = Field(default="", pattern=HARDWARE_PATTERN)
    kv_events: str = ""
    connector: KvConnector | None = None
    bootstrap: str | None = None

    @field_validator("kv_events")
    @classmethod
    def _kv_events(cls, endpoint: str) -> str:
        return connectable_endpoint(endpoint)

    @field_validator("bootstrap")
    @classmethod
    def _bootstrap(cls, address: str | None) -> str | None:
        if address is None:
            return None
        parts = urlsplit(address if "://" in address else f"http://{address}")
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/"):
            raise ValueError(f"{address!r}: bootstrap is HOST:PORT (Mooncake's bootstrap server)")
        parts.port  # noqa: B018 - raises ValueError for a malformed port
        return f"{parts.scheme}://{parts.netloc}"

    @model_validator(mode="after")
    def _bootstrap_for_mooncake(self) -> Self:
        if self.bootstrap is not None and self.connector is not KvConnector.MOONCAKE:
            raise ValueError("bootstrap= is for connector=mooncake only")
        return self

    @property
    def kv_bootstrap(self) -> str:
        """A Mooncake server's bootstrap server as its decodes are told it: the one given,
        else the server's host on vLLM's default port ("" for other connectors)."""
        if self.connector is not KvConnector.MOONCAKE:
            return ""
        if self.bootstrap is not None:
            return self.bootstrap
        host = urlsplit(self.url).hostname or ""
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{MOONCAKE_BOOTSTRAP_PORT}"

    @model_validator(mode="before")
    @classmethod
    def _from_spec(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("url"), str):
            if "@" in urlsplit(data["url"]).netloc:
                return {"url": _without_credentials(data["url"])}
            return data
        if not isinstance(data, str):
            return data
        url, *options = data.split() or [""]
        if "@" in urlsplit(url).netloc:
            return {"url": _without_credentials(url)}
        fields: dict[str, str] = {"url": url} if url else {}  # no url: "field required"
        for option in options:
            key, sep, value = option.partition("=")
            if not sep or key not in _STATIC_KEYS:
                raise ValueError(
                    f"{option!r} in {data!r}: expected key=value with key one of "
                    + ", ".join(_STATIC_KEYS)
                )
            if key in fields:
                raise ValueError(f"{key} given twice in {data!r}")
            fields[key] = value
        return fields

    @field_validator("url")
    @classmethod
    def _base_url(cls, url: str) -> str:
        parts = urlsplit(url.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r}: expected http://host:port or https://host:port")
        if parts.username is not None or parts.password is not None:
            # It would end up in logs and instance ids; servers' keys go in upstream_api_key.
            raise ValueError("credentials in an instance URL are not allowed (upstream_api_key)")
        if parts.query or parts.fragment:
            raise ValueError(f"{url!r}: an instance URL has no query or fragment")
        parts.port  # noqa: B018 - raises ValueError for a malformed port
        path = parts.path.rstrip("/")
        # The gateway appends /v1/completions itself; an OpenAI base URL is a common paste.
        path = path.removesuffix("/v1")
        return f"{parts.scheme}://{parts.netloc}{path}"

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, value: str | None) -> str | None:
        if value is not None and not _ENV_NAME.fullmatch(value):
            raise ValueError(f"{value!r}: api_key_env is the name of an environment variable")
        return value

    @field_validator("group", "model", "id")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        if value is not None and not (
            0 < len(value) <= _MAX_NAME_CHARS and value.isprintable() and not value.isspace()
        ):
            raise ValueError(f"{value!r}: 1-{_MAX_NAME_CHARS} printable characters")
        return value


def _without_credentials(url: str) -> str:
    """`url` with its user info masked: validation errors echo their input, and a URL with
    credentials must be refused without printing them (the url check rejects the mask)."""
    netloc = urlsplit(url).netloc
    return url.replace(netloc, "***@" + netloc.rpartition("@")[2], 1)


def _unique_urls(instances: list[StaticInstance]) -> list[StaticInstance]:
    seen: set[str] = set()
    for instance in instances:
        if instance.url in seen:
            raise ValueError(f"{instance.url} is listed twice")
        seen.add(instance.url)
    return instances


# At most this many per role: each is probed in every round.
_StaticList = Annotated[list[StaticInstance], Field(max_length=1024), AfterValidator(_unique_urls)]


class ScenarioGroup(BaseModel):
    """One scenario group (P/D-Serve section 3.2): which requests belong to it, and its own
    deadline and queue bound. Its instances are those registered with this group."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=64)
    # A request matches when every condition given holds (none given: matches everything).
    models: list[str] = Field(default_factory=list, description="Model names.")
    api_keys: list[str] = Field(default_factory=list, description="API key names (tenants).")
    headers: list[str] = Field(
        default_factory=list, description="Values of the x-pdgate-group header."
    )
    min_prompt_chars: int | None = Field(default=None, ge=0)
    max_prompt_chars: int | None = Field(default=None, ge=0)
    ttft_timeout_s: float | None = Field(default=None, gt=0, le=600)
    tpot_slo_s: float | None = Field(default=None, gt=0, le=60)
    queue_size: int | None = Field(default=None, gt=0)
    priority: Literal["high", "normal", "low"] | None = Field(
        default=None, description="Default priority class of the group's requests."
    )

    def matches(self, model: str, key: str | None, header: str | None, prompt_chars: int) -> bool:
        return (
            (not self.models or model in self.models)
            and (not self.api_keys or key in self.api_keys)
            and (not self.headers or header in self.headers)
            and (self.min_prompt_chars is None or prompt_chars >= self.min_prompt_chars)
            and (self.max_prompt_chars is None or prompt_chars <= self.max_prompt_chars)
        )


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
    groups: list[ScenarioGroup] = Field(
        default_factory=list,
        description='Scenario groups, first match wins: [[gateway.groups]] name = "chat", '
        "models = [...], api_keys = [...], headers = [...], min_prompt_chars, "
        "max_prompt_chars, ttft_timeout_s, queue_size (docs/operations.md).",
    )
    default_group: str | None = Field(
        default=None,
        description="Group of a request no rule matches (and that names none); unset = any "
        "group serving its model.",
    )
    reject_unmatched: bool = Field(
        default=False,
        description="Answer 400 to a request that no group rule matches (instead of "
        "default_group).",
    )
    tpot_slo_s: float = Field(
        default=0.1,
        gt=0,
        description="TPOT SLO of a partial group's streams (rolling activation's check; a "
        "request may tighten it with x-pdgate-tpot-slo-ms).",
    )
    group_tpot_slo_s: dict[str, float] = Field(
        default_factory=dict,
        description="Per-group TPOT SLO overriding tpot_slo_s, e.g. {chat = 0.05}.",
    )
    macro_min_instances: int = Field(
        default=4,
        ge=1,
        description="Mitosis: the fewest instances of a macro instance a partial group splits "
        "into (docs/strategies.md).",
    )
    macro_max_instances: int = Field(
        default=8,
        ge=1,
        description="Mitosis: a partial group with more ready instances is several macro "
        "instances; at least 2 x macro_min_instances - 1.",
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
    queue_guard_s: float = Field(
        default=0.0,
        ge=0.0,
        le=10.0,
        description="Start guard of the queue (0 = off): a request the queue order would not "
        "pick next goes first once its latest start (deadline minus the 90% quantile of recent "
        "prefill times for its length) is this close, so EDF cannot starve long-deadline long "
        "prompts (its cost: docs/results/scheduling/).",
    )
    keyless_max_priority: Literal["high", "normal", "low"] = Field(
        default="normal",
        description="With client keys off: the most urgent class a request may ask for with "
        "x-pdgate-priority (it may always ask for less). With keys on, each key's priority= "
        "sets it (gateway/admission/tenancy.py).",
    )
    early_drop: bool = Field(
        default=True,
        description="dispatch=queue: answer 503 at once, instead of sending it, a queued request "
        "whose remaining time is shorter than an estimate of its prefill "
        "(prefill_estimate_quantile).",
    )
    drain_admission: bool = Field(
        default=True,
        description="dispatch=queue: answer 503 with Retry-After on arrival a request that "
        "the fleet's pace would not bring to the front of this gateway's queue before its "
        "deadline (docs/scheduling.md).",
    )
    drain_sweep: bool = Field(
        default=True,
        description="With drain_admission, also judge the queued requests again, at most "
        "twice a second, and refuse (503, Retry-After) those the pace no longer reaches.",
    )
    drain_headroom: float = Field(
        default=0.3,
        ge=0.0,
        lt=1.0,
        description="With drain_admission, under heavy overload admit only what the pace "
        "reaches with this fraction of its reach to spare (the sweep as much past it): none "
        "of it while arrivals come at most twice the pace, all from five times.",
    )
    drain_decode_bound: bool = Field(
        default=True,
        description="With drain_admission, count on no more than the decodes take: their "
        "slots over the mean time a request holds one, beyond those free now (decodes "
        "that answer 429 when full, as pdgate's shims do).",
    )
    retry_keeps_place: bool = Field(
        default=False,
        description="dispatch=queue: keep the place of a request a queue refused (503, 429) "
        "for its retry, the same request sent again before its Retry-After has long passed: "
        "it goes where its first try stood. Retries are served first come, first served; "
        "past capacity, where the refused are the costly requests, that costs throughput "
        '(docs/scheduling.md, "Retry-After").',
    )
    decode_backpressure: bool = Field(
        default=True,
        description="dispatch=queue: while a prefilled request waits for a decode (all "
        "full), hold its queue's prefills (docs/scheduling.md).",
    )
    prefill_estimate_quantile: float = Field(
        default=0.9,
        ge=0.0,
        le=1.0,
        description="The prefill-time estimate behind early_drop: this quantile of recent "
        "prefill seconds per prompt character (per length class), times the prompt's length "
        "(lower = fewer drops; docs/scheduling.md).",
    )
    prefill_admit: Literal["idle", "room"] = Field(
        default="idle",
        description="When a prefill may be sent requests. idle: only while it computes "
        "nothing, for any gateway (P/D-Serve; its slots may still hold KV for decodes to "
        "pull), several at once by batch forwarding; the others wait in the gateway's "
        "deadline-ordered queue. room: whenever it has a free slot, so requests also wait "
        "inside a busy prefill, out of that order (with 4 slots this collapsed past 2A: "
        "docs/results/scheduling/). The same with 1 slot.",
    )
    batch_forwarding: bool = Field(
        default=True,
        description="Send a prefill several queued requests at once: its share of the queue "
        "spread over the prefills with room, only as many as are expected to be computed and "
        "handed over before every one's deadline (a batch ends with its last prompt). Off: one "
        "request per decision (docs/scheduling.md, batch forwarding).",
    )
    prefill_batch_endpoint: bool = Field(
        default=True,
        description="Send each batch-forwarded run in one call to the shims' "
        "/v1/completions/batch (measured faster: docs/results/batch_forwarding/). Only prefills "
        "whose registry record declares it (pdgate shims) get batch calls; stock servers get "
        "one call per request, and a 404/405 turns it off for that prefill.",
    )
    prefill_policy: str = Field(
        default="least_sse",
        description="Prefill ranking policy: a profile (least_sse, affinity_sse, affinity_hold, "
        "precise_sse, precise_hold, least_tokens, round_robin, power_of_two, least_loaded) or "
        "module:factory (docs/extending.md). affinity_hold: affinity_sse that holds a request "
        "for the busy prefill holding its prefix when that is expected to finish sooner "
        "(policies/completion.py); precise_*: the same on what the prefills' KV events say "
        "they hold (docs/kv-events.md); least_tokens: least estimated prompt tokens computing.",
    )
    prefill_policy_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Overrides of the prefill policy: filters = [...], scorers = {name = "
        'weight}, picker = name, hold = "expected_completion" (or "" for none), and a '
        "plugin's keyword arguments under its name, e.g. {prefix_affinity = {load_guard = 4}, "
        "expected_completion = {min_gain = 0.1, scan = 8}}.",
    )
    decode_policy: str = Field(
        default="least_loaded", description="Decode choice policy (a profile or module:factory)."
    )
    decode_policy_options: dict[str, Any] = Field(
        default_factory=dict, description="Overrides of the decode policy (as for prefill)."
    )
    affinity_block_chars: int = Field(
        default=64, gt=0, description="Prefix-affinity index: characters per hashed prompt block."
    )
    affinity_max_blocks: int = Field(
        default=512, gt=0, description="Leading blocks of a prompt indexed."
    )
    affinity_max_bytes: int = Field(
        default=16 * 1024 * 1024,
        gt=0,
        description="Memory bound of the prefix-affinity index (LRU). Built only for a policy "
        "that scores prefix affinity.",
    )
    kv_index_max_blocks: int = Field(
        default=200_000,
        gt=0,
        description="KV-block index (precise_sse: what the prefills' KV events say they hold): "
        "most distinct blocks kept, least recently stored dropped first (docs/kv-events.md "
        "has the memory per block).",
    )
    kv_index_pending_s: float = Field(
        default=5.0,
        ge=0,
        description="KV-block index: how long a prompt sent to a prefill counts as held there "
        "before the prefill's own events confirm it (they normally do within a step).",
    )
    tokenizers: dict[str, str] = Field(
        default_factory=dict,
        description="Model -> its tokenizer for token-exact prefix matching (precise_sse): "
        "\"sim\", or a directory (or file) with the model's tokenizer.json. Unlisted: the sim's "
        "for models whose prefills declare it, the model name itself when it is a local "
        "directory; else matching falls back to characters.",
    )
    local_prefill_max_uncached_chars: int = Field(
        default=0,
        ge=0,
        description="Conditional disaggregation: a request whose prompt has at most this many "
        "characters not cached on a decode skips the prefill leg and goes straight to a decode "
        "that declares local_prefill (pdgate decodes do), which prefills it in its running "
        "batch; if none with room accepts, the usual prefill + decode path (0 = off).",
    )
    local_prefill_prefix_aware: bool = Field(
        default=True,
        description="Conditional disaggregation: count the leading prompt blocks a decode "
        "recently served as cached there (an index of decode placements, bounded like the "
        "prefix-affinity one); false = the whole prompt counts as uncached.",
    )
    backoff_initial_s: float = Field(
        default=0.005, gt=0, description="First wait after all candidates rejected."
    )
    backoff_max_s: float = Field(
        default=0.2, gt=0, description="Cap of the exponential back-off between retry rounds."
    )
    reject_hold_s: float = Field(
        default=0.2,
        gt=0,
        description="How long an instance that answered 429 (or failed) is skipped, unless one "
        "of this gateway's requests there frees a slot first.",
    )
    backoff_jitter: float = Field(
        default=0.5, ge=0, le=1, description="Fraction of each wait randomised."
    )
    prefill_try_timeout_s: float | None = Field(
        default=None,
        gt=0,
        description="Longest one prefill call may take before the request moves to another "
        "prefill (one that accepted the connection and hangs); unset = 4x the slowest recent "
        "prefills of that prompt length, at least 2 s.",
    )
    decode_stall_timeout_s: float | None = Field(
        default=5.0,
        gt=0,
        description="The most a started decode stream may be silent (a hung or stopped "
        "decode) before it is given up and the request goes on at another decode "
        "(max_migrations); sooner when its decode's own pace says so (decode_stall_factor). "
        "Unset = only upstream_read_timeout_s.",
    )
    decode_stall_floor_s: float = Field(
        default=1.0,
        gt=0,
        description="The least a started decode stream may be silent before it is given up, "
        "whatever its decode's pace; the watchdog looks every half of it (at most every "
        "second). Above decode_stall_timeout_s, that one holds.",
    )
    decode_stall_factor: float = Field(
        default=8.0,
        ge=1,
        description="A started decode stream is given up once it waited this many times "
        "the 0.99 quantile of its decode's recent waits for data (between "
        "decode_stall_floor_s and decode_stall_timeout_s). A decode silent on every stream "
        "that long is ejected and all its streams move at once.",
    )
    decode_header_timeout_s: float = Field(
        default=5.0,
        gt=0,
        description="A decode must answer (status and headers) within this; else the next one "
        "gets the request.",
    )
    eject_after_failures: int = Field(
        default=5,
        ge=1,
        description="Consecutive failures (refused, reset, 5xx, timeout before the first byte) "
        "that eject an instance (not 429s).",
    )
    eject_base_s: float = Field(
        default=5.0, gt=0, description="First ejection's cool-down; doubles each time in a row."
    )
    eject_max_s: float = Field(default=300.0, gt=0, description="Longest ejection cool-down.")
    ratio_window_s: float = Field(
        default=120.0,
        gt=0,
        description="P/D ratio advice: the window of measurements it is computed from.",
    )
    ratio_target_utilization: float = Field(
        default=0.8,
        gt=0,
        le=1,
        description="P/D ratio advice: desired instance counts keep each role this busy.",
    )
    retry_budget_ratio: float = Field(
        default=0.2,
        ge=0,
        le=1,
        description="Failover retries (after failures, not 429s) allowed per request, on average.",
    )
    retry_budget_burst: float = Field(
        default=10.0, ge=1, description="Failover retries allowed at once beyond the ratio."
    )
    decode_candidates: int = Field(
        default=4, gt=0, description="Decodes tried per round before backing off."
    )
    max_migrations: int = Field(
        default=2,
        ge=0,
        le=16,
        description="Decode migrations per request: a stream whose decode breaks after tokens "
        "were relayed (connection lost, in-band error, no [DONE]) goes on from another "
        "decode, from the prompt's token ids plus the tokens sent; each costs a prefill of "
        "both (0 = off: such a stream ends with an in-band error, and the relay passes bytes "
        "through unparsed).",
    )
    first_token_early: bool = Field(
        default=False,
        description="Streaming clients get the prefill's first token as soon as the prefill "
        "answers; the decode then continues from prompt + that token (decodes that declare "
        "the continuation extension only: pdgate decodes do; stock servers get vLLM's "
        "handshake unchanged).",
    )
    max_pending: int = Field(
        default=4096,
        gt=0,
        description="Requests admitted at once (waiting + streaming); more get 503.",
    )
    max_uploads: int = Field(
        default=1024,
        gt=0,
        description="Requests whose body is still arriving, at once (they do not count "
        "against max_pending); more get 503.",
    )
    body_timeout_s: float = Field(
        default=10.0, gt=0, description="A request body not whole within this gets 408."
    )
    max_body_bytes: int = Field(
        default=4 * 1024 * 1024, gt=0, description="Largest request body accepted."
    )
    max_response_bytes: int = Field(
        default=16 * 1024 * 1024,
        gt=0,
        description="Largest answer read whole from an instance (non-streaming clients).",
    )
    side_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="Longest an instance may take to answer a side-endpoint request once sent.",
    )
    token_count_timeout_s: float = Field(
        default=2.0,
        gt=0,
        description="Longest one try to count a prompt's tokens by POST /tokenize may take.",
    )
    token_count_tries: int = Field(
        default=2,
        ge=1,
        le=16,
        description="Instances tried to count a prompt's tokens.",
    )
    context_template_tokens: int = Field(
        default=1024,
        ge=0,
        description="Tokens a chat template may add to a request (docs/api.md, the cheap bound).",
    )
    context_message_tokens: int = Field(
        default=32,
        ge=0,
        description="Tokens a chat template may add per message, in the same bound.",
    )
    max_tokens_limit: int = Field(default=32768, gt=0, description="Largest max_tokens accepted.")
    default_max_tokens: int = Field(
        default=16, gt=0, description="max_tokens when the client omits it."
    )
    responses_ttl_s: float = Field(
        default=86400.0,
        gt=0,
        description="How long a stored response of the Responses API (`store`, the default) "
        "can be read and chained on (`previous_response_id`); in the registry's Redis when "
        "there is one, else in this process.",
    )
    responses_max_entry_bytes: int = Field(
        default=4 * 1024 * 1024,
        gt=0,
        description="Largest stored response (its output, input items and the conversation "
        "so far); a larger one is answered and not stored.",
    )
    responses_max_per_key: int = Field(
        default=1000,
        gt=0,
        description="Stored responses kept per client key; past it the oldest go.",
    )
    responses_memory_bytes: int = Field(
        default=256 * 1024 * 1024,
        gt=0,
        description="What stored responses may take in this process (all of them without "
        "Redis; with Redis, those stored while it was unreachable).",
    )
    retry_after_s: float = Field(
        default=1.0,
        ge=0.001,
        le=120,
        description="Least Retry-After the gateway sends with a 503 or 429, and what it sends "
        'where it has nothing to compute one from (docs/scheduling.md, "Retry-After").',
    )
    retry_after_max_s: float = Field(
        default=120.0,
        ge=0.001,
        le=3600,
        description="Most Retry-After the gateway sends (the OpenAI clients give up past 120).",
    )
    upstream_connect_timeout_s: float = Field(
        default=2.0, gt=0, description="TCP connect timeout to instances."
    )
    upstream_read_timeout_s: float = Field(
        default=60.0, gt=0, description="Longest silence tolerated on an upstream stream."
    )
    upstream_connections: int = Field(
        default=1024, gt=0, description="Connections to instances kept open at most."
    )
    upstream_client: Literal["h1", "aiohttp"] = Field(
        default="h1",
        description="Client for calls to instances: `h1` (pdgate's own HTTP/1.1, keep-alive) "
        "or `aiohttp` (the one before it; docs/architecture.md).",
    )
    stream_chunk_bytes: int = Field(
        default=64 * 1024, gt=0, description="Relay read size from upstream."
    )
    access_log: bool = Field(
        default=False, description="Log one line per request (method, path, status)."
    )
    api_keys: list[SecretStr] = Field(
        default_factory=list,
        description="Client API keys (env: a JSON list, e.g. '[\"sk-1\"]'); kept hashed. With "
        "any key set, every request needs `Authorization: Bearer <key>` (docs/security.md).",
    )
    api_keys_file: Path | None = Field(
        default=None,
        description="A file of client keys, one per line: `<key or sha256:<hex>> [name=...] "
        "[group=...] [rpm=...] [priority=high|normal|low] [weight=...]` (`pdgate keys new` "
        "writes lines). name is the tenant; priority the most urgent class the key may ask "
        "for and its default; weight its share of the queue (gateway/admission/tenancy.py).",
    )
    admin_token: SecretStr | None = Field(
        default=None, description="Bearer token for /admin/* and /dashboard."
    )
    metrics_auth: bool = Field(default=False, description="/metrics also needs the admin token.")
    allow_unauthenticated: bool = Field(
        default=False,
        description="Allow listening on a non-loopback address without client API keys "
        "(refused otherwise: anyone who reaches the port could use the fleet).",
    )
    upstream_api_key: SecretStr | None = Field(
        default=None,
        description="Bearer token sent to every instance (default: the registry's "
        "cluster_token, which pdgate shims require). In a fleet that mixes shims and keyed "
        "stock servers, start the stock servers with the cluster token as their --api-key, or "
        "give a static one its own key with api_key_env (docs/security.md).",
    )
    gateway_id: str | None = Field(
        default=None,
        description="This gateway's name in the fleet (default: random per process).",
    )
    fleet: bool = Field(
        default=True,
        description="With a Redis registry: share prefill slot leases, load counts and queue "
        "heads with the other gateways on it, so they act as one (docs/fleet.md).",
    )
    fleet_sync_interval_s: float = Field(
        default=0.1,
        gt=0,
        description="How often the fleet's load counts and queue heads are exchanged.",
    )
    fleet_ttl_s: float = Field(
        default=2.0,
        gt=0,
        description="A gateway that stops renewing (killed) loses its slot leases and counts "
        "after this long.",
    )
    fleet_window_s: float = Field(
        default=0.02,
        ge=0,
        description="For this long after a prefill slot frees, only the gateway with the "
        "fleet's most urgent queued request may take it (the fleet-wide deadline order).",
    )
    loop_lag_interval_s: float = Field(
        default=0.1,
        ge=0,
        description="How often the gateway times its own event loop for "
        "pdgate_event_loop_lag_seconds (0 = off).",
    )
    workers: int = Field(
        default=1,
        ge=1,
        le=256,
        description="Gateway worker processes behind one port, all accepting on the socket "
        "the supervisor binds. They share load through the Redis registry; without one, "
        "through a slot table shared on the node, never exceeding a prefill's capacity "
        "(docs/fleet.md).",
    )
    worker_index: int = Field(
        default=0,
        ge=0,
        description="Set by the --workers supervisor for each worker (0 .. workers-1).",
    )
    worker_slots_fd: int | None = Field(
        default=None,
        ge=0,
        description="Set by the --workers supervisor: the file descriptor of the node's shared "
        "prefill slot table (used when there is no Redis registry).",
    )
    static_prefills: _StaticList = Field(
        default_factory=list,
        description="Prefill servers fronted by URL, without registration (--prefill): "
        'strings "URL [capacity=N] [group=G] [model=M] [id=ID] [api_key_env=VAR]" or tables '
        f"of those keys. Capacity defaults to {STATIC_PREFILL_CAPACITY} slots, the model to "
        "the server's first in GET /v1/models; api_key_env names the environment variable "
        "holding that server's own API key (docs/operations.md, fronting existing servers).",
    )
    static_decodes: _StaticList = Field(
        default_factory=list,
        description="Decode servers fronted by URL (--decode), as static_prefills; capacity "
        f"defaults to {STATIC_DECODE_CAPACITY}.",
    )
    static_aggregated: _StaticList = Field(
        default_factory=list,
        description="Servers that compute prompts and decode them (plain vllm serve), fronted "
        "by URL (--aggregated), as static_prefills: a group of these is served aggregated; "
        f"capacity defaults to {STATIC_DECODE_CAPACITY}.",
    )
    static_probe_interval_s: float = Field(
        default=2.0, gt=0, description="How often static instances are probed (GET /health)."
    )
    static_probe_timeout_s: float = Field(
        default=1.0, gt=0, description="Longest one probe of a static instance may take."
    )
    static_down_after: int = Field(
        default=2,
        ge=1,
        description="Failed probes in a row after which a static instance is marked draining "
        "(no new requests) until it answers again.",
    )

    @model_validator(mode="after")
    def _retry_after_bounds(self) -> Self:
        if self.retry_after_s > self.retry_after_max_s:
            raise ValueError("retry_after_s must be at most retry_after_max_s")
        return self

    @model_validator(mode="after")
    def _macro_bounds_split(self) -> Self:
        # A macro instance one over the upper bound splits into two of at least the lower.
        if self.macro_max_instances < 2 * self.macro_min_instances - 1:
            raise ValueError("macro_max_instances must be at least 2 x macro_min_instances - 1")
        return self


class ServingStrategy(StrEnum):
    """How a scenario group's instances serve it (docs/strategies.md)."""

    DISAGGREGATED = "disaggregated"  # prefills, then decodes that pull the KV (P/D-Serve)
    AGGREGATED = "aggregated"  # each instance computes prompts and decodes them
    PARTIAL = "partial"  # aggregated instances alternating phases, rolling activation


class ClusterSettings(_Settings):
    """``pdgate up``: the embedded cluster."""

    model_config = SettingsConfigDict(env_prefix="PDGATE_CLUSTER_", extra="forbid")
    _table: ClassVar[str] = "cluster"

    prefills: int = Field(default=2, ge=1, le=64, description="Prefill shims started by pdgate up.")
    decodes: int = Field(default=2, ge=1, le=64, description="Decode workers started by pdgate up.")
    strategy: ServingStrategy = Field(
        default=ServingStrategy.DISAGGREGATED,
        description="disaggregated: prefill shims and decode workers; aggregated: as many "
        "instances that compute prompts and decode them (prefills + decodes of them); "
        "partial: those, alternating prefill and decode phases (EcoServe).",
    )
    shim_base_port: int = Field(default=0, ge=0, le=65535, description="0 = pick free ports.")
