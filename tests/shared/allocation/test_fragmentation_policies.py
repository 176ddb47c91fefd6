import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from draplane.allocation.fragmentation import (
    MIB,
    BestFit,
    FirstFit,
    FirstNode,
    FragmentationAwareDraplane,
    FragmentationGradientDescent,
    NodeState,
    PodShape,
    expected_fragmentation,
    fits,
    packing_waste_table,
    typical_shapes,
)
from draplane.simulation.engine import Replay, build_arrays

WORKLOAD = [
    PodShape(4000, 8192, 1, 1000), PodShape(4000, 8192, 1, 1000), PodShape(2000, 4096, 1, 500),
    PodShape(2000, 4096, 1, 500), PodShape(6000, 16384, 1, 300), PodShape(8000, 16384, 2, 1000),
    PodShape(16000, 32768, 0, 0), PodShape(1000, 2048, 1, 700),
]


def draplane_that_saw(shapes) -> FragmentationAwareDraplane:
    """The shipped policy after being asked to place these pods (it learns online)."""
    policy = FragmentationAwareDraplane()
    for s in shapes:
        policy.observe_requests(s.cpu_milli, s.memory_mib * MIB, s.gpu_demand)
    return policy


def policies():
    return [
        FirstFit(), FirstNode(), BestFit(),
        FragmentationGradientDescent(typical_shapes(WORKLOAD)),
        draplane_that_saw(WORKLOAD),
    ]


gpu_free = st.sampled_from([0, 100, 200, 300, 500, 700, 1000])
states = st.builds(
    lambda cpu, mem, gpus, model: NodeState(model, cpu, mem, tuple(gpus)),
    st.integers(0, 32000), st.integers(0, 65536), st.lists(gpu_free, min_size=0, max_size=8), st.sampled_from(["T4", "G2"]),
)
shapes = st.builds(
    PodShape,
    st.integers(0, 16000), st.integers(0, 32768), st.sampled_from([0, 1, 2, 4, 8]), st.sampled_from([0, 200, 300, 500, 1000]),
    st.sampled_from([(), ("T4",), ("G2", "T4")]),
).filter(lambda s: (s.num_gpu == 0) == (s.gpu_milli == 0) and (s.num_gpu <= 1 or s.gpu_milli == 1000))


@settings(max_examples=150, deadline=None)
@given(states, shapes)
def test_scoring_never_changes_feasibility_on_a_node(state, shape):
    """Every policy places the pod exactly when it fits, on GPUs that have room for it."""
    feasible = fits(state, shape)
    for policy in policies():
        placement = policy.place(state, shape)
        assert (placement is not None) == feasible, policy.name
        if placement is None:
            continue
        assert len(placement.gpus) == shape.num_gpu and len(set(placement.gpus)) == shape.num_gpu
        assert all(state.gpus[i] >= shape.gpu_milli for i in placement.gpus), policy.name


def test_engine_candidates_are_the_same_for_every_policy():
    rng = random.Random(7)
    names = [f"n{i}" for i in range(30)]
    models = [rng.choice(["T4", "G2"]) for _ in names]
    cpu = [rng.choice([8000, 32000, 96000]) for _ in names]
    mem = [rng.choice([16384, 65536]) for _ in names]
    counts = [rng.choice([1, 2, 4, 8]) for _ in names]
    replays = [Replay(build_arrays(names, models, cpu, mem, counts), p) for p in policies()]
    for _ in range(200):
        shape = rng.choice(WORKLOAD)
        sets = [set(r._candidates(shape).tolist()) for r in replays]
        # Same history is not kept across policies, so compare each against its own node states.
        for replay, candidates in zip(replays, sets):
            expected = {i for i in range(len(names)) if fits(replay.state(i), shape)}
            assert candidates == expected
        for replay in replays:
            replay.offer(shape)


