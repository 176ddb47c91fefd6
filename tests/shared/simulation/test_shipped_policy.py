"""`draplane simulate --policy draplane` measures the policy the allocator shards run.

The simulator replays the shipped `FragmentationAwareDraplane` on its array engine (node states, no
device search); the shard runs it through `SchedulingState.place_pod` (node fit, the allocator core's
search over ResourceSlices, the policy's device order and node scores). Both learn online from the
pods as they come. Here one arrival sequence goes through both, pod by pod, and every pod must land
on the same node and the same GPUs, or fail in both.

`data/` holds 30 GPU nodes and 320 pods of the Alibaba GPU trace (cluster-trace-gpu-v2023, Weng et
al., USENIX ATC 2023; shares and multi-GPU pods from its gpushare100 and multigpu20 lists), so the
test needs nothing outside the repo.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from draplane.allocation.fragmentation import FragmentationAwareDraplane
from draplane.allocation.scoring import get_policy
from draplane.api.resource import ResourceClaimStatus
from draplane.scheduling.placing import SchedulingState, Placed
from draplane.simulation.engine import Replay, build_arrays
from draplane.simulation.experiment import shape_of, tie_order
from draplane.simulation.trace import gpu_device_class, node_objects, pod_objects, read_nodes, read_pods
from draplane.simulation.workload import arrival_sequence

DATA = Path(__file__).parent / "data"


def arrivals_and_nodes(seed: int):
    nodes = read_nodes(DATA / "nodes.csv")
    capacity = sum(n.gpus for n in nodes) * 1000
    arrivals = arrival_sequence(read_pods(DATA / "pods.csv"), capacity, seed, 1.3)
    # The shard breaks ties by node name, the simulator by the seed's node order: name the nodes in
    # that order so that both break ties alike.
    ordered = [replace(nodes[i], name=f"node-{k:03d}") for k, i in enumerate(tie_order(nodes, seed))]
    return arrivals, ordered


def engine_run(arrivals, nodes):
    arrays = build_arrays([n.name for n in nodes], [n.model for n in nodes], [n.cpu_milli for n in nodes],
                          [n.memory_mib for n in nodes], [n.gpus for n in nodes])
    replay = Replay(arrays, FragmentationAwareDraplane())
    outcomes = []
    for pod in arrivals:
        outcome = replay.offer(shape_of(pod))
        outcomes.append(None if outcome.node is None else (nodes[outcome.node].name, tuple(sorted(outcome.gpus))))
    return outcomes, replay.policy


def shard_run(arrivals, nodes):
    policy = FragmentationAwareDraplane()
    state = SchedulingState(policy=policy)
    state.set_class(gpu_device_class())
    for trace_node in nodes:
        node, slice_ = node_objects(trace_node)
        state.set_node(node)
        state.set_feed_entry(f"node.{trace_node.name}", [slice_])
    outcomes = []
    for i, trace_pod in enumerate(arrivals):
        pod, claim = pod_objects(replace(trace_pod, name=f"pod-{i}"))
        pod.metadata.uid = f"pod-{i}"
        claims = []
        if claim is not None:
            claim.metadata.uid = f"claim-{i}"
            claims = [claim]
        placed = state.place_pod(pod, claims)
        if not isinstance(placed, Placed):
            outcomes.append(None)
            continue
        gpus = ()
        if claim is not None:
            allocation = placed.allocations[claim.metadata.uid]
            claim.status = ResourceClaimStatus(allocation=allocation)
            state.set_claim(claim)
            gpus = tuple(sorted(int(r.device.rsplit("-", 1)[1]) for r in allocation.devices.results))
        state.assume_pod(pod.metadata.uid, placed.node, placed.requests)
        outcomes.append((placed.node, gpus))
    return outcomes, policy


@pytest.mark.parametrize("seed", [1, 2])
def test_the_simulator_and_the_shard_place_every_pod_alike(seed):
    arrivals, nodes = arrivals_and_nodes(seed)
    simulated, simulated_policy = engine_run(arrivals, nodes)
    shipped, shipped_policy = shard_run(arrivals, nodes)
    assert len(arrivals) > 300
    for i, (ours, theirs) in enumerate(zip(simulated, shipped)):
        assert ours == theirs, f"pod {i} {arrivals[i]}: simulator {ours}, shard {theirs}"
    failed = sum(o is None for o in shipped)
    assert 0 < failed < len(arrivals) // 2  # the cluster fills up: choices matter
    # Both learned the same share sizes from the same pods, online.
    assert simulated_policy.workload.sizes == shipped_policy.workload.sizes
    assert simulated_policy.workload.version > 1


def test_the_registered_default_is_the_simulated_policy():
    from draplane.simulation.experiment import make_policy

    assert type(get_policy()) is type(make_policy("draplane", [])[0]) is FragmentationAwareDraplane


def test_learning_is_online():
    """The policy knows only the pods offered so far: its sizes after k pods are those of the
    first k, whatever comes later."""
    arrivals, nodes = arrivals_and_nodes(3)
    half = len(arrivals) // 2
    _, whole_run = engine_run(arrivals, nodes)
    _, first_half = engine_run(arrivals[:half], nodes)
    counted = sum(first_half.workload.sizes.values())
    assert 0 < counted < sum(whole_run.workload.sizes.values())
    shares = [p for p in arrivals[:half] if p.num_gpu == 1]
    assert counted <= len(shares)
