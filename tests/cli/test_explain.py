"""`draplane explain` on snapshots of the seed scenario: pending claims per node class, placed ones."""

from __future__ import annotations

from draplane.api.core import PodStatus
from draplane.api.meta import Condition
from draplane.api.resource import ResourceClaimConsumerReference, ResourceClaimStatus
from draplane.cli import main
from draplane.cli.explain import Snapshot, explain_claim, explain_pod, find_target
from draplane.scheduling import scenario
from draplane.scheduling.placing import ClusterState


def seed_snapshot(taken: bool) -> Snapshot:
    nodes, slices = [], []
    for name, memory in (("node-24", "24Gi"), ("node-40", "40Gi"), ("node-80", "80Gi")):
        nodes.append(scenario.gpu_node(name))
        slices.append(scenario.gpu_slice(name, 1, memory))
    classes = [scenario.device_class("high-memory-gpu", scenario.HIGH_MEMORY_EXPRESSION)]
    claims, pods = [], []
    claim = scenario.claim("ns", "vllm-gpu-claim", "high-memory-gpu")
    claim.metadata.uid = "c1"
    pod = scenario.pod("ns", "vllm", claim_name="vllm-gpu-claim")
    pod.metadata.uid = "p1"
    claims.append(claim)
    pods.append(pod)
    if taken:
        other = scenario.claim("ns", "other", "high-memory-gpu")
        other.metadata.uid = "c0"
        state = ClusterState()
        state.set_class(classes[0])
        for n, s in zip(nodes, slices):
            state.set_node(n)
            state.set_feed_entry(n.metadata.name, [s])
        placed = state.place_pod(scenario.pod("ns", "x"), [other])
        other.status = ResourceClaimStatus(
            allocation=placed.allocations["c0"],
            reserved_for=[ResourceClaimConsumerReference(resource="pods", name="x", uid="px")],
        )
        claims.append(other)
        pod.status = PodStatus(conditions=[Condition(type="PodScheduled", status="False", reason="Unschedulable",
                                                     message="0/3 nodes are available: ...")])
    return Snapshot(slices=slices, classes=classes, nodes=nodes, claims=claims, pods=pods)


def test_pending_claim_is_explained_per_node_class():
    snapshot = seed_snapshot(taken=True)
    claim = find_target(snapshot, "claim/vllm-gpu-claim", "ns")
    text = "\n".join(explain_claim(snapshot, claim))
    assert "is pending" in text and "Used by pod vllm" in text
    assert "The scheduler said (Unschedulable)" in text
    assert "no device matches the class: 2 nodes (node-24, node-40)" in text
    assert "capacity exhausted (too few free matching devices): 1 node (node-80)" in text
    assert "Placing it now: 0/3 nodes are available: 1 cannot allocate all claims: resourceclaim ns/vllm-gpu-claim, " \
           "request gpu: capacity exhausted (matching devices are all in use), 2 cannot allocate all claims: " \
           "resourceclaim ns/vllm-gpu-claim, request gpu: no device matches the device class." in text


def test_a_message_the_pod_already_shows_is_printed_once():
    snapshot = seed_snapshot(taken=True)
    pod = find_target(snapshot, "pod/vllm", "ns")
    first = explain_pod(snapshot, pod)
    placing_now = next(line for line in first if line.startswith("Placing it now: ")).removeprefix("Placing it now: ")
    pod.status.conditions[0].message = placing_now
    lines = explain_pod(snapshot, pod)
    assert sum(placing_now in line for line in lines) == 1, lines
    assert "Per node class:" in lines


def test_pod_that_fits_now_and_allocated_claim():
    snapshot = seed_snapshot(taken=False)
    pod = find_target(snapshot, "pod/vllm", "ns")
    assert "It fits now: node node-80" in "\n".join(explain_pod(snapshot, pod))
    other = find_target(seed_snapshot(taken=True), "other", "ns")
    text = "\n".join(explain_claim(seed_snapshot(taken=True), other))
    assert "is allocated on node node-80" in text
    assert "request gpu: gpu.nvidia.com pool node-80 device gpu-0" in text
    assert "reserved for: pods/x" in text


def test_unknown_class_says_no_node_can_help():
    snapshot = seed_snapshot(taken=False)
    snapshot.claims[0].spec.devices.requests[0].exactly.device_class_name = "nope"
    text = "\n".join(explain_pod(snapshot, find_target(snapshot, "vllm", "ns")))
    assert "No node can help" in text and "nope" in text


def test_cli_without_a_cluster_exits_2(tmp_path, capsys):
    assert main(["explain", "--kubeconfig", str(tmp_path / "missing"), "x"]) == 2
    assert "draplane explain:" in capsys.readouterr().err
