"""bench/shards_before_after.py's pure part: e2e.py's BENCH lines to figures, medians and ratios."""

from __future__ import annotations

import math

import pytest

from bench_scripts import load  # tests/bench/bench_scripts.py

bench = load("shards_before_after")

# what `e2e.py --only-setups --setups previous --setup-shards 2 --setup-rounds 1` prints, cut short
E2E_OUTPUT = """\
BENCH name=e2e_setups_300x20 setup=previous round=1 shards=2 pods_per_s=81.3 p50_ms=140 p99_ms=412 window_s=2.6 cpu_ms_per_pod=30.10 writes_per_pod=4.01 pod_writes_per_pod=4.01 conflicts_per_pod=0.000
BENCH name=e2e_setups_300x20_cpu setup=previous round=1 etcd=1.50 kube-apiserver=9.25 nats=0.80 shard-0=3.00 shard-1=2.50 binder=4.10 bench=8.95
BENCH name=e2e_setups_300x20_writes setup=previous round=1 create.pods=1.000 create.resourceclaims=1.000
BENCH name=e2e_setups_300x20 setup=previous round=median shards=2 pods_per_s=81.3 p50_ms=140 p99_ms=412 window_s=2.6 cpu_ms_per_pod=30.10 writes_per_pod=4.01 pod_writes_per_pod=4.01 conflicts_per_pod=0.000
BENCH name=e2e_setups_300x20_cpu setup=previous round=median etcd=9.00 kube-apiserver=99.0 nats=9.0 shard-0=99.0 shard-1=99.0 binder=99.0 bench=9.0

e2e_setups_300x20: medians over 1 round(s), 2 shard(s)
                                        previous
pods/s                                      81.3
"""


def test_bench_fields_reads_a_bench_line_and_nothing_else():
    assert bench.bench_fields("BENCH name=x round=1 kube-apiserver=9.25") == {
        "name": "x", "round": "1", "kube-apiserver": "9.25"}
    assert bench.bench_fields("pods/s    81.3") == {}


def test_run_figures_sums_the_shards_and_reads_round_one():
    figures = bench.run_figures(E2E_OUTPUT, shards=2)
    assert figures["pods_per_s"] == 81.3
    assert figures["p99_ms"] == 412
    assert figures["shard_cpu_ms_per_pod"] == pytest.approx(5.5)  # shard-0 + shard-1, not the median line's
    assert figures["apiserver_cpu_ms_per_pod"] == 9.25
    assert figures["binder_cpu_ms_per_pod"] == 4.10
    assert figures["nats_cpu_ms_per_pod"] == 0.80
    assert figures["cpu_ms_per_pod"] == 30.10


def test_run_figures_reads_the_follower_apart_from_the_shards():
    assert math.isnan(bench.run_figures(E2E_OUTPUT, shards=2)["follow_ms"])  # run without --follower
    figures = bench.run_figures(E2E_OUTPUT.replace(" binder=4.10", " follower=0.31 binder=4.10", 1), shards=2)
    assert figures["follow_ms"] == 0.31
    assert figures["shard_cpu_ms_per_pod"] == pytest.approx(5.5)  # the follower is no placing shard


def test_run_figures_refuses_a_shard_count_it_cannot_account_for():
    with pytest.raises(ValueError, match="not 4"):
        bench.run_figures(E2E_OUTPUT, shards=4)
    one_shard_missing = E2E_OUTPUT.replace(" shard-1=2.50", "")
    with pytest.raises(ValueError, match="1 shard component"):
        bench.run_figures(one_shard_missing, shards=2)
    with pytest.raises(ValueError, match="no round-1"):
        bench.run_figures("Traceback (most recent call last):\n", shards=1)


def _figures(pods_per_s: float, shard_cpu: float, apiserver_cpu: float) -> dict[str, float]:
    return {"pods_per_s": pods_per_s, "p99_ms": 100.0, "shard_cpu_ms_per_pod": shard_cpu,
            "apiserver_cpu_ms_per_pod": apiserver_cpu, "binder_cpu_ms_per_pod": 1.0, "nats_cpu_ms_per_pod": 1.0,
            "cpu_ms_per_pod": 20.0, "follow_ms": 0.2}


def test_median_figures_takes_each_figure_apart():
    runs = [_figures(100, 3, 9), _figures(120, 5, 7), _figures(80, 4, 8)]
    medians = bench.median_figures(runs)
    assert (medians["pods_per_s"], medians["shard_cpu_ms_per_pod"], medians["apiserver_cpu_ms_per_pod"]) == (100, 4, 8)


def test_ratios_are_over_the_smallest_shard_count():
    medians = {1: _figures(100, 4, 10), 2: _figures(150, 4.4, 10), 4: _figures(180, 6, 12)}
    ratios = bench.ratios(medians)
    assert ratios == pytest.approx({
        "shard_cpu_2_over_1": 1.1, "shard_cpu_4_over_1": 1.5,
        "pods_per_s_2_over_1": 1.5, "pods_per_s_4_over_1": 1.8,
        "apiserver_cpu_2_over_1": 1.0, "apiserver_cpu_4_over_1": 1.2,
    })
    line = bench.ratio_line("after", ratios)
    assert line.startswith("BENCH name=shards_before_after_ratios version=after ")
    assert "shard_cpu_4_over_1=1.50" in line
    assert math.isnan(bench.ratios({1: _figures(100, 0, 10), 2: _figures(100, 1, 10)})["shard_cpu_2_over_1"])


def test_versions_alternate_from_round_to_round():
    assert [bench.run_order(i) for i in range(3)] == [("before", "after"), ("after", "before"), ("before", "after")]


def test_run_line_has_the_issue_figures():
    fields = bench.bench_fields(bench.run_line("before", "1", 2, bench.run_figures(E2E_OUTPUT, 2)))
    assert fields["name"] == "shards_before_after"
    assert (fields["version"], fields["round"], fields["shards"]) == ("before", "1", "2")
    assert fields["shard_cpu_ms_per_pod"] == "5.50"
    assert fields["apiserver_cpu_ms_per_pod"] == "9.25"
    assert fields["binder_cpu_ms_per_pod"] == "4.10"
