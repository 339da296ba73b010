"""`pdgate bench kv-copy` times the connector's copies with torch; the rest of `pdgate bench`
must not need torch. (Its cases, at their Llama-3.1-8B sizes, run on a GPU by hand:
docs/results/vllm/gpu/README.md.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

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


@pytest.mark.vllm
@pytest.mark.parametrize(
    ("case", "rows"),
    [
        ("copies", ["rows", "blocks"]),  # on the CPU: no staged or mapped forms
        ("buffer-pages", ["fresh", "reused", "tensor", "reused, keys and values apart",
                          "tensor, apart"]),
        ("save-paths", ["halves (save_rows)", "halves, fallocate", "halves, populate", "stacked",
                        "stacked, populate", "stacked, staged, copy",
                        "stacked, staged, copy, populate", "stacked, staged, pwrite",
                        "stacked, staged only (no file)", "halves, reused file"]),
    ],
)  # fmt: skip
def test_each_case_runs_on_the_cpu_at_a_small_size(
    case: str, rows: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two layers and 256 tokens instead of the model's 32 and 4,096: every row is timed
    (copies checks each load against its cache), none failed, the scratch files are gone."""
    import argparse
    import tempfile
    from pathlib import Path

    from pdgate.loadtest.kv_copy import cache, command, copies, saves

    made: list[Path] = []
    mkdtemp = tempfile.mkdtemp

    def recorded(*args: object, **kwargs: object) -> str:
        made.append(Path(mkdtemp(*args, **kwargs)))  # type: ignore[call-overload]
        return str(made[-1])

    monkeypatch.setattr(tempfile, "mkdtemp", recorded)

    for module in (cache, copies, saves):
        monkeypatch.setattr(module, "LAYERS", 2)
    for module in (cache, saves):
        monkeypatch.setattr(module, "TOKENS", 256)
    args = argparse.Namespace(case=case, device="cpu", threads=0)
    assert command.main(args, "pdgate bench kv-copy " + case) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in table[1:]]  # no head
    names = [c[0] for c in cells]
    assert sorted(set(names)) == sorted(rows), cells
    for row in cells:
        for spread in row[-1:] if case != "copies" else row[-2:]:
            low, mid, high = (float(x) for x in spread.split(" / "))  # "failed: ..." fails here
            assert 0 <= low <= mid <= high
    assert made
    assert not [d for d in made if d.exists()]
