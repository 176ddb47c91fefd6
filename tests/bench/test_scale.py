"""bench/scale.py's pure part: the claim mix, the processes' figures, and the check of answers."""

from __future__ import annotations

import pytest

from draplane.api.resource import AllocationResult, DeviceAllocationResult, DeviceRequestAllocationResult
from draplane.scheduling.messages import ClaimPlacement, ClaimRef, Placement, PodRef, Unschedulable

from bench_scripts import load  # tests/bench/bench_scripts.py

bench = load("scale")

MIX = ((1, 70.0), (2, 15.0), (4, 10.0), (8, 5.0))


def test_parse_mix_reads_sizes_and_shares_and_refuses_the_rest():
    assert bench.parse_mix("1:70,2:15,4:10,8:5") == MIX
    for bad in ("1", "1:x", "0:10", "1:0", "1:10,1:20"):
        with pytest.raises(ValueError, match="--mix"):
            bench.parse_mix(bad)


def test_deal_shares_out_every_pod_by_largest_remainder():
    assert bench.deal(100, MIX) == {1: 70, 2: 15, 4: 10, 8: 5}
    dealt = bench.deal(7, MIX)
    assert sum(dealt.values()) == 7 and dealt[1] == 5  # 4.9 -> 5, then 1.05 -> 1, 0.7 -> 1, 0.35 -> 0
    assert dealt == {1: 5, 2: 1, 4: 1, 8: 0}


def test_claim_plan_at_the_issue_size_fills_to_the_budget_and_the_rest_are_monitors():
    plan = bench.claim_plan(50_000, 40_000, MIX, 0.9, seed=42)
    assert len(plan) == 50_000
    gpu_pods = [s for s in plan if s != bench.MONITOR]
    assert len(gpu_pods) == 20_000 and sum(gpu_pods) == 36_000  # 1.8 GPUs a pod, 90 % of 40,000
    assert plan.count(bench.MONITOR) == 30_000
    assert {s: gpu_pods.count(s) for s in (1, 2, 4, 8)} == {1: 14_000, 2: 3_000, 4: 2_000, 8: 1_000}
    # shuffled: the 8-GPU pods come throughout, not all at the end
    assert 0 < plan.index(8) < 1_000 and plan[-1_000:].count(8) > 0
    assert plan == bench.claim_plan(50_000, 40_000, MIX, 0.9, seed=42)


def test_claim_plan_that_fits_whole_has_no_monitors():
    plan = bench.claim_plan(1_000, 40_000, MIX, 0.9, seed=1)
    assert plan.count(bench.MONITOR) == 0 and sum(plan) == 1_800


def test_claim_plan_never_asks_more_than_the_budget():
    for pods, gpus in ((2_000, 1_600), (37, 64), (5, 8), (1, 1)):
        plan = bench.claim_plan(pods, gpus, MIX, 0.9, seed=3)
        assert len(plan) == pods and sum(plan) <= int(gpus * 0.9)


def test_metric_total_sums_every_label_of_the_counter():
    text = """\
# HELP draplane_allocator_reservation_conflicts_total Reservations that lost
# TYPE draplane_allocator_reservation_conflicts_total counter
draplane_allocator_reservation_conflicts_total{kind="compare_and_set",shard="0"} 3.0
draplane_allocator_reservation_conflicts_total{kind="stale_view",shard="0"} 2.0
draplane_allocator_reservation_conflicts_created{kind="stale_view",shard="0"} 1.7e9
draplane_allocator_placements_total{shard="0"} 50.0
"""
    assert bench.metric_total(text, "draplane_allocator_reservation_conflicts") == 5.0
    assert bench.metric_total(text, "draplane_allocator_placements") == 50.0
    assert bench.metric_total(text, "draplane_allocator_missing") == 0.0


def test_status_kib_reads_a_proc_status_field():
    status = "Name:\tpython\nVmHWM:\t  312456 kB\nVmRSS:\t  200000 kB\n"
    assert bench.status_kib(status, "VmHWM") == 312456
    assert bench.status_kib(status, "VmRSS") == 200000
    assert bench.status_kib("", "VmHWM") == 0


def _placement(pod: str, claim: str, node: str, device: str, *, admin: bool = False) -> Placement:
    result = DeviceRequestAllocationResult(request="gpu", driver="gpu.nvidia.com", pool=node, device=device,
                                           admin_access=True if admin else None)
    allocation = AllocationResult(devices=DeviceAllocationResult(results=[result]))
    return Placement(pod=PodRef(namespace="scale", name=pod, uid=pod), node=node, shard=0, first_seen=0.0,
                     expires_at=0.0, claims=[ClaimPlacement(claim=ClaimRef(namespace="scale", name=claim, uid=claim),
                                                            allocation=allocation)])


def test_answers_count_pods_once_and_find_a_device_given_twice():
    answers = bench.Answers()
    answers.take(_placement("p1", "c1", "n1", "gpu-0"), 10.0)
    answers.take(_placement("p1", "c1", "n1", "gpu-0"), 11.0)  # a redelivery: the same claim, no double
    answers.take(_placement("p2", "c2", "n1", "gpu-1"), 12.0)
    answers.take(_placement("p3", "c3", "n1", "gpu-1", admin=True), 13.0)  # adminAccess takes nothing
    answers.take(Unschedulable(pod=PodRef(namespace="scale", name="p4", uid="p4"), shard=0, message="no"), 14.0)
    assert answers.answered == 4 and len(answers.placed) == 3 and answers.unschedulable == {"p4"}
    assert answers.repeated == 1 and not answers.double_allocated
    assert answers.window_s == 4.0
    answers.take(_placement("p5", "c5", "n1", "gpu-0"), 15.0)
    assert answers.double_allocated == {("gpu.nvidia.com", "n1", "gpu-0")}


def test_bench_line_formats_figures():
    line = bench.bench_line("scale_shards", shards=2, placements_per_s=1234.56, conflicts_per_placement=0.0123,
                            stopped_because="none")
    assert line == ("BENCH name=scale_shards shards=2 placements_per_s=1234.6 conflicts_per_placement=0.012 "
                    "stopped_because=none")
