"""Allocator throughput and memory on one core.

(a) sched_perf_5000x500: the shape of kube-scheduler's DRA benchmark
    SchedulingWithResourceClaimTemplate/5000pods_500nodes: 500 nodes x 10 devices, 5,000 single-device
    claims of one class with a CEL selector, allocated one by one (best node, then commit) against the
    growing in-use set.
(b) topology_mix_1000x8: 1,000 nodes x 8 GPUs (2 NUMA nodes, 4 PCIe roots), claims for 1, 2, 4 and
    8 GPUs, some with matchAttribute on resource.kubernetes.io/pcieRoot, some with firstAvailable.
(c) scale_5000x8: the same mix on 5,000 nodes x 8 GPUs (40,000 devices), until 32,000 GPUs (80 %)
    are allocated.
(d) shard_5000x8: the same claims through the shard's core, `SchedulingState.place_pod`, one pod per
    claim asking 1-16 CPUs and 8-128 GiB on nodes of 224 CPUs and 2 TiB: node fit, the device
    search, and the shipped policy's CPU/memory term over every feasible node, then the claim's
    allocation and the pod's requests recorded as the shard's watches would. What one shard's
    placements cost at 5,000 nodes, without NATS.
(e) shard_5000x8_constrained: (d) with 30 % of the pods carrying a required hostname anti-affinity
    or a DoNotSchedule zone spread against their app's 20 replicas, each pod then seen bound.

Each case runs in its own process so peak_mb (max RSS) is that case's alone. claims_per_s is per
CPU-second of this single-threaded process (time.process_time), i.e. what one core does: the
project's machine is shared by several engineers, and wall time there measures the neighbours too.
`seconds` is the wall time, for reference.
Usage: .venv/bin/python bench/allocator.py [--policy draplane|first-fit] [--case NAME]
"""

from __future__ import annotations

import argparse
import random
import resource
import subprocess
import sys
import time

from draplane.api.meta import ObjectMeta
from draplane.api.resource import (
    CELDeviceSelector,
    Device,
    DeviceAttribute,
    DeviceCapacity,
    DeviceClaim,
    DeviceClass,
    DeviceClassSpec,
    DeviceConstraint,
    DeviceRequest,
    DeviceSelector,
    DeviceSubRequest,
    ExactDeviceRequest,
    ResourceClaim,
    ResourceClaimSpec,
    ResourcePool,
    ResourceSlice,
    ResourceSliceSpec,
)


def _class(name: str, expression: str) -> DeviceClass:
    return DeviceClass(
        metadata=ObjectMeta(name=name),
        spec=DeviceClassSpec(selectors=[DeviceSelector(cel=CELDeviceSelector(expression=expression))]),
    )


def _claim(name: str, requests: list[DeviceRequest], constraints=None) -> ResourceClaim:
    return ResourceClaim(
        metadata=ObjectMeta(name=name, namespace="bench"),
        spec=ResourceClaimSpec(devices=DeviceClaim(requests=requests, constraints=constraints)),
    )


def sched_perf(policy: str) -> tuple[int, float]:
    from draplane.allocation import DeviceAllocator, NodePlacement

    driver = "test-driver.cdi.k8s.io"
    slices = []
    for n in range(500):
        node = f"node-{n:03d}"
        slices.append(ResourceSlice(
            metadata=ObjectMeta(name=f"{node}-{driver}"),
            spec=ResourceSliceSpec(
                driver=driver, node_name=node,
                pool=ResourcePool(name=node, generation=1, resource_slice_count=1),
                devices=[
                    Device(
                        name=f"device-{d}",
                        attributes={"model": DeviceAttribute(string_value="test-model")},
                        capacity={"memory": DeviceCapacity(value="1Gi")},
                    )
                    for d in range(10)
                ],
            ),
        ))
    classes = [_class("test-class", f'device.driver == "{driver}"')]
    request = DeviceRequest(
        name="req-0",
        exactly=ExactDeviceRequest(
            device_class_name="test-class",
            selectors=[DeviceSelector(cel=CELDeviceSelector(expression='device.attributes["test-driver.cdi.k8s.io"].model == "test-model"'))],
        ),
    )
    claims = [_claim(f"claim-{i:04d}", [request]) for i in range(5000)]
    cluster = DeviceAllocator(slices=slices, classes=classes, policy=policy)
    cluster.ensure_nodes_from_slices()
    return _schedule("sched_perf", cluster, claims)


