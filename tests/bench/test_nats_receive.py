"""bench/nats_receive.py on a real nats-server: every mode receives every message it was sent."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "nats_receive.py"


@pytest.mark.integration
def test_each_mode_counts_every_message_and_prints_its_cost():
    result = subprocess.run([sys.executable, str(SCRIPT), "--messages", "40", "--rates", "0", "400", "--sizes", "64"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("BENCH name=nats_receive ")]
    assert {re.search(r"mode=(\w+)", line).group(1) for line in lines} == {"watch", "ordered", "subscription"}
    assert len(lines) == 6
    for line in lines:
        assert "received=40 " in line, line
        assert float(re.search(r"cpu_us_per_message=([0-9.]+)", line).group(1)) > 0


def test_bad_arguments_are_refused_before_any_server_starts():
    result = subprocess.run([sys.executable, str(SCRIPT), "--messages", "0"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and "--messages" in result.stderr