@pytest.mark.parametrize("policy_name", ["fgd", "best-fit"])
def test_cached_vectorised_choice_equals_scoring_every_node(policy_name):
    """The simulator's shortcut (shared scores per equivalent state, array maths) picks the node and
    GPUs that scoring every node one by one with `place` picks. (draplane, which learns while it
    places, is checked against the shard's own core in tests/shared/simulation/test_shipped_policy.py.)"""
    from draplane.simulation.experiment import make_policy

    rng = random.Random(11)
    names = [f"n{i}" for i in range(40)]
    models = [rng.choice(["T4", "G2"]) for _ in names]
    cpu = [rng.choice([16000, 32000, 96000]) for _ in names]
    mem = [rng.choice([32768, 131072]) for _ in names]
    counts = [rng.choice([1, 2, 4, 8]) for _ in names]
    arrivals = [rng.choice(WORKLOAD) for _ in range(300)]
    policy, cpu_thr, mem_thr = make_policy(policy_name, arrivals)
    replay = Replay(build_arrays(names, models, cpu, mem, counts), policy, cpu_thresholds=cpu_thr, memory_thresholds=mem_thr)
    for shape in arrivals:
        best = None
        for i in range(len(names)):
            placement = policy.place(replay.state(i), shape)
            if placement is not None and (best is None or placement.score > best[0]):
                best = (placement.score, i, placement.gpus)
        outcome = replay.offer(shape)
        if best is None:
            assert outcome.node is None
            continue
        assert outcome.node == best[1]
        # Equal GPUs are interchangeable: compare what the choice leaves, not the index.
        assert sorted(replay.state(best[1]).gpus) == sorted(
            [f - (shape.gpu_milli if j in best[2] else 0) for j, f in enumerate(
                [g + (shape.gpu_milli if j in outcome.gpus else 0) for j, g in enumerate(replay.state(best[1]).gpus)])]
        )


def run_small_cluster(policy):
    # Two identical nodes with two GPUs each. Two half-GPU pods arrive, then two 2-GPU pods.
    names, models = ["a", "b"], ["T4", "T4"]
    replay = Replay(build_arrays(names, models, [32000, 32000], [65536, 65536], [2, 2]), policy)
    half = PodShape(1000, 1024, 1, 500)
    pair = PodShape(1000, 1024, 2, 1000)
    return [replay.offer(s) for s in (half, half, pair, pair)], replay


def test_draplane_avoids_the_fragmentation_first_fit_causes():
    kube, kube_replay = run_small_cluster(FirstFit())
    # kube-scheduler's LeastAllocated spreads the halves, one per node: each node has a broken GPU,
    # and neither 2-GPU pod fits anywhere.
    assert [o.node for o in kube] == [0, 1, None, None]
    assert sorted(kube_replay.state(0).gpus) == [500, 1000] == sorted(kube_replay.state(1).gpus)

    ours, ours_replay = run_small_cluster(FragmentationAwareDraplane())  # learns as the pods come
    # draplane stacks both halves on one GPU, which keeps node b whole for a 2-GPU pod.
    assert [o.node for o in ours[:2]] == [0, 0] and ours[0].gpus == ours[1].gpus
    assert ours[2].node == 1 and ours[3].node is None
    assert sum(ours_replay.a.gpu_total) == 1000 < sum(kube_replay.a.gpu_total) == 3000


def test_draplane_sends_cpu_heavy_pods_to_cpu_rich_nodes():
    policy = draplane_that_saw([PodShape(12000, 1024, 1, 1000)] * 8)
    # Node 0 has exactly the CPU its GPUs need; node 1 has four times that. A CPU-only pod on node 0
    # would strand a GPU there, on node 1 it strands nothing.
    replay = Replay(build_arrays(["lean", "rich"], ["G2", "T4"], [24000, 96000], [65536, 65536], [2, 2]), policy)
    assert replay.offer(PodShape(12000, 1024, 0, 0)).node == 1


def test_packing_waste_table():
    waste = packing_waste_table([300, 500])
    assert waste[1000] == 0 and waste[800] == 0 and waste[600] == 0
    assert waste[299] == 299 and waste[350] == 50 and waste[1] == 1 and waste[0] == 0


def test_filler_sizes_leave_out_rare_and_scarce_sizes():
    from draplane.allocation.fragmentation import filler_sizes

    # 160s are common but ten times rarer than the 810s whose 190-milli slivers they would fill;
    # 470s pair among themselves (no large share leaves room for them); 50s are rare.
    frequency = {810: 0.30, 470: 0.20, 320: 0.10, 650: 0.10, 160: 0.03, 50: 0.005, 1000: 0.2}
    assert filler_sizes(frequency, 0.01) == [320, 470, 650, 810, 1000]
    # Enough 160s for a quarter of the slivers: counted.
    assert 160 in filler_sizes({**frequency, 160: 0.1}, 0.01)


