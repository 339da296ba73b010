"""Following the gateway's P/D ratio advice (eq. 1) raises goodput (issue 14, part 2): each
workload shape starts from the split it suits worst, the advice read from GET /admin/ratio
points the other way, and the advised split serves more. `pdgate bench ratio --quick` as a
test: 8 instances deployed as processes, about 90 s."""

from __future__ import annotations

import pytest

from pdgate.loadtest.lib.log import to_stderr
from pdgate.loadtest.ratio.experiment import Plan, run_experiment
from pdgate.loadtest.ratio.report import comparisons
from pdgate.loadtest.ratio.workload import QUICK_WORKLOADS, Shape, model_ratio
from pdgate.loadtest.scheduling.runner import Timing
from tests.loadtest._procs import marked, needs_redis

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


async def test_the_advised_split_beats_the_unbalanced_one(monkeypatch: pytest.MonkeyPatch) -> None:
    needs_redis()
    plan = Plan(
        workloads=QUICK_WORKLOADS,
        starts_by_workload=(("prompt_heavy", ((2, 6),)), ("decode_heavy", ((6, 2),))),
        seeds=(0,),
        timing=Timing(warmup_s=3.0, measure_s=8.0),
    )
    with marked(monkeypatch):
        result = await run_experiment(plan, to_stderr)
    for workload in QUICK_WORKLOADS:
        c = comparisons(result, workload)
        (start,) = next(iter(c.values()))["starts"]
        assert start.advice is not None and start.advised is not None, start
        # The gateway saw the split it ran on.
        assert (start.advice["prefills"], start.advice["decodes"]) == start.split
        # Its measured ratio is within a factor 2 of eq. 1 from the sim profile's constants.
        model = model_ratio(workload, Shape())["ratio"]
        assert model / 2 < start.advice["ratio"] < model * 2, (start.advice, model)
        # Long prompts: more prefills; long outputs: more decodes.
        if workload.name == "prompt_heavy":
            assert start.advice["bottleneck"] == "prefill" and start.advised[0] >= 6
        else:
            assert start.advice["bottleneck"] == "decode" and start.advised[1] >= 6
        (after,) = next(iter(c.values()))["followed"]
        before_rps, after_rps = start.point.summary.goodput_rps, after.point.summary.goodput_rps
        assert after_rps > 1.3 * before_rps, (workload.name, before_rps, after_rps)
        assert after.point.summary.success_rate > start.point.summary.success_rate
