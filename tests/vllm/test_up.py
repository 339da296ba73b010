"""``pdgate up --engine vllm``, as docs/vllm.md gives it, with no KV cache size set: it sizes
its engines' KV caches so that all of them fit on the machine, says so, and serves."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from tests.vllm.conftest import START_TIMEOUT_S, Proc, _url

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

_LINE = re.compile(
    r"pdgate up: KV cache per engine: (\d+\.\d) GiB \((\d+) engines, (\d+\.\d) GiB available\)"
)


def test_pdgate_up_sizes_its_engines_to_fit_and_serves(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What the user did not set: vLLM's own default would apply, one engine per machine.
    for name in ("PDGATE_SHIM_VLLM_KV_CACHE_BYTES", "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("PDGATE_SHIM_VLLM_ENGINE_ARGS", raising=False)
    env = {"PDGATE_SHIM_VLLM_DTYPE": "float32", "PDGATE_SHIM_MAX_MODEL_LEN": "2048"}
    args = ["-m", "pdgate.config.cli", "up", "--engine", "vllm", "--model", str(tiny_model)]
    up = Proc([*args, "--prefills", "1", "--decodes", "1", "--port", "0"], env, "up")
    try:
        sized = up.wait_line("pdgate up: KV cache per engine:", 120)
        match = _LINE.match(sized.strip())
        assert match is not None, sized
        per_engine, engines, available = float(match[1]), int(match[2]), float(match[3])
        assert engines == 2
        assert 0 < 2 * per_engine < available
        base = _url(up.wait_line("pdgate up: send OpenAI requests", START_TIMEOUT_S))
        body = {"model": str(tiny_model), "prompt": "Hello there", "max_tokens": 8}
        answer = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
        assert answer["choices"][0]["text"], answer
        print(sized.strip())
    finally:
        up.stop()