def test_fgd_fragmentation_measure():
    profile = typical_shapes([PodShape(1000, 0, 1, 500), PodShape(1000, 0, 1, 1000)])
    # A 300-milli remainder is lost to both shapes; an empty node loses nothing.
    assert expected_fragmentation(NodeState("T4", 8000, 0, (300, 1000)), profile) == 300
    assert expected_fragmentation(NodeState("T4", 8000, 0, (1000, 1000)), profile) == 0
    # Without CPU every free GPU is a fragment.
    assert expected_fragmentation(NodeState("T4", 500, 0, (1000, 1000)), profile) == 2000


def test_service_policy_keeps_remainders_fillable():
    """The core's `draplane` (registered from fragmentation.py) puts a share where the remainder
    can still be filled by the sizes it has seen; Kubernetes' order takes the first device."""
    from draplane.allocation import DeviceAllocator
    from draplane.allocation.allocator import NodePlacement
    from draplane.allocation.fragmentation import FragmentationAwareDraplane
    from draplane.allocation.scoring import get_policy
    from draplane.api.meta import ObjectMeta
    from draplane.api.resource import (
        AllocationResult, DeviceAllocationResult, DeviceRequestAllocationResult, ResourceClaim, ResourceClaimStatus,
    )
    from draplane.simulation.trace import TraceNode, TracePod, gpu_device_class, node_objects, pod_objects

    assert isinstance(get_policy("draplane"), FragmentationAwareDraplane)
    node, slice_ = node_objects(TraceNode("n", 32000, 65536, 2, "T4"))

    def held(name, device, milli):
        result = DeviceRequestAllocationResult(
            request="gpu", driver="gpu.nvidia.com", pool="n", device=device,
            share_id=f"00000000-0000-4000-8000-00000000000{len(name)}", consumed_capacity={"compute": str(milli)},
        )
        return ResourceClaim(
            metadata=ObjectMeta(name=name, namespace="t"),
            status=ResourceClaimStatus(allocation=AllocationResult(devices=DeviceAllocationResult(results=[result]))),
        )

    policy = FragmentationAwareDraplane()
    for size in (130, 470):
        policy.observe_requests(1000, 1 << 30, size)
    outcomes = {}
    for name, chosen_policy in (("first-fit", None), ("draplane", policy)):
        cluster = DeviceAllocator(slices=[slice_], classes=[gpu_device_class()], nodes=[node], policy=chosen_policy or "first-fit")
        cluster.add_allocated_claim(held("a", "gpu-0", 500))  # 500 free: a 470 leaves 30, lost
        cluster.add_allocated_claim(held("bb", "gpu-1", 400))  # 600 free: a 470 leaves 130, fillable
        _, claim = pod_objects(TracePod("p", 1000, 1024, 1, 470))
        placement = cluster.allocate_on_node([claim], "n")
        assert isinstance(placement, NodePlacement)
        outcomes[name] = placement.allocations[0].devices.results[0].device
    assert outcomes == {"first-fit": "gpu-0", "draplane": "gpu-1"}


def test_replay_through_the_allocator_core_matches_the_engine():
    """Every placement confirmed by the core (node fit + NodeAllocator + AllocatedState) is the one
    the engine proposed, so the core never overrules and the numbers are the core's."""
    from pathlib import Path

    from draplane.simulation.experiment import run_one
    from draplane.simulation.trace import read_nodes, read_pods

    data = Path(__file__).resolve().parents[1] / "simulation" / "data"  # a slice of the trace
    nodes = read_nodes(data / "nodes.csv")
    pods = read_pods(data / "pods.csv")
    for policy in ("first-fit", "fgd", "draplane"):
        with_core = run_one(nodes, pods, policy, 3, 1.3, through_core=True)
        assert with_core == run_one(nodes, pods, policy, 3, 1.3, through_core=False)
        assert with_core.failed > 0 and with_core.pods > with_core.failed


def test_online_workload_learns_only_what_it_was_shown():
    from draplane.allocation.fragmentation import OnlineWorkload

    workload = OnlineWorkload()
    assert workload.version == 0 and workload.waste[300] == 300  # nothing learned: nothing fills
    workload.observe(2000, 4 << 30, 300)
    assert workload.fillers == [300] and workload.waste[600] == 0 and workload.version == 1
    version = workload.version
    for _ in range(10):
        workload.observe(2000, 4 << 30, 300)  # the same size again: nothing new to fill with
    assert workload.version == version
    workload.observe(2000, 4 << 30, 2000)  # two whole GPUs: ratios only, no share size
    assert 2000 not in workload.sizes and workload.device_milli == 11 * 300 + 2000
    workload.observe(2000, 4 << 30, 450)  # a new size is counted on at once
    assert 450 in workload.fillers and workload.version == version + 1