def _topology_inputs(nodes: int, gpus_wanted: int):
    driver = "gpu.nvidia.com"
    slices = []
    for n in range(nodes):
        node = f"gpu-node-{n:04d}"
        devices = []
        for g in range(8):
            devices.append(Device(
                name=f"gpu-{g}",
                attributes={
                    "type": DeviceAttribute(string_value="gpu"),
                    "productName": DeviceAttribute(string_value="NVIDIA H100 80GB HBM3"),
                    "uuid": DeviceAttribute(string_value=f"GPU-{n:04d}-{g}"),
                    "resource.kubernetes.io/pcieRoot": DeviceAttribute(string_value=f"pci0000:{g // 2:02x}"),
                    "resource.kubernetes.io/numaNode": DeviceAttribute(int_value=g // 4),
                },
                capacity={"memory": DeviceCapacity(value="80Gi")},
            ))
        slices.append(ResourceSlice(
            metadata=ObjectMeta(name=f"{node}-gpu"),
            spec=ResourceSliceSpec(
                driver=driver, node_name=node,
                pool=ResourcePool(name=node, generation=1, resource_slice_count=1), devices=devices,
            ),
        ))
    classes = [
        _class("gpu.nvidia.com", f'device.driver == "{driver}" && device.attributes["{driver}"].type == "gpu"'),
        _class("big-gpu.nvidia.com",
               f'device.driver == "{driver}" && device.capacity["{driver}"].memory.isGreaterThan(quantity("40Gi"))'),
    ]
    rng = random.Random(7)
    claims = []
    total = 0
    while total < gpus_wanted:
        size = rng.choices((1, 2, 4, 8), weights=(40, 30, 20, 10))[0]
        kind = rng.random()
        name = f"claim-{len(claims):05d}"
        if kind < 0.3 and size > 1:
            claims.append(_claim(name, [DeviceRequest(name="gpus", exactly=ExactDeviceRequest(
                device_class_name="gpu.nvidia.com", count=size))],
                constraints=[DeviceConstraint(match_attribute="resource.kubernetes.io/pcieRoot")] if size <= 2 else
                [DeviceConstraint(match_attribute="resource.kubernetes.io/numaNode")] if size == 4 else None))
        elif kind < 0.5:
            claims.append(_claim(name, [DeviceRequest(name="gpus", first_available=[
                DeviceSubRequest(name="big", device_class_name="big-gpu.nvidia.com", count=size),
                DeviceSubRequest(name="any", device_class_name="gpu.nvidia.com", count=size),
            ])]))
        else:
            claims.append(_claim(name, [DeviceRequest(name="gpus", exactly=ExactDeviceRequest(
                device_class_name="gpu.nvidia.com", count=size))]))
        total += size
    return slices, classes, claims


def topology_mix(policy: str, nodes: int = 1000, gpus_wanted: int = 6400) -> tuple[int, float, float]:
    from draplane.allocation import DeviceAllocator

    slices, classes, claims = _topology_inputs(nodes, gpus_wanted)
    cluster = DeviceAllocator(slices=slices, classes=classes, policy=policy)
    cluster.ensure_nodes_from_slices()
    return _schedule("topology_mix", cluster, claims)


def shard_5000x8(policy: str, nodes: int = 5000, gpus_wanted: int = 32_000) -> tuple[int, float, float]:
    from draplane.allocation.scoring import get_policy
    from draplane.api.core import Node, NodeStatus
    from draplane.simulation import scenario
    from draplane.scheduling.placing import SchedulingState

    slices, classes, claims = _topology_inputs(nodes, gpus_wanted)
    state = SchedulingState(policy=get_policy(policy))
    for device_class in classes:
        state.set_class(device_class)
    for slice_ in slices:
        name = slice_.spec.node_name
        state.set_node(Node(metadata=ObjectMeta(name=name),
                            status=NodeStatus(allocatable={"cpu": "224", "memory": "2Ti", "pods": "110"})))
        state.set_feed_entry(f"node.{name}", [slice_])
    rng = random.Random(11)
    pods = []
    for i, claim in enumerate(claims):
        claim.metadata.uid = f"claim-{i}"
        pod = scenario.pod("bench", f"pod-{i:05d}", claim_name=claim.metadata.name, cpu=str(rng.randint(1, 16)))
        pod.spec.containers[0].resources.requests["memory"] = f"{rng.choice((8, 16, 32, 64, 128))}Gi"
        pod.metadata.uid = f"pod-{i}"
        pods.append(pod)
    cpu, wall = _place_each(state, pods, claims, "shard_5000x8",
                            lambda pod, placed: state.assume_pod(pod.metadata.uid, placed.node, placed.requests))
    return len(claims), cpu, wall


def _place_each(state, pods, claims, case: str, seen_bound) -> tuple[float, float]:
    """Each pod with its claim through `SchedulingState.place_pod`, the allocation and the bound pod
    then recorded (`seen_bound(pod, placed)`) as the shard's watches would. (CPU s, wall s)."""
    from draplane.api.resource import ResourceClaimStatus
    from draplane.scheduling.placing import Placed

    wall, cpu = time.perf_counter(), time.process_time()
    for pod, claim in zip(pods, claims):
        placed = state.place_pod(pod, [claim])
        if not isinstance(placed, Placed):
            raise SystemExit(f"{case}: {pod.metadata.name} not placed: {placed}")
        claim.status = ResourceClaimStatus(allocation=placed.allocations[claim.metadata.uid])
        state.set_claim(claim)
        seen_bound(pod, placed)
    return time.process_time() - cpu, time.perf_counter() - wall


def shard_5000x8_constrained(policy: str, nodes: int = 5000, gpus_wanted: int = 32_000) -> tuple[int, float, float]:
    pods, cpu, wall = place_constrained(policy, nodes, gpus_wanted)
    constrained = sum(1 for p in pods if p.metadata.labels)
    print(f"# shard_5000x8_constrained: {constrained} of {len(pods)} pods constrained", file=sys.stderr)
    return len(pods), cpu, wall


def place_constrained(policy: str, nodes: int, gpus_wanted: int) -> tuple[list, float, float]:
    """shard_5000x8 with 30 % of the pods constrained as inference replicas are (issue 24's cost
    case): half of them with a required anti-affinity on kubernetes.io/hostname against their app's
    other replicas, half with a DoNotSchedule topology spread (maxSkew 1) over 10 zones. Apps have
    20 replicas. Each placed pod is then seen bound (`set_pod`), as the shard's pod watch sees it.
    Returns the pods, bound, and the CPU and wall seconds of the placements."""
    from draplane.allocation.scoring import get_policy
    from draplane.api.core import (Affinity, Node, NodeStatus, PodAffinityTerm, PodAntiAffinity,
                                   TopologySpreadConstraint)
    from draplane.api.policy import LabelSelector
    from draplane.simulation import scenario
    from draplane.scheduling.placing import SchedulingState

    slices, classes, claims = _topology_inputs(nodes, gpus_wanted)
    state = SchedulingState(policy=get_policy(policy))
    for device_class in classes:
        state.set_class(device_class)
    for i, slice_ in enumerate(slices):
        name = slice_.spec.node_name
        state.set_node(Node(metadata=ObjectMeta(name=name, labels={"kubernetes.io/hostname": name,
                                                                   "topology.kubernetes.io/zone": f"zone-{i % 10}"}),
                            status=NodeStatus(allocatable={"cpu": "224", "memory": "2Ti", "pods": "110"})))
        state.set_feed_entry(f"node.{name}", [slice_])
    rng = random.Random(11)
    pods = []
    replicas = {"anti": 0, "spread": 0}
    for i, claim in enumerate(claims):
        claim.metadata.uid = f"claim-{i}"
        pod = scenario.pod("bench", f"pod-{i:05d}", claim_name=claim.metadata.name, cpu=str(rng.randint(1, 16)))
        pod.spec.containers[0].resources.requests["memory"] = f"{rng.choice((8, 16, 32, 64, 128))}Gi"
        pod.metadata.uid = f"pod-{i}"
        kind = rng.random()
        if kind < 0.3:
            way = "anti" if kind < 0.15 else "spread"
            app = f"{way}-{replicas[way] // 20}"  # an app's replicas are all constrained one way
            replicas[way] += 1
            pod.metadata.labels = {"app": app}
            selector = LabelSelector(match_labels={"app": app})
            if way == "anti":
                pod.spec.affinity = Affinity(pod_anti_affinity=PodAntiAffinity(
                    required_during_scheduling_ignored_during_execution=[
                        PodAffinityTerm(topology_key="kubernetes.io/hostname", label_selector=selector)]))
            else:
                pod.spec.topology_spread_constraints = [TopologySpreadConstraint(
                    max_skew=1, topology_key="topology.kubernetes.io/zone", when_unsatisfiable="DoNotSchedule",
                    label_selector=selector)]
        pods.append(pod)
    def seen_bound(pod, placed) -> None:
        pod.spec.node_name = placed.node
        state.set_pod(pod)

    cpu, wall = _place_each(state, pods, claims, "shard_5000x8_constrained", seen_bound)
    return pods, cpu, wall


def _schedule(case: str, cluster, claims) -> tuple[int, float, float]:
    """One claim at a time: best node, then commit, as a scheduler does. (claims, cpu s, wall s)."""
    from draplane.allocation import NodePlacement

    wall, cpu = time.perf_counter(), time.process_time()
    for claim in claims:
        placement = cluster.allocate([claim])
        if not isinstance(placement, NodePlacement):
            raise SystemExit(f"{case}: {claim.metadata.name} not allocated: {placement}")
        cluster.commit([claim], placement)
    return len(claims), time.process_time() - cpu, time.perf_counter() - wall


def scale_5000x8(policy: str) -> tuple[int, float]:
    """Issue 16's scale: 5,000 nodes x 8 GPUs (40,000 devices), the topology mix filled to 80 %."""
    return topology_mix(policy, nodes=5000, gpus_wanted=32_000)


CASES = {"sched_perf_5000x500": sched_perf, "topology_mix_1000x8": topology_mix, "scale_5000x8": scale_5000x8,
         "shard_5000x8": shard_5000x8, "shard_5000x8_constrained": shard_5000x8_constrained}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--policy", default="draplane")
    parser.add_argument("--case", choices=sorted(CASES))
    args = parser.parse_args()
    if args.case:
        count, cpu_seconds, wall_seconds = CASES[args.case](args.policy)
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"# policy {args.policy}: {count} claims, {cpu_seconds:.2f} CPU s, {wall_seconds:.2f} wall s",
              file=sys.stderr, flush=True)
        print(f"BENCH name={args.case} claims_per_s={count / cpu_seconds:.1f} peak_mb={peak_mb:.1f} "
              f"seconds={wall_seconds:.2f}", flush=True)
        return
    for case in CASES:
        subprocess.run([sys.executable, __file__, "--case", case, "--policy", args.policy], check=True)


if __name__ == "__main__":
    main()
