import itertools
import random

import pytest

from draplane.simulation.bound import allocation_bound, dual_feasible, gpu_configurations
from draplane.simulation.experiment import POLICIES, run_one
from draplane.simulation.trace import TraceNode, TracePod
from draplane.simulation.workload import arrival_sequence


def test_dual_feasible_functions_never_exceed_one_gpu():
    sizes = [50, 110, 160, 190, 230, 250, 320, 333, 470, 500, 650, 810, 1000]
    for k in range(1, 13):
        for n in range(1, 6):
            for combo in itertools.combinations_with_replacement(sizes, n):
                if sum(combo) <= 1000:
                    assert sum(dual_feasible(k, z) for z in combo) <= 1 + 1e-12, (k, combo)
    cpu = [3152, 4000, 8000, 11908, 32000]
    for k in range(1, 13):
        for combo in itertools.combinations_with_replacement(cpu, 4):
            if sum(combo) <= 48000:
                assert sum(dual_feasible(k, c, 48000) for c in combo) <= 1 + 1e-12, (k, combo)


def test_two_large_shares_do_not_share_a_gpu():
    # 1200 milli of demand on 1000 milli: milli arithmetic allows 1000, but two 600s never fit together.
    nodes = [TraceNode("n", 32000, 65536, 1, "T4")]
    pods = [TracePod("a", 1000, 1024, 1, 600), TracePod("b", 1000, 1024, 1, 600)]
    assert allocation_bound(nodes, pods).allocatable_milli == pytest.approx(600)


def test_cpu_and_models_limit_what_fits():
    nodes = [TraceNode("n", 4000, 65536, 2, "T4")]
    # 6000 CPU asked of 4000: plain sums allow 1.33 pods; u_1 counts each pod above half as 1.
    cpu_heavy = [TracePod(f"c{i}", 3000, 1024, 1, 500) for i in range(2)]
    assert allocation_bound(nodes, cpu_heavy).allocatable_milli == pytest.approx(500)
    wrong_model = [TracePod("m", 1000, 1024, 1, 1000, ("A10",))]
    assert allocation_bound(nodes, wrong_model).allocatable_milli == pytest.approx(0)
    too_many_gpus = [TracePod("g", 1000, 1024, 4, 1000)]
    assert allocation_bound(nodes, too_many_gpus).allocatable_milli == pytest.approx(0)


def _best_packing(nodes: list[TraceNode], pods: list[TracePod]) -> int:
    """The exact optimum by trying every (node, GPU) or drop for every pod (one-GPU pods only)."""
    slots = [(n, g) for n, node in enumerate(nodes) for g in range(node.gpus)]
    best = 0
    for choice in itertools.product([None, *slots], repeat=len(pods)):
        cpu = [0] * len(nodes)
        memory = [0] * len(nodes)
        gpu: dict[tuple[int, int], int] = {}
        ok = True
        for pod, slot in zip(pods, choice):
            if slot is None:
                continue
            n, g = slot
            cpu[n] += pod.cpu_milli
            memory[n] += pod.memory_mib
            gpu[slot] = gpu.get(slot, 0) + pod.gpu_milli
            if cpu[n] > nodes[n].cpu_milli or memory[n] > nodes[n].memory_mib or gpu[slot] > 1000:
                ok = False
                break
        if ok:
            best = max(best, sum(p.gpu_milli for p, s in zip(pods, choice) if s is not None))
    return best


@pytest.mark.parametrize("seed", range(8))
def test_bound_is_above_the_exact_optimum_of_small_instances(seed):
    rng = random.Random(seed)
    nodes = [TraceNode(f"n{i}", rng.choice([4000, 8000]), rng.choice([8192, 16384]), 2, "T4") for i in range(2)]
    pods = [
        TracePod(f"p{i}", rng.choice([1000, 2000, 3000]), rng.choice([2048, 4096]), 1, rng.choice([230, 470, 650, 810, 1000]))
        for i in range(5)
    ]
    exact = _best_packing(nodes, pods)
    assert allocation_bound(nodes, pods).allocatable_milli >= exact - 1e-6


@pytest.mark.parametrize("seed", [1, 2])
def test_no_policy_beats_the_bound(seed):
    rng = random.Random(seed)
    nodes = [TraceNode(f"n{i}", 16000, 65536, rng.choice([1, 2, 4, 8]), "T4") for i in range(12)]
    pods = [
        TracePod(f"p{i:03d}", rng.choice([1000, 4000, 8000]), 4096, *rng.choice([(1, 230), (1, 470), (1, 810), (1, 1000), (2, 1000), (0, 0)]))
        for i in range(80)
    ]
    capacity = sum(n.gpus for n in nodes) * 1000
    bound = allocation_bound(nodes, arrival_sequence(pods, capacity, seed, 1.3))
    for policy in POLICIES:
        result = run_one(nodes, pods, policy, seed, 1.3, through_core=False)
        assert result.unallocated_pct >= bound.min_unallocated_pct - 1e-6, policy


def test_gpu_configurations_are_the_maximal_multisets_that_fit():
    configs = gpu_configurations([470, 550, 320])
    assert sorted(configs) == sorted([(470, 470), (550, 320), (470, 320), (320, 320, 320)])
    for config in configs:
        assert sum(config) <= 1000
        assert all(sum(config) + z > 1000 for z in (470, 550, 320))
    # Every multiset that fits lies inside one of them.
    for n in range(1, 4):
        for combo in itertools.combinations_with_replacement([470, 550, 320], n):
            if sum(combo) <= 1000:
                assert any(all(c.count(z) >= combo.count(z) for z in combo) for c in configs), combo
    assert gpu_configurations([]) == []
    assert gpu_configurations([10, 20, 30], limit=5) is None


def test_configurations_see_shares_that_milli_and_dual_feasible_functions_miss():
    # 470 + 550 + 550 on one GPU: any two exceed 1000, so at most 550 is allocated. Milli sums and
    # the dual feasible functions allow 928; GPU configurations ({550} or {470, 470}) allow 745.
    nodes = [TraceNode("n", 64000, 262144, 1, "T4")]
    pods = [TracePod(f"p{i}", 1000, 1024, 1, z) for i, z in enumerate((470, 550, 550))]
    assert allocation_bound(nodes, pods).allocatable_milli == pytest.approx(745)
    assert _best_packing(nodes, pods) == 550


@pytest.mark.parametrize("seed", range(8, 20))
def test_bound_with_shares_is_above_the_exact_optimum(seed):
    rng = random.Random(seed)
    nodes = [TraceNode(f"n{i}", rng.choice([4000, 8000]), 16384, rng.choice([1, 2]), "T4") for i in range(2)]
    pods = [
        TracePod(f"p{i}", rng.choice([1000, 2000]), 2048, 1, rng.choice([160, 230, 320, 470, 550, 650, 810]))
        for i in range(5)
    ]
    assert allocation_bound(nodes, pods).allocatable_milli >= _best_packing(nodes, pods) - 1e-6
