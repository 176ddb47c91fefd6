"""bench/volume_limits.py: both modes refuse the same (full) nodes and print their cost."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "volume_limits.py"


def test_both_modes_refuse_the_full_nodes_and_print_their_cost():
    result = subprocess.run([sys.executable, str(SCRIPT), "--nodes", "300", "--rounds", "1"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("BENCH name=volume_limits ")]
    assert [re.search(r"mode=(\w+)", line).group(1) for line in lines] == ["count_all", "bounded"]
    assert all(" refused=3" in line for line in lines), lines  # nodes 0, 100 and 200 are full


def test_bad_arguments_are_refused():
    result = subprocess.run([sys.executable, str(SCRIPT), "--nodes", "0"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--nodes" in result.stderr