def test_stranded_is_the_same_one_node_at_a_time_or_many_at_once():
    from draplane.allocation.fragmentation import OnlineWorkload

    workload = OnlineWorkload()
    for cpu, memory, milli in ((4000, 16 << 30, 1000), (12000, 8 << 30, 500), (1000, 64 << 30, 2000)):
        workload.observe(cpu, memory, milli)
    rng = random.Random(5)
    free = np.array([rng.randrange(0, 8001) for _ in range(200)])
    cpu = np.array([rng.randrange(0, 96001) for _ in range(200)])
    memory = np.array([rng.randrange(0, 512 << 30) for _ in range(200)])
    many = workload.stranded_many(free, cpu, memory)
    assert [workload.stranded(int(f), int(c), int(m)) for f, c, m in zip(free, cpu, memory)] == many.tolist()
    assert workload.stranded(8000, 0, 0) == 8000 and workload.stranded(0, 96000, 1 << 40) == 0


def test_the_shipped_policy_scores_many_nodes_as_it_scores_one():
    """`node_resources_scores` (all feasible nodes at once, as the cluster asks at scale) gives the
    very numbers `node_resources_score` gives node by node, so ties fall alike."""
    import random

    import numpy as np

    from draplane.allocation.fragmentation import FragmentationAwareDraplane

    rng = random.Random(7)
    policy = FragmentationAwareDraplane()
    for _ in range(40):
        policy.observe_requests(rng.randrange(500, 16_000), rng.randrange(1, 64) << 30, rng.choice((250.0, 1000.0, 2000.0)))
    count = 500
    device_free = np.array([rng.choice((0.0, 250.5, 1000.0, 3999.5, 8000.0)) for _ in range(count)])
    taken = np.array([rng.choice((250.0, 1000.0, 2000.0)) for _ in range(count)])
    cpu_free = np.array([rng.randrange(0, 128_000) for _ in range(count)], dtype=np.int64)
    memory_free = np.array([rng.randrange(0, 1 << 40) for _ in range(count)], dtype=np.int64)
    requests = (4_000, 16 << 30)
    many = policy.node_resources_scores(device_free, taken, cpu_free, memory_free, requests)
    one_by_one = [policy.node_resources_score(float(d), float(t), (int(c), int(m)), requests)
                  for d, t, c, m in zip(device_free, taken, cpu_free, memory_free)]
    assert many.tolist() == one_by_one


def test_two_mig_slices_of_one_claim_share_one_empty_gpu_and_keep_the_next_whole():
    """An empty A100 node, one claim for two 3g.20gb slices: both on gpu-0 (starts 4 and 0), not the
    start-4 slot of gpu-0 and gpu-1, which split two GPUs. Three: the third opens gpu-1."""
    import msgspec

    from draplane.api.resource import DeviceClass
    from draplane.localenv.environment import standard_device_classes
    from draplane.simulation import scenario
    from draplane.scheduling.placing import SchedulingState, Placed
    from draplane.nodes.slices import NodeRef, plan_node
    from draplane.nodes.hardware import driver_devices
    from draplane.nodes.profile import load_profile, profile_hardware

    drivers = driver_devices(profile_hardware(load_profile("a100-mig"), "a100-0"))
    slices = [s for plan in plan_node(NodeRef("a100-0", "uid"), drivers, []) for s in plan.creates]
    for count, expected in ((2, ["gpu-0-mig-3g-20gb-4", "gpu-0-mig-3g-20gb-0"]),
                            (3, ["gpu-0-mig-3g-20gb-4", "gpu-0-mig-3g-20gb-0", "gpu-1-mig-3g-20gb-4"])):
        state = SchedulingState()  # the shipped policy
        for c in standard_device_classes():
            state.set_class(msgspec.convert(c, DeviceClass))
        state.set_node(scenario.gpu_node("a100-0"))
        state.set_feed_entry("node.a100-0", slices)
        claim = scenario.claim("ns", "mig", "mig.nvidia.com", count=count,
                               selector='device.attributes["gpu.nvidia.com"].profile == "3g.20gb"')
        claim.metadata.uid = "c"
        pod = scenario.pod("ns", "p", claim_name="mig")
        pod.metadata.uid = "p"
        placed = state.place_pod(pod, [claim])
        assert isinstance(placed, Placed)
        assert [r.device for r in placed.allocations["c"].devices.results] == expected
