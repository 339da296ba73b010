from __future__ import annotations

import pytest

from pdgate.loadtest import bench
from tests.loadtest._procs import RunBench, marked, needs_redis


@pytest.fixture
def run_bench(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> RunBench:
    """Runs ``pdgate bench ARGS`` in this process with a private Redis, every process it
    starts marked (none may outlive it), and checks its 0 exit status."""

    def run(args: list[str]) -> list[str]:
        needs_redis()
        with marked(monkeypatch):
            code = bench.main(args)
        assert code == 0
        return capsys.readouterr().out.strip().splitlines()

    return run
