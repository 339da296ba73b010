"""Engines by name: the built-in table, and an engine that lives outside pdgate
(tests/engine_shim/_echo_engine.py) loaded as ``module:factory`` by real shim processes."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest

from pdgate.config import Role, ShimSettings
from pdgate.engine_shim.app import ENGINES, make_backend
from pdgate.engine_shim.sim_engine import SimDecodeEngine, SimPrefillEngine
from tests._cluster import Subprocess, registry_env, shim_load
from tests._redis import delete_prefix

ECHO = "tests.engine_shim._echo_engine:make_backend"


def test_built_in_engines_by_name() -> None:
    assert set(ENGINES) == {"sim", "vllm"}
    assert isinstance(make_backend(ShimSettings(role=Role.PREFILL)), SimPrefillEngine)
    decode = make_backend(ShimSettings(role=Role.DECODE, engine="sim"))
    assert isinstance(decode, SimDecodeEngine)


def test_the_sim_models_the_kv_bandwidth_it_is_given() -> None:
    """25 Gb/s Ethernet against a 400 Gb/s RDMA NIC: the same KV takes 16 times as long
    (beyond the fixed metadata exchange)."""
    times = {}
    for gbps in (25.0, 400.0):
        engine = make_backend(ShimSettings(role=Role.PREFILL, sim_kv_bandwidth_gbps=gbps))
        assert isinstance(engine, SimPrefillEngine)
        profile = engine._profile
        assert profile.kv_bandwidth_bytes_s == gbps * 1e9 / 8
        times[gbps] = profile.kv_transfer_s(4096) - profile.kv_transfer_latency_s
    assert times[25.0] == pytest.approx(16 * times[400.0])
    assert times[25.0] == pytest.approx(4096 * 131_072 / 3.125e9)  # Llama-3.1-8B, bf16
    default = make_backend(ShimSettings(role=Role.PREFILL))
    assert isinstance(default, SimPrefillEngine)
    assert default._profile.kv_bandwidth_bytes_s == 25e9  # the profile's own


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        ("torch", "unknown engine 'torch'; built-in: sim, vllm"),
        ("no_such_module_here:make", "cannot be imported"),
        ("tests.engine_shim._echo_engine:nothing", "has no nothing"),
        ("tests.engine_shim._echo_engine:", "unknown engine"),
    ],
)
def test_bad_engine_names_are_clear_errors(engine: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_backend(ShimSettings(engine=engine))


def test_an_engine_outside_pdgate_loads_by_module_and_factory() -> None:
    from tests.engine_shim._echo_engine import EchoDecode, EchoPrefill

    assert isinstance(make_backend(ShimSettings(role=Role.PREFILL, engine=ECHO)), EchoPrefill)
    assert isinstance(make_backend(ShimSettings(role=Role.DECODE, engine=ECHO)), EchoDecode)


def _url(proc: Subprocess) -> str:
    line = next(line for line in proc.lines if line.startswith("pdgate shim"))
    return line.rsplit(" ", 1)[1].strip()


@pytest.fixture(scope="module")
def echo_pair(redis_url: str) -> Iterator[tuple[str, str]]:
    """An echo prefill and an echo decode, each its own ``pdgate shim`` process, registered
    in one Redis (a decode pulls KV only from prefills of its registry)."""
    prefix = f"pdgate-test:{uuid.uuid4().hex}"
    env = registry_env(redis_url, prefix)
    procs: list[Subprocess] = []
    try:
        for role in ("prefill", "decode"):
            procs.append(
                Subprocess(["shim", "--role", role, "--port", "0", "--engine", ECHO], env=env)
            )
        yield _url(procs[0]), _url(procs[1])
    finally:
        for proc in procs:
            assert proc.terminate() == 0, "".join(proc.lines)
        delete_prefix(redis_url, prefix)


def test_echo_engine_serves_through_prefill_and_decode_processes(
    echo_pair: tuple[str, str],
) -> None:
    prefill, decode = echo_pair
    prompt = "Hello, disaggregated world!"
    body = {"prompt": prompt, "max_tokens": 64}
    first = httpx.post(
        prefill + "/v1/completions",
        json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        timeout=10,
    )
    assert first.status_code == 200, first.text
    assert first.json()["choices"][0]["text"] == "H"
    assert shim_load(prefill)["kv_held"] == 1
    params = first.json()["kv_transfer_params"]
    whole = httpx.post(
        decode + "/v1/completions", json={**body, "kv_transfer_params": params}, timeout=10
    )
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    # The decode echoed the prompt from the KV the prefill handed over, and stopped there.
    assert (choice["text"], choice["finish_reason"]) == (prompt, "stop")
    assert whole.json()["usage"]["completion_tokens"] == len(prompt)
    assert shim_load(prefill)["kv_fetched"] == 1
    assert shim_load(prefill)["used"] == 0


def test_an_engine_without_logprobs_refuses_them(echo_pair: tuple[str, str]) -> None:
    prefill, _ = echo_pair
    resp = httpx.post(
        prefill + "/v1/completions",
        json={
            "prompt": "hi",
            "max_tokens": 1,
            "logprobs": 2,
            "kv_transfer_params": {"do_remote_decode": True},
        },
        timeout=10,
    )
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "logprobs"
    load = shim_load(prefill)
    assert (load["used"], load["kv_held"]) == (0, 0)


def test_an_engine_without_chat_or_token_ids_refuses_them(echo_pair: tuple[str, str]) -> None:
    prefill, _ = echo_pair
    leg = {"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    chat = httpx.post(
        prefill + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], **leg},
        timeout=10,
    )
    assert chat.status_code == 400, chat.text
    assert chat.json()["error"]["param"] == "messages"
    ids = httpx.post(
        prefill + "/v1/completions",
        json={"prompt": "hi", "return_token_ids": True, **leg},
        timeout=10,
    )
    assert ids.status_code == 400, ids.text
    assert ids.json()["error"]["param"] == "return_token_ids"
    load = shim_load(prefill)
    assert (load["used"], load["kv_held"]) == (0, 0)
