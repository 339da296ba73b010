"""`pdgate bench summary`: the tables drawn from `pdgate bench scheduling` CSVs, run as a user
runs them, on small CSVs whose answers are known."""

from __future__ import annotations

import csv
import math
import subprocess
import sys
from pathlib import Path

import pytest

from pdgate.loadtest.summary.fleet_targets import for_the_mix, homogeneity_p


def _summary(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdgate.loadtest.bench", "summary", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _csv(path: Path, rows: list[dict[str, object]]) -> Path:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def _policy_row(mode: str, seed: int, hit: float, goodput: float, p99: float) -> dict[str, object]:
    return {"phase": "run", "multiple": "1", "mode": mode, "seed": seed,
            "prefix_hit_rate": hit, "goodput_rps": goodput, "ttft_p99_s": p99}  # fmt: skip


def test_policies_side_by_side_over_seeds_from_several_csvs(tmp_path: Path) -> None:
    first = _csv(tmp_path / "a.csv", [
        _policy_row("least_sse/g1", 0, 0.10, 18.5, 0.50),
        _policy_row("least_sse/g1", 1, 0.12, 18.7, 0.52),
        _policy_row("least_sse/g1", 2, 0.11, 18.6, 0.51),
        {**_policy_row("least_sse/g1", 0, 0.9, 1.0, 9.0), "phase": "calibrate"},  # not a run
    ])  # fmt: skip
    second = _csv(tmp_path / "b.csv", [_policy_row("precise_hold/g1", 0, 0.666, 19.6, 0.69)])
    done = _summary("policies", first, second)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "| load | series | seeds | prefix hit % | goodput/s | TTFT p99 s |",
        "|---|---|---|---|---|---|",
        "| 1 | least_sse/g1 | 3 | 10.0 / 11.0 / 12.0 | 18.50 / 18.60 / 18.70 | "
        "0.50 / 0.51 / 0.52 |",
        "| 1 | precise_hold/g1 | 1 | 66.6 / 66.6 / 66.6 | 19.60 / 19.60 / 19.60 | "
        "0.69 / 0.69 / 0.69 |",
    ]  # fmt: skip


def _fleet_row(mode: str, load: str, success: float, goodput: float,
               *gateways: tuple[int, float]) -> dict[str, object]:  # fmt: skip
    row: dict[str, object] = {"phase": "run", "multiple": load, "mode": mode, "seed": 0,
                              "success_rate": success, "goodput_rps": goodput}  # fmt: skip
    for i in range(2):
        n, ok = gateways[i] if i < len(gateways) else ("", "")
        row[f"requests_gateway{i}"], row[f"success_gateway{i}"] = n, ok
    return row


