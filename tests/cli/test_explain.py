"""`draplane explain` on snapshots of the seed scenario: pending claims per node class, placed ones."""

from __future__ import annotations

from draplane.api.core import PodSchedulingGate, PodSchedulingGroup, PodStatus
from draplane.api.meta import ObjectMeta
from draplane.api.scheduling import GangSchedulingPolicy, PodGroup, PodGroupSchedulingPolicy, PodGroupSpec
from draplane.api.meta import Condition
from draplane.api.resource import ResourceClaimConsumerReference, ResourceClaimStatus
from draplane.cli import main
from draplane.cli.explain import Snapshot, chosen_line, explain_claim, explain_pod, find_target, find_targets
from draplane.simulation import scenario
from draplane.scheduling.placing import SchedulingState


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
        state = SchedulingState()
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
           "request gpu: capacity exhausted (too few matching devices are free), 2 cannot allocate all claims: " \
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


def test_a_gated_pod_names_its_gates_and_promises_no_attempt():
    snapshot = seed_snapshot(taken=False)
    pod = find_target(snapshot, "pod/vllm", "ns")
    pod.spec.scheduling_gates = [PodSchedulingGate(name="kueue.x-k8s.io/admission"),
                                 PodSchedulingGate(name="example.com/quota")]
    text = "\n".join(explain_pod(snapshot, pod))
    assert "Held by scheduling gates kueue.x-k8s.io/admission, example.com/quota" in text
    assert "Once the gates are removed it fits now: node node-80." in text
    assert "next scheduling attempt" not in text


def gang_snapshot(members: int, min_count: int, *, group: bool = True) -> Snapshot:
    """Members short-0.. of PodGroup qa/short, each with a one-GPU claim, on one empty node."""
    snapshot = seed_snapshot(taken=False)
    snapshot.pods, snapshot.claims = [], []
    for i in range(members):
        claim = scenario.claim("qa", f"short-{i}", "high-memory-gpu")
        claim.metadata.uid = f"c{i}"
        pod = scenario.pod("qa", f"short-{i}", claim_name=f"short-{i}")
        pod.metadata.uid = f"p{i}"
        pod.spec.scheduling_group = PodSchedulingGroup(pod_group_name="short")
        snapshot.claims.append(claim)
        snapshot.pods.append(pod)
    if group:
        snapshot.pod_groups = [PodGroup(metadata=ObjectMeta(name="short", namespace="qa"), spec=PodGroupSpec(
            scheduling_policy=PodGroupSchedulingPolicy(gang=GangSchedulingPolicy(min_count=min_count))))]
    return snapshot


def test_a_gang_below_its_minimum_count_is_not_promised_a_binding():
    snapshot = gang_snapshot(2, 3)
    text = "\n".join(explain_pod(snapshot, find_target(snapshot, "pod/short-0", "qa")))
    assert "Waiting for the gang's minimum count: 2 of 3 pods of PodGroup qa/short exist; " \
           "no member is placed until 1 more exists." in text
    assert "On its own it fits now: node node-80; it is placed only together with its gang." in text
    assert "next scheduling attempt should bind it" not in text
    # a gated third member does not count: the shards never hear of it
    snapshot = gang_snapshot(3, 3)
    snapshot.pods[2].spec.scheduling_gates = [PodSchedulingGate(name="example.com/quota")]
    assert "2 of 3 pods" in "\n".join(explain_pod(snapshot, find_target(snapshot, "pod/short-0", "qa")))
    # the third member exists: the gang can go
    snapshot = gang_snapshot(3, 3)
    text = "\n".join(explain_pod(snapshot, find_target(snapshot, "pod/short-0", "qa")))
    assert "minimum count" not in text and "It fits now: node node-80" in text


def test_a_gang_without_its_pod_group_says_so():
    snapshot = gang_snapshot(1, 1, group=False)
    text = "\n".join(explain_pod(snapshot, find_target(snapshot, "short-0", "qa")))
    assert "Waiting for PodGroup qa/short: not found." in text
    assert "next scheduling attempt should bind it" not in text


def test_a_name_that_is_both_a_pod_and_a_claim_says_which_is_explained():
    snapshot = seed_snapshot(taken=False)
    snapshot.pods[0].metadata.name = "vllm-gpu-claim"
    found = find_targets(snapshot, "vllm-gpu-claim", "ns")
    assert [type(o).__name__ for o in found] == ["Pod", "ResourceClaim"]
    assert chosen_line(found, "vllm-gpu-claim") == (
        "Both pod/vllm-gpu-claim and resourceclaim/vllm-gpu-claim exist in namespace ns: explaining "
        "pod/vllm-gpu-claim (draplane explain claim/vllm-gpu-claim for the claim).")
    assert [type(o).__name__ for o in find_targets(snapshot, "claim/vllm-gpu-claim", "ns")] == ["ResourceClaim"]
    assert chosen_line(find_targets(snapshot, "pod/vllm-gpu-claim", "ns"), "pod/vllm-gpu-claim") == ""


def test_unknown_class_says_no_node_can_help():
    snapshot = seed_snapshot(taken=False)
    snapshot.claims[0].spec.devices.requests[0].exactly.device_class_name = "nope"
    text = "\n".join(explain_pod(snapshot, find_target(snapshot, "vllm", "ns")))
    assert "No node can help" in text and "nope" in text


def test_cli_without_a_cluster_exits_2(tmp_path, capsys):
    assert main(["explain", "--kubeconfig", str(tmp_path / "missing"), "x"]) == 2
    assert "draplane explain:" in capsys.readouterr().err
