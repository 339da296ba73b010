"""What ``first_token_early`` gains: time to the first token with the flag on and off.

Without it, the client's first token is the decode's: the prefill computes the prompt, the
decode pulls its KV (the sim models the full-size transfer over the decode's link), joins its
running batch and generates the token the prefill had already computed. With it, the gateway
sends the prefill's token as soon as the prefill answers. This starts ``pdgate up`` (one sim
prefill, one sim decode, the ``llama-3.1-8b-h100`` profile: 128 KiB of KV per token at 25 GB/s
plus 1 ms per transfer, a decode step of about 6 ms) with the flag off and on, interleaved
over rounds, sends one streaming request at a time for each prompt length (no queueing, so the
difference is the handshake's alone), and reports the median time from sending the request to
the first chunk with text.

    python -m pdgate.loadtest.gateway_cost.first_token [--rounds 3] [--requests 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from pdgate.loadtest.lib.children import Child, run_main

LENGTHS = (256, 2048, 8192)  # prompt tokens (the sim's tokenizer: one per word here)


def _config(early: bool) -> Path:
    text = (
        f"[gateway]\nfirst_token_early = {str(early).lower()}\nttft_timeout_s = 60\n"
        '[shim]\nsim_profile = "llama-3.1-8b-h100"\ncapacity = 8\n'
        "[cluster]\nprefills = 1\ndecodes = 1\n"
    )
    fd, name = tempfile.mkstemp(suffix=".toml")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    return Path(name)


async def _ttft(session: aiohttp.ClientSession, url: str, prompt: str) -> float:
    body = orjson.dumps({"prompt": prompt, "max_tokens": 8, "stream": True})
    start = time.monotonic()
    first = None
    async with session.post(url, data=body, headers={"content-type": "application/json"}) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if first is None and line.startswith(b"data: {") and b'"text":"' in line:
                first = time.monotonic() - start
    assert first is not None
    return first


async def _round(early: bool, args: argparse.Namespace, seq: int) -> dict[int, float]:
    cfg = _config(early)
    argv = [sys.executable, "-m", "pdgate.config.cli", "--log-level", "WARNING", "up",
            "--config", str(cfg), "--port", "0"]  # fmt: skip
    proc = Child("pdgate up", argv)
    try:
        ready = await proc.start(r"pdgate up: send OpenAI requests to (http://[\w.:]+)", 60)
        url = ready.group(1) + "/v1/completions"
        out = {}
        async with aiohttp.ClientSession() as session:
            await _ttft(session, url, "warm up " * 8)
            for length in LENGTHS:
                # A fresh prompt every time: no prefix-cache hit shortens the prefill.
                times = [
                    await _ttft(session, url, f"r{seq} q{i} " + "word " * (length - 4))
                    for i in range(args.requests)
                ]
                out[length] = statistics.median(times)
        return out
    finally:
        await proc.stop()
        cfg.unlink()


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[bool, list[dict[int, float]]] = {False: [], True: []}
    for seq in range(args.rounds):  # interleaved: drift on a shared machine hits both alike
        for early in (False, True):
            runs[early].append(await _round(early, args, 2 * seq + early))
    report: dict[str, Any] = {}
    for length in LENGTHS:
        off = statistics.median(r[length] for r in runs[False]) * 1000
        on = statistics.median(r[length] for r in runs[True]) * 1000
        report[str(length)] = {
            "ttft_off_ms": round(off, 1),
            "ttft_on_ms": round(on, 1),
            "gain_ms": round(off - on, 1),
        }
    return {"rounds": args.rounds, "requests": args.requests, "prompt_tokens": report}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pdgate.loadtest.gateway_cost.first_token", description=__doc__
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=20, help="per prompt length and round")
    args = p.parse_args(argv)
    print(orjson.dumps(run_main(_main(args)), option=orjson.OPT_INDENT_2).decode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