def test_fleet_targets_met_and_missed(tmp_path: Path) -> None:
    path = _csv(tmp_path / "fleet.csv", [
        _fleet_row("least_sse/s1/g1", "2", 1.0, 10.0, (100, 1.0)),
        _fleet_row("least_sse/s1/g2", "2", 0.99, 9.9, (50, 0.99), (50, 0.99)),
        _fleet_row("least_sse/s4/g1", "2", 0.98, 10.0, (100, 0.98)),
        # 4 points under one gateway, and its two gateways 10 points apart:
        _fleet_row("least_sse/s4/g2", "2", 0.94, 10.0, (100, 0.99), (100, 0.89)),
    ])  # fmt: skip
    done = _summary("fleet-targets", path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[2] == "| 1 | 1 | 2A | 100.0 / 100.0 / 100.0% | +0.0 pt | 10.00 | +0.0% | 0.0 pt |"
    assert lines[3] == "| 1 | 2 | 2A | 99.0 / 99.0 / 99.0% | -1.0 pt | 9.90 | -1.0% | 0.0 pt |"
    assert lines[4] == "| 4 | 1 | 2A | 98.0 / 98.0 / 98.0% | +0.0 pt | 10.00 | +0.0% | 0.0 pt |"
    p = homogeneity_p({"requests_gateway0": "100", "success_gateway0": "0.99",
                       "requests_gateway1": "100", "success_gateway1": "0.89"})  # fmt: skip
    assert p is not None
    assert [line for line in lines if line.startswith("- ")] == [
        "- missed: one gateway, 4 slots, 2A: -2.0 pt against 1 slot",
        "- missed: 4 slots, 2 gateways, 2A: -4.0 pt, +0.0% goodput against one gateway",
        f"- missed: 4 slots, 2 gateways, 2A: gateways 10.0 pt apart (seed 0: p = {p:.3f})",
    ]


def test_a_fleet_within_its_targets(tmp_path: Path) -> None:
    path = _csv(tmp_path / "fleet.csv", [
        _fleet_row("least_sse/s1/g1", "1", 1.0, 10.0, (100, 1.0)),
        _fleet_row("least_sse/s1/g2", "1", 0.99, 9.8, (50, 1.0), (50, 0.98)),
    ])  # fmt: skip
    done = _summary("fleet-targets", path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("\n\n- every target met\n")


def test_a_run_of_one_slot_count_names_its_slots_on_the_command_line(tmp_path: Path) -> None:
    """`--prefill-slots 4` alone names its series MODE/gN: the slots come from `--slots`."""
    path = _csv(tmp_path / "fleet.csv", [
        _fleet_row("least_sse/g1", "6", 0.98, 20.0, (100, 0.98)),
        _fleet_row("least_sse/g4", "6", 0.99, 20.0, (50, 0.99), (50, 0.99)),
    ])  # fmt: skip
    done = _summary("fleet-targets", path)
    assert done.returncode == 2 and "names no slots: give them (--slots K)" in done.stderr
    done = _summary("fleet-targets", path, "--slots", "4")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[2] == "| 4 | 1 | 6A | 98.0 / 98.0 / 98.0% | +0.0 pt | 20.00 | +0.0% | 0.0 pt |"
    assert lines[3] == "| 4 | 4 | 6A | 99.0 / 99.0 / 99.0% | +1.0 pt | 20.00 | +0.0% | 0.0 pt |"
    assert done.stdout.endswith("\n\n- every target met\n")


def test_homogeneity_is_the_chi_square_test_of_the_gateways_counts() -> None:
    # 2x2 table (99, 1) and (89, 11): chi-square 8.865 with one degree of freedom.
    row = {"requests_gateway0": "100", "success_gateway0": "0.99",
           "requests_gateway1": "100", "success_gateway1": "0.89"}  # fmt: skip
    oks, fails, n = 188, 12, 200
    stat = sum(
        (seen - total * column / n) ** 2 / (total * column / n)
        for seen, total, column in
        ((99, 100, oks), (1, 100, fails), (89, 100, oks), (11, 100, fails))
    )  # fmt: skip
    assert homogeneity_p(row) == pytest.approx(math.erfc(math.sqrt(stat / 2)))
    assert homogeneity_p({"requests_gateway0": "100", "success_gateway0": "1"}) is None
    assert homogeneity_p({**row, "success_gateway0": "1", "success_gateway1": "1"}) == 1.0


def test_a_spread_the_scenario_mix_explains(tmp_path: Path) -> None:
    """Two gateways 6 points apart, each exactly at what its users' scenario draw predicts:
    the raw spread is a miss, the spread for the mix is none; the failures' ends are
    summed per run."""
    mixed = {"mix_gateway0": 0.97, "mix_gateway1": 0.91, "refused_gateway0": 2,
             "refused_gateway1": 5, "late_gateway0": 1, "late_gateway1": 4}  # fmt: skip
    path = _csv(tmp_path / "fleet.csv", [
        {**_fleet_row("least_sse/s4/g1", "6", 0.94, 10.0, (200, 0.94)),
         **dict.fromkeys(mixed, "")},
        {**_fleet_row("least_sse/s4/g2", "6", 0.94, 10.0, (100, 0.97), (100, 0.91)), **mixed},
    ])  # fmt: skip
    done = _summary("fleet-targets", path)
    assert done.returncode == 0, done.stderr
    raw = homogeneity_p({"requests_gateway0": "100", "success_gateway0": "0.97",
                         "requests_gateway1": "100", "success_gateway1": "0.91"})  # fmt: skip
    assert raw is not None
    assert f"| 4 | 2 | 6A | 0 | 6.0 pt | {raw:.2f} | 0.0 pt | 1.00 | 7 / 5 |" in done.stdout
    assert "gateways 6.0 pt apart" in done.stdout  # the target is on the raw success


def test_for_the_mix_tests_each_gateway_against_its_prediction() -> None:
    row = {
        "requests_gateway0": "100",
        "success_gateway0": "0.99",
        "mix_gateway0": "0.95",
        "requests_gateway1": "100",
        "success_gateway1": "0.91",
        "mix_gateway1": "0.95",
    }
    spread, p = for_the_mix(row) or (math.nan, math.nan)
    assert spread == pytest.approx(8.0)
    stat = 2 * (4.0**2) / (100 * 0.95 * 0.05)  # (99 - 95)^2 and (91 - 95)^2 over 4.75
    assert p == pytest.approx(math.erfc(math.sqrt(stat / 2)))
    assert for_the_mix({"requests_gateway0": "1", "success_gateway0": "1"}) is None


@pytest.mark.parametrize(
    ("series", "said"),
    [("least_sse/s4", "is not MODE/sK/gN"), ("least_sse/s4/g4", "no one-gateway series")],
)
def test_fleet_targets_says_what_its_csv_lacks(tmp_path: Path, series: str, said: str) -> None:
    """A run of four gateways alone, or with no slots in its series' names, has nothing to
    compare with: said plainly, not as a traceback."""
    path = _csv(tmp_path / "a.csv", [_fleet_row(series, "6", 0.99, 20.0, (100, 0.99))])
    done = _summary("fleet-targets", path)
    assert done.returncode != 0
    assert said in done.stderr
    assert "Traceback" not in done.stderr


def test_fleet_targets_takes_one_csv(tmp_path: Path) -> None:
    path = _csv(tmp_path / "a.csv", [_fleet_row("least_sse/s1/g1", "1", 1.0, 1.0)])
    done = _summary("fleet-targets", path, path)
    assert done.returncode == 2
    assert "one CSV" in done.stderr
