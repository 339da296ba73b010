"""``pdgate bench kv-copy copies|save-paths|buffer-pages``: the vLLM connector's KV copies
between a paged cache and a buffer file, timed on the CPU or a GPU.

``copies`` (copies.py) saves and loads prompts of 1,024 and 4,096 tokens as the connector
does, as token rows and as whole blocks; ``save-paths`` (saves.py) compares ways to save;
``buffer-pages`` (saves.py) splits a save's time between the file's pages and the copy.
Each prints a Markdown table. torch is imported only when a case runs; on a machine with
torch but without pdgate's other dependencies, ``python -m pdgate.loadtest.kv_copy`` takes
the same arguments.
"""

from __future__ import annotations

import argparse
import importlib

__all__ = ["HELP", "configure", "main"]

HELP = "the vLLM connector's KV copies between a paged cache and a buffer file (needs torch)"

# Case -> (module, function): each imports torch, so only the one run is imported.
_CASES = {
    "copies": ("copies", "run"),
    "save-paths": ("saves", "save_paths"),
    "buffer-pages": ("saves", "buffer_pages"),
}


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("case", choices=tuple(_CASES))
    p.add_argument("--device", default="cpu", help="where the caches live: cpu, cuda, cuda:N")
    p.add_argument("--threads", type=int, default=0, help="torch's CPU threads (0: its own)")


def main(args: argparse.Namespace, command: str) -> int:
    module, function = _CASES[args.case]
    run = getattr(importlib.import_module(f"pdgate.loadtest.kv_copy.{module}"), function)
    run(args.device, args.threads)
    return 0
