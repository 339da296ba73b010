"""`pdgate bench kv-copy` times the connector's copies with torch; the rest of `pdgate bench`
must not need torch. (Its cases, at their Llama-3.1-8B sizes, run on a GPU by hand:
docs/results/vllm/gpu/README.md.)"""

from __future__ import annotations

import subprocess
import sys

_PARSE_ONLY = """
import sys
from pdgate.loadtest import bench
args = bench._parser().parse_args(["kv-copy", "save-paths", "--device", "cuda", "--threads", "1"])
assert (args.case, args.device, args.threads) == ("save-paths", "cuda", 1), args
assert "torch" not in sys.modules, "the CLI imported torch before a case ran"
"""


def test_the_bench_cli_parses_kv_copy_without_importing_torch() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PARSE_ONLY], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_every_case_is_offered() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pdgate.loadtest.kv_copy", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "{copies,save-paths,buffer-pages}" in done.stdout
