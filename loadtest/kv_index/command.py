"""``pdgate bench kv-index``: what the KV-event index costs one gateway, in process.

Builds the index as a gateway with the precise_sse policy does, for `--instances`
publishing prefills and `--blocks` distinct blocks (each held by `--holders` prefills, fed
as vLLM's ``BlockStored`` events of 8 blocks), and measures with one core, `--rounds` times
each: the CPU to decode and apply one event batch per stored block, to take one
``BlockRemoved`` block, to tokenize a prompt (the sim's tokenizer and a byte-level BPE
``tokenizer.json`` read by `tokenizers`) and to match a prompt against the whole index; and
the index's memory per block (tracemalloc). Prints one JSON line and a markdown table; the
figures behind docs/kv-events.md are in docs/results/kv-events/.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import orjson

from pdgate.config.kv_events import (
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    encode_batch,
)
from pdgate.engine_shim.tiny_model import write_tokenizer
from pdgate.gateway.instances.affinity import PrefixIndex, PromptBlocks
from pdgate.gateway.instances.kv_index import KvBlockIndex
from pdgate.gateway.instances.prompt_tokens import (
    HfTokenizer,
    PrefixCachedTokenizer,
    PromptTokenizer,
    PromptTokenizers,
    SimTokenizer,
)
from pdgate.loadtest.lib.args import positive_int
from pdgate.policies.base import RequestInfo

__all__ = ["HELP", "configure", "main"]

HELP = "the KV-event index's CPU per event and per request, and its memory per block"

MODEL = "bench"
BLOCK = 16
PER_EVENT = 8  # blocks per BlockStored, as one prompt's new blocks in a step


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--instances", type=positive_int, default=64)
    p.add_argument("--blocks", type=positive_int, default=100_000)
    p.add_argument("--holders", type=positive_int, default=2, help="prefills per block")
    p.add_argument("--prompt-tokens", type=positive_int, default=2048)
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--seed", type=int, default=0)


def _index(args: argparse.Namespace) -> KvBlockIndex:
    """An empty index that `args.instances` publishing prefills feed."""
    index = KvBlockIndex(PromptTokenizers({MODEL: "sim"}), PrefixIndex(), max_blocks=10**7)
    for i in range(args.instances):
        index.publishing(f"prefill-{i:03d}", MODEL)
    return index


def _event(rng: random.Random) -> BlockStored:
    """One prompt's new blocks, of random tokens."""
    tokens = [rng.randrange(128_000) for _ in range(PER_EVENT * BLOCK)]
    return BlockStored([rng.getrandbits(63) for _ in range(PER_EVENT)], None, tokens, BLOCK)


