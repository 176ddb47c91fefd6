"""bench/e2e.py's pure part: what the setups' CPU figures add up."""

from __future__ import annotations

import pytest

from bench_scripts import load  # tests/bench/bench_scripts.py

bench = load("e2e")


def test_the_follower_shard_is_measured_but_not_counted_in_the_systems_cpu():
    cpu = {"kube-apiserver": 7.0, "shard-0": 0.8, "binder": 3.0, "follower": 0.4}
    assert bench.system_cpu(cpu) == pytest.approx(10.8)
    run = {"cpu_ms": cpu, "idle": {"cpu_ms": {"kube-apiserver": 20.0, "shard-0": 2.0, "follower": 2.0, "binder": 4.0},
                                   "writes": {}},
           "window_s": 10.0, "measured": 1000}
    # idle: 26 ms/s without the follower, over 10 s and 1,000 pods is 0.26 ms per pod
    assert bench.net_cpu_ms_per_pod(run) == pytest.approx(10.8 - 0.26)
    lines = bench.setup_lines("e2e_setups_3x1", "previous", "1", 1, {**run, "pods_per_s": 1.0, "p50_ms": 1, "p99_ms": 2,
                                                                     "writes": {}, "conflicts": 0.0})
    assert "cpu_ms_per_pod=10.80 " in lines[0]
    assert "follower=0.40" in lines[1]  # reported beside the others
