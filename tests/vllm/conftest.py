"""The vLLM suite's cluster: a gateway, one vLLM prefill shim and one vLLM decode shim, each a
real ``pdgate`` process registered in a real Redis, serving a tiny random-weight Llama on the
CPU; plus the same model's greedy output from one aggregated vLLM engine.

Without vLLM the suite is skipped on a developer machine and fails under ``CI=true``, so a
pipeline that runs ``make test-vllm`` cannot go green by skipping it. Everything is started
once per module: loading vLLM takes tens of seconds per engine on two cores.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests._cluster import get_instances, wait_for

MODEL = "pdgate-tiny-llama"
REFERENCE_TOKENS = 24
PROMPTS = (
    "Hello there, general Kenobi. Explain disaggregated serving.",
    "Once upon a time, in a land far away, there lived a small model with random weights "
    "and a big heart, and it decided to explain the prefill and the decode to everyone.",
)
# Chats answered by the aggregated engine too (LLM.chat: the model's chat template).
CHATS: tuple[list[dict[str, str]], ...] = (
    [
        {"role": "system", "content": "You are a small model with random weights."},
        {"role": "user", "content": "Explain the prefill and the decode, in one paragraph."},
    ],
)
START_TIMEOUT_S = 300.0  # three engines loading at once on two cores
# vLLM on the CPU, offline: no hub lookups; VLLM_CPU_CI_ENV relaxes vLLM's CPU checks for CI.
VLLM_ENV = {"VLLM_CPU_CI_ENV": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _require_vllm() -> None:
    if importlib.util.find_spec("vllm") is not None:
        return
    reason = "vLLM is not installed (run `make vllm`)"
    if os.environ.get("CI", "").strip().lower() == "true":
        pytest.fail(f"the vllm suite needs vLLM under CI=true: {reason}", pytrace=False)
    pytest.skip(reason)


class Proc:
    """A child process whose output is kept (bounded) and scanned for a ready line."""

    def __init__(self, args: list[str], env: dict[str, str], name: str) -> None:
        self.name = name
        self.env = env  # the settings it was given (beside the inherited environment)
        self.proc = subprocess.Popen(
            [sys.executable, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **VLLM_ENV, **env, "PYTHONUNBUFFERED": "1"},
        )
        self.lines: list[str] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True, name=f"{name}-output").start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                if len(self.lines) < 5000:
                    self.lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_line(self, prefix: str, timeout: float) -> str:
        return self.wait_lines(prefix, 1, timeout)[0]

    def wait_lines(self, prefix: str, count: int, timeout: float) -> list[str]:
        """The first `count` output lines starting with `prefix`, waiting for them."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = [line for line in self.lines if line.startswith(prefix)]
                if len(found) >= count:
                    return found[:count]
                if self.proc.poll() is not None and self.proc.stdout is not None:
                    raise RuntimeError(f"{self.name} exited:\n{self.tail()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"{self.name} not ready in {timeout} s:\n{self.tail()}")
                self._cond.wait(min(left, 1.0))

    def tail(self, n: int = 60) -> str:
        """The last `n` lines of its output and, when an error came earlier, the lines around
        the first one: a vLLM engine's cause is logged long before the line it fails with
        (its workers' tracebacks, then the engine core's own)."""
        lines = list(self.lines)
        first = next(
            (i for i, line in enumerate(lines) if "Traceback" in line or "ERROR" in line), None
        )
        if first is None or first >= len(lines) - n:
            return "".join(lines[-n:])
        cause = lines[max(0, first - 10) : min(first + 150, len(lines) - n)]
        return "".join([*cause, "[...]\n", *lines[-n:]])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def wait_healthy(proc: Proc, url: str, deadline: float) -> None:
    """Until `url`/health answers 200; fails with the process's last output if it exits or
    `deadline` (monotonic) passes."""
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{proc.name} not healthy in {START_TIMEOUT_S} s:\n{proc.tail()}")


def _url(line: str) -> str:
    """The base URL in a ``pdgate ...: http://host:port[/v1]`` ready line."""
    match = re.search(r"http://\S+", line)
    assert match is not None, line
    return match.group(0).removesuffix("/v1")


@dataclass
class VllmCluster:
    gateway_url: str
    prefill_url: str
    decode_url: str
    reference: dict[str, dict[str, Any]]  # prompt -> aggregated greedy output
    procs: dict[str, Proc]
    chat_reference: list[dict[str, Any]] = field(default_factory=list)  # one per CHATS entry
    registry: dict[str, str] = field(default_factory=dict)  # env naming the cluster's registry


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _require_vllm()
    from pdgate.engine_shim.tiny_model import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def greedy_messages_body(system: str, user: str, max_tokens: int) -> dict[str, Any]:
    """An Anthropic Messages request for the SDK, greedy."""
    return {
        "model": MODEL,
        "system": system,
        "messages": [{"role": "user", "content": user}],
        "max_tokens": max_tokens,
        # Greedy: the SDK has no temperature argument any more; both APIs take the field.
        "extra_body": {"temperature": 0},
    }


def assert_messages_text(base_url: str, body: dict[str, Any], text: str) -> Any:
    """`body` through Anthropic's SDK at `base_url`, whole and streamed: both answer `text`.
    The whole answer."""
    import anthropic

    client = anthropic.Anthropic(base_url=base_url, api_key="x", max_retries=0)
    message = client.messages.create(**body)
    assert message.content[0].text == text
    with client.messages.stream(**body) as stream:
        assert "".join(stream.text_stream) == text
    return message


def vllm_shim_env(registry: dict[str, str], tiny_model: Path) -> dict[str, str]:
    """A vllm shim's environment: `registry`'s, the tiny model, a port the OS picks."""
    return {
        **registry,
        "PDGATE_SHIM_ENGINE": "vllm",
        "PDGATE_SHIM_MODEL": MODEL,
        "PDGATE_SHIM_VLLM_MODEL": str(tiny_model),
        "PDGATE_SHIM_VLLM_DTYPE": "float32",  # bf16 is not supported by vLLM's CPU path here
        "PDGATE_SHIM_MAX_MODEL_LEN": "2048",
        "PDGATE_SHIM_VLLM_KV_CACHE_BYTES": str(64 << 20),
        "PDGATE_SHIM_PORT": "0",
    }


@pytest.fixture(scope="module")
def vllm_cluster(redis_url: str, tiny_model: Path) -> Iterator[VllmCluster]:
    import uuid

    from tests._redis import delete_prefix

    prefix = f"pdgate-test:{uuid.uuid4().hex}"
    registry = {"PDGATE_REGISTRY_URL": redis_url, "PDGATE_REGISTRY_KEY_PREFIX": prefix}
    shim = vllm_shim_env(registry, tiny_model)
    cli = ["-m", "pdgate.config.cli"]
    procs: dict[str, Proc] = {}
    try:
        procs["reference"] = Proc(
            [
                "-m",
                "tests.vllm._reference",
                str(tiny_model),
                str(REFERENCE_TOKENS),
                *PROMPTS,
                *("chat:" + json.dumps(chat) for chat in CHATS),
            ],
            {},
            "reference",
        )
        procs["prefill"] = Proc(
            [*cli, "shim", "--role", "prefill", "--capacity", "1"],
            {
                **shim,
                # Chunked prefill in steps of 16 tokens: saves span several engine steps, and
                # a long prompt stays in the engine long enough to be withdrawn mid-way.
                "PDGATE_SHIM_VLLM_ENGINE_ARGS": json.dumps({"max_num_batched_tokens": 16}),
                # vLLM's KV events, which the gateway's precise_sse policy follows.
                "PDGATE_SHIM_KV_EVENTS_PORT": "0",
            },
            "prefill",
        )
        procs["decode"] = Proc(
            [*cli, "shim", "--role", "decode", "--capacity", "4"], shim, "decode"
        )
        procs["gateway"] = Proc(
            [*cli, "gateway", "--port", "0"],
            {
                **registry,
                "PDGATE_GATEWAY_TTFT_TIMEOUT_S": "20",
                "PDGATE_GATEWAY_PREFILL_POLICY": "precise_sse",
                "PDGATE_GATEWAY_TOKENIZERS": json.dumps({MODEL: str(tiny_model)}),
            },
            "gateway",
        )
        gateway_url = _url(procs["gateway"].wait_line("pdgate gateway", 60))
        prefill_url = _url(procs["prefill"].wait_line("pdgate shim", START_TIMEOUT_S))
        decode_url = _url(procs["decode"].wait_line("pdgate shim", START_TIMEOUT_S))
        lines = procs["reference"].wait_lines("REFERENCE ", len(PROMPTS), START_TIMEOUT_S)
        reference = {
            prompt: json.loads(line.removeprefix("REFERENCE "))
            for prompt, line in zip(PROMPTS, lines, strict=True)
        }
        chat_lines = procs["reference"].wait_lines("REFERENCE_CHAT ", len(CHATS), 60)
        chat_reference = [json.loads(line.removeprefix("REFERENCE_CHAT ")) for line in chat_lines]
        wait_for(
            lambda: len(get_instances(gateway_url)) == 2, timeout=15, what="both shims registered"
        )
        yield VllmCluster(
            gateway_url, prefill_url, decode_url, reference, procs, chat_reference, registry
        )
    finally:
        for proc in procs.values():
            proc.stop()
        try:
            delete_prefix(redis_url, prefix)
        except Exception as exc:  # cleanup only
            print(f"could not clean up Redis keys {prefix}:*: {exc}")