def _fill(index: KvBlockIndex, args: argparse.Namespace, rng: random.Random) -> None:
    """`args.blocks` blocks, each held by `args.holders` prefills."""
    for n in range(args.blocks // PER_EVENT):
        event = _event(rng)
        for h in range(args.holders):
            index.stored(f"prefill-{(n + h) % args.instances:03d}", event)


def _per(total_s: float, n: int) -> float:
    return total_s / n * 1e6


def _per_item(fn: Callable[[str], object], items: list[str]) -> float:
    start = time.process_time()
    for item in items:
        fn(item)
    return _per(time.process_time() - start, len(items))


def _timed(fn: Callable[[], int]) -> float:
    """CPU microseconds per unit of `fn` (it returns how many units it did)."""
    start = time.process_time()
    units = fn()
    return _per(time.process_time() - start, units)


def _round(args: argparse.Namespace, seed: int, tokenizer_dir: Path) -> dict[str, float]:
    rng = random.Random(seed)
    index = _index(args)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    _fill(index, args, rng)
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    out: dict[str, float] = {"bytes_per_block": grown / args.blocks}

    fresh = _index(args)
    batches = [
        encode_batch(EventBatch(0.0, [_event(rng)]))
        for _ in range(min(args.blocks, 20_000) // PER_EVENT)
    ]

    def apply() -> int:
        for n, payload in enumerate(batches):
            for event in decode_batch(payload).events:
                assert isinstance(event, BlockStored)
                fresh.stored(f"prefill-{n % args.instances:03d}", event)
        return len(batches) * PER_EVENT

    out["apply_us_per_block"] = _timed(apply)

    def remove() -> int:
        removed = 0
        for n, payload in enumerate(batches[: len(batches) // 2]):
            (event,) = decode_batch(payload).events
            assert isinstance(event, BlockStored)
            fresh.removed(f"prefill-{n % args.instances:03d}", BlockRemoved(event.block_hashes))
            removed += PER_EVENT
        return removed

    out["remove_us_per_block"] = _timed(remove)

    words = [
        "the",
        "gateway",
        "routes",
        "each",
        "prompt",
        "to",
        "the",
        "prefill",
        "whose",
        "cache",
        "holds",
        "it",
    ]

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    prompts = [text(args.prompt_tokens) for _ in range(50)]
    # Prompts of one of 4 shared prefixes (90% of the words) and a question of their own.
    prefixes = [text(args.prompt_tokens * 9 // 10) for _ in range(4)]
    shared = [f"{prefixes[i % 4]} {text(args.prompt_tokens // 10)}" for i in range(200)]
    inners: list[tuple[str, PromptTokenizer]] = [
        ("sim", SimTokenizer()),
        ("hf", HfTokenizer(tokenizer_dir)),
    ]
    for name, inner in inners:
        cached = PrefixCachedTokenizer(inner)
        out[f"tokenize_{name}_us"] = _per_item(inner.encode, prompts)
        out[f"tokenize_{name}_shared_uncached_us"] = _per_item(inner.encode, shared)
        out[f"tokenize_{name}_shared_cached_us"] = _per_item(cached.encode, shared)
    # A match walks a prompt that one prefill holds in full, against the filled index.
    held = prompts[0]
    blocks = index.blocks(RequestInfo(MODEL, None, held, len(held), 1))
    index.routed(blocks, "prefill-000")

    # Cut once per request (tokenized, hashed), matched on every look at the queue. Unique
    # prompts, first seen: tokenized in full.
    def cut_one(prompt: str) -> PromptBlocks:
        return index.blocks(RequestInfo(MODEL, None, prompt, len(prompt), 1))

    fresh_prompts = [text(args.prompt_tokens) for _ in range(50)]
    out["blocks_us"] = _per_item(cut_one, fresh_prompts)
    cut = [cut_one(p) for p in fresh_prompts]
    start = time.process_time()
    for b in cut:
        index.match(b)  # the first look also hashes the prompt's blocks for the block size
    out["match_first_us"] = _per(time.process_time() - start, len(cut))
    start = time.process_time()
    for b in cut:
        index.match(b)
    out["match_again_us"] = _per(time.process_time() - start, len(cut))
    return out


def main(args: argparse.Namespace, command: str) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        write_tokenizer(Path(tmp), 4096)
        rounds = [_round(args, args.seed + r, Path(tmp)) for r in range(args.rounds)]
    summary = {
        key: {
            "min": min(r[key] for r in rounds),
            "median": statistics.median(r[key] for r in rounds),
            "max": max(r[key] for r in rounds),
        }
        for key in rounds[0]
    }
    print(f"Command: `{command}`\n")
    print(
        f"{args.instances} publishing prefills, {args.blocks:,} blocks held by {args.holders} "
        f"each, {args.prompt_tokens}-token prompts; {args.rounds} rounds (min / median / max)\n"
    )
    print("| figure | min | median | max |\n|---|---|---|---|")
    for key, s in summary.items():
        print(f"| {key} | {s['min']:.2f} | {s['median']:.2f} | {s['max']:.2f} |")
    print(orjson.dumps({"kv_index": summary, "args": vars(args)}).decode(), flush=True)
    return 0
