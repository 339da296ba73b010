"""The P/D handshake both sides of the wire share: roles, paths, headers, limits.

Neutral ground: this module imports nothing of pdgate's (and only the standard library), so
the gateway and the shims agree on it without depending on each other. The gateway never
imports the shim package: it fronts stock vLLM as well as pdgate's shims.

It is vLLM's OpenAI API plus vLLM's disaggregation handshake (``kv_transfer_params``), so
the gateway can front real vLLM and any vLLM-compatible router can front pdgate's shims:

1. gateway -> prefill ``POST /v1/completions``: the client body with ``max_tokens=1``,
   ``stream=false``, no ``stream_options`` and ``kv_transfer_params = prefill_kv_request()``.
   A prefill with no free slot answers 429 (OpenAI error body, ``Retry-After``) at once.
2. prefill -> gateway: a completion whose ``kv_transfer_params`` name where the KV lives
   (vLLM's NIXL field names: ``remote_engine_id``, ``remote_host``, ``remote_port``,
   ``remote_block_ids``, ``remote_request_id``).
3. gateway -> decode ``POST /v1/completions``: the client's body plus those params.
   The decode pulls ``GET {prefill}/v1/kv/{remote_request_id}`` (pdgate extension) and streams.
   ``POST /v1/chat/completions`` goes through the same two legs with the client's messages.
4. ``DELETE {prefill}/v1/kv/{remote_request_id}`` (pdgate extension) releases KV nobody will
   fetch (decode rejected, client gone); the prefill's hold timeout is the backstop.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    # Computes prompts and decodes them: a group of these is served aggregated (NoDG), the
    # whole request to one instance (a plain vLLM server, or a shim over one).
    AGGREGATED = "aggregated"


# -- paths ---------------------------------------------------------------------------------

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"  # the same two legs with the client's messages
KV_PATH = "/v1/kv/{request_id}"
BATCH_SUFFIX = "/batch"  # pdgate extension: several prefill legs in one call, per API
BATCH_PATH = COMPLETIONS_PATH + BATCH_SUFFIX
CHAT_BATCH_PATH = CHAT_PATH + BATCH_SUFFIX
LOAD_PATH = "/load"
HEALTH_PATH = "/health"
MODELS_PATH = "/v1/models"
OPENAPI_PATH = "/openapi.json"  # a FastAPI server's routes (vLLM's: what its model serves)

# Side endpoints: requests that go whole to one instance of their model, never in two legs.
# vLLM's API server answers the first two itself (no batch slot); the others are computed
# by a pooling model (vLLM registers them only for one).
TOKENIZE_PATH = "/tokenize"
DETOKENIZE_PATH = "/detokenize"
TOKEN_ENDPOINTS = (TOKENIZE_PATH, DETOKENIZE_PATH)
POOLING_ENDPOINTS = (
    "/v1/embeddings",
    "/pooling",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
)
SIDE_ENDPOINTS = TOKEN_ENDPOINTS + POOLING_ENDPOINTS

# -- extensions ----------------------------------------------------------------------------

# What an instance's registry record says it speaks beyond vLLM's API. A gateway uses an
# extension only with instances that declare it, so a stock server (static, announced) gets
# exactly vLLM's handshake and is never probed with a pdgate-only call.
EXT_BATCH_PREFILL = "batch_prefill"  # POST {api}/batch (BATCH_SUFFIX)
# A decode that also takes plain requests (no kv_transfer_params) and prefills them itself:
# the gateway may skip the prefill leg for prompts with few uncached tokens there.
EXT_LOCAL_PREFILL = "local_prefill"
# A decode that continues a stream from token ids: it takes a prompt longer than the KV it is
# given (the KV of a prefix of it) and computes the rest itself, and each streamed chunk's
# ``token_ids`` are exactly the tokens of the text that chunk carries (text held back for a
# stop string travels with its ids). The first token early and the migration of streams with
# stop strings rely on it.
EXT_CONTINUATION = "continuation"
# An instance that answers 429 when its slots are full instead of queueing (P/D-Serve's
# admission): it enforces its own slots. A gateway alone in its fleet may count a prefill's
# locally instead of leasing each one through Redis; one that queues (stock vLLM, or
# admission=queue) must be leased: only the gateways can keep it queue-less. A decode's
# bound the requests it takes a second (gateway/placement/drain.py, `DecodeCapacity`).
EXT_QUEUELESS = "queueless"
# An aggregated instance that alternates prefill and decode phases (EcoServe's temporal
# disaggregation): its group is served partially disaggregated (rolling activation).
EXT_PHASES = "phases"
# It tokenizes with the sim's tokenizer (config/sim_tokenizer.py): a gateway matching prompts
# to its KV events in tokens uses the same.
EXT_SIM_TOKENIZER = "sim_tokenizer"
MAX_EXTENSIONS = 16
MAX_EXTENSION_CHARS = 64
# What an instance declares it runs on, GPU[/tpN][/ppN] (engine_shim/hardware.py): the
# settings and the registry's record check it by the same rule.
HARDWARE_PATTERN = r"^[a-z0-9/._-]{0,64}$"
# What a record may say of the model it serves: LoRA adapters (served names) on top of it,
# and the side endpoints (paths) it answers.
MAX_ADAPTERS = 256
MAX_MODEL_NAME_CHARS = 256
MAX_ENDPOINTS = 32
MAX_ENDPOINT_CHARS = 64
MAX_CONTEXT_TOKENS = 1 << 32  # a model's max_model_len beyond this is not believed

# -- KV connectors -------------------------------------------------------------------------


class KvConnector(StrEnum):
    """How an instance's engine hands a prompt's KV to a decode (vLLM's ``kv_connector``),
    as its record names it. The gateway speaks each one's handshake as vLLM's own proxies
    do, and pairs a prefill only with decodes of the same connector. A record that names
    none is a pdgate shim's if it declares extensions (one written before records named
    their connector), else a stock server's that takes vLLM's pull handshake
    (`record_connector`)."""

    PDGATE = "pdgate"  # pdgate's shims: a host buffer the decode pulls (GET /v1/kv/{id})
    EXAMPLE = "example"  # ExampleConnector: shared storage the decode reads by the prompt
    NIXL = "nixl"  # NixlConnector (NixlPullConnector): the decode reads the prefill's blocks
    NIXL_PUSH = "nixl_push"  # NixlPushConnector: the prefill writes into the decode's blocks
    MOONCAKE = "mooncake"  # MooncakeConnector: the decode pulls by a transfer id


CONNECTOR_PATTERN = r"^[a-z0-9_]{0,32}$"  # a record's connector name ("" none named)
# Mooncake: a prefill's bootstrap server (vLLM's VLLM_MOONCAKE_BOOTSTRAP_PORT default), and
# the engine ids it lists, one per data-parallel rank.
MOONCAKE_BOOTSTRAP_PORT = 8998
MAX_KV_ENGINES = 64
MAX_KV_ENGINE_CHARS = 128
MAX_BOOTSTRAP_CHARS = 256


def record_connector(named: str, extensions: tuple[str, ...]) -> str:
    """The connector an instance speaks: the one its record names; for a record naming none,
    pdgate's if it declares pdgate extensions (a shim from before records named one), else
    "" (a stock server whose connector was not given: vLLM's pull handshake)."""
    if named:
        return named
    return KvConnector.PDGATE.value if extensions else ""


# -- headers -------------------------------------------------------------------------------

REQUEST_ID_HEADER = "x-request-id"
# Request header of the prefill leg: the caller's name for the KV handle (pdgate extension),
# so it can DELETE the KV of a call it abandoned without ever reading the answer.
KV_ID_HEADER = "x-pdgate-kv-id"
# Request header of the prefill leg: the fleet gateway that sends it (its id in the fleet's
# Redis). A pdgate prefill lets go of the KV it holds for a gateway whose fleet entry
# expired (it died): nobody will pull it. Sent only by gateways that share a fleet.
GATEWAY_ID_HEADER = "x-pdgate-gateway"
# Request header of the prefill leg: the max_tokens its decode leg will ask for (the prefill
# leg's own is 1). A pdgate prefill checks the context length with it, as the decode will,
# so a prompt too long for the client's max_tokens is refused before it is computed, with
# the client's number in the message; other servers ignore it. The batch endpoint takes the
# same per request as ``decode_max_tokens``.
DECODE_MAX_TOKENS_HEADER = "x-pdgate-decode-max-tokens"
# Gateway -> an aggregated instance: milliseconds the request has left for its first token.
# An instance that alternates phases lets a waiting prompt in by then at the latest.
TTFT_LEFT_HEADER = "x-pdgate-ttft-left-ms"
# Client -> gateway: a tighter TPOT SLO for this request, milliseconds; gateway -> an
# aggregated instance: the request's TPOT SLO (the phases hold its decode to it).
TPOT_SLO_HEADER = "x-pdgate-tpot-slo-ms"
# Error code of a decode's 400 for ``kv_transfer_params`` naming no prefill it knows: about
# its view of the registry, not about the request (the view may lag the gateway's).
UNKNOWN_KV_SOURCE = "unknown_kv_source"
# Response headers of the KV pull.
KV_TOKENS_HEADER = "x-pdgate-kv-tokens"
KV_DIGEST_HEADER = "x-pdgate-kv-digest"  # blake2b-128 hex of the body, checked by the decode
# Response header of the KV release (``DELETE``, 204 or 404 alike): what the prefill did with
# the call that named the id: admitted, rejected (429), or unseen (neither, and it never will:
# a call with the id that arrives later is refused uncounted). A gateway that cut a call off
# unanswered learns so which count the prefill put it in; a 204 has no body to carry it.
ADMISSION_HEADER = "x-pdgate-admission"
ADMISSIONS = ("admitted", "rejected", "unseen")

SSE_DONE = b"data: [DONE]\n\n"

# -- limits --------------------------------------------------------------------------------

MAX_BATCH = 256  # prefill legs in one batch call
MAX_STOP_SEQUENCES = 4
MAX_CHAT_MESSAGES = 4096  # messages in one chat request
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
MAX_REQUEST_ID_CHARS = 128
KV_ID_CHARS = (8, 64)  # a caller-chosen KV id: alphanumeric ASCII of this length


def valid_kv_id(kv_id: str) -> bool:
    low, high = KV_ID_CHARS
    return low <= len(kv_id) <= high and kv_id.isascii() and kv_id.isalnum()


def valid_request_id(request_id: str) -> bool:
    """A caller's ``x-request-id`` that is safe to log and to echo back in headers."""
    return (
        0 < len(request_id) <= MAX_REQUEST_ID_CHARS
        and request_id.isascii()
        and request_id.isprintable()
    )


# -- the handshake -------------------------------------------------------------------------


def prefill_kv_request() -> dict[str, Any]:
    """``kv_transfer_params`` the gateway sends to a prefill."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


def kv_release_url(base_url: str, kv_id: str) -> str:
    return base_url.rstrip("/") + KV_PATH.format(request_id=kv_id)


def kv_url(params: dict[str, Any]) -> str | None:
    """Where a decode pulls the KV named by a prefill's ``kv_transfer_params``."""
    host, port = params.get("remote_host"), params.get("remote_port")
    rid = params.get("remote_request_id")
    if not host or not port or not rid:
        return None
    try:
        port = int(port)
    except (TypeError, ValueError):
        return None
    # IPv6 literals need brackets in a URL.
    netloc = f"[{host}]" if ":" in str(host) and not str(host).startswith("[") else str(host)
    return f"http://{netloc}:{port}" + KV_PATH.format(request_id=rid)
