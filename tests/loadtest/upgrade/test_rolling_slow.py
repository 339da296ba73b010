"""The fleet-level promise of a rolling upgrade (issue 14, part 5): under steady streaming
load, every prefill and every decode is replaced one after another (SIGTERM, drain, exit, a
new process, registered) and no client request fails; then every gateway the way the deploy
layout replaces one (out of the load balancer's rotation, preStop grace, SIGTERM, a new
one), again with no failure. Real processes, a private Redis; about a minute."""

from __future__ import annotations

import pytest

from pdgate.loadtest.lib.log import to_stderr
from pdgate.loadtest.upgrade.report import by_phase
from pdgate.loadtest.upgrade.run import UpgradePlan, run_upgrade
from tests.loadtest._procs import marked, needs_redis

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


async def test_rolling_upgrade_of_every_shim_and_gateway_fails_no_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    needs_redis()
    # Streams of 192-384 tokens (~2-5 s); the gateways' preStop grace outlasts the longest.
    plan = UpgradePlan(
        prefills=2, decodes=2, gateways=2, users=12, max_tokens=384, steady_s=6.0,
        settle_s=1.0, after_s=3.0, gateway_prestop_s=7.0, drain_timeout_s=30.0,
    )  # fmt: skip
    with marked(monkeypatch):
        result = await run_upgrade(plan, to_stderr)
    phases = by_phase(result)
    print({name: {k: v for k, v in s.items()} for name, s in phases.items()})
    failures = [(r.why(), r.issued_s, r.ended_s, r.gateway) for r in result.records if r.failed]
    # Every server was replaced, each old one stopped by itself (drained, not killed).
    assert [r.role for r in result.restarts] == ["prefill"] * 2 + ["decode"] * 2 + ["gateway"] * 2
    assert all(r.exit_code == 0 and r.old != r.new for r in result.restarts), result.restarts
    # Load was flowing through every restart: requests open across each one's window.
    for r in result.restarts:
        overlapping = [
            x for x in result.records if x.issued_s < r.ready_s and x.ended_s > r.begin_s
        ]
        assert len(overlapping) >= plan.users // 2, (r, len(overlapping))
    # Decodes had streams to finish: their drain waited for them.
    assert all(r.drain_s > 0.5 for r in result.restarts if r.role == "decode")
    # The assertion of the issue: no client request failed while shims were replaced ...
    assert phases["prefill"]["failed"] == 0 and phases["decode"]["failed"] == 0, failures
    # ... nor while gateways were (with the layout's preStop grace: none held a request at
    # SIGTERM).
    assert phases["gateway"]["failed"] == 0, failures
    assert all(r.open_at_signal == 0 for r in result.restarts if r.role == "gateway")
    assert not failures and result.cancelled == 0
    assert len(result.records) > 3 * plan.users
