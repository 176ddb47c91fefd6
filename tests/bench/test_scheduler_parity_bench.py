"""bench/scheduler_parity.py, small: a BENCH line with the agreement, and exit 0 only when every
case agreed (it exits 1 on any disagreement, so a long run can gate a change)."""

from __future__ import annotations

import pytest

from bench_scripts import load  # tests/bench/bench_scripts.py

pytestmark = pytest.mark.integration


def test_a_short_run_prints_its_bench_line_and_agrees(capsys, tmp_path):
    bench = load("scheduler_parity")
    code = bench.main(["--cases", "200", "--seed", "3", "--examples", str(tmp_path / "examples.json")])
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("BENCH name=scheduler_parity"))
    fields = dict(item.split("=", 1) for item in line.split()[1:])
    assert fields["cases"] == "200" and fields["agreement"] == "100.00" and code == 0
    assert int(fields["none_feasible"]) > 0 and int(fields["reasons_seen"]) >= 10
