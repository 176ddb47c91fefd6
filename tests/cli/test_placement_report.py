"""The demo's "why" table: the allocator core asked per node about a bound pod's claims."""

from pathlib import Path

import msgspec
import pytest
import yaml

from draplane.allocation import DeviceAllocator
from draplane.api.codec import decode_object
from draplane.api.core import Node, Pod, PodSpec
from draplane.api.meta import ObjectMeta
from draplane.api.resource import ResourceClaimStatus, ResourceSlice
from draplane.cli.placement_report import ReportError, format_memory, format_report, group_outcomes, report_placement
from draplane.localenv.environment import standard_device_classes
from draplane.nodes.slices import desired_specs
from draplane.nodes.hardware import driver_devices
from draplane.nodes.profile import load_profile

FIXED = Path(__file__).resolve().parents[2] / "examples" / "seed-vllm-fixed"


def _cluster_objects(per_profile: int = 1):
    slices, nodes = [], []
    for profile in ("l4", "a100-mig", "dgx-h100", "mixed"):
        for i in range(per_profile):
            name = f"{profile}-{i:04d}"
            nodes.append(Node(metadata=ObjectMeta(name=name, labels={"draplane.dev/profile": profile})))
            for entry in driver_devices(load_profile(profile).hardware(name)):
                for j, spec in enumerate(desired_specs(name, entry)):
                    slices.append(ResourceSlice(metadata=ObjectMeta(name=f"{name}-{entry.driver}-{j}"), spec=spec))
    classes = [decode_object(raw) for raw in standard_device_classes()]
    return slices, classes, nodes


def _seed_claim(name="vllm-gpu-claim", uid="uid-seed"):
    claim = decode_object(yaml.safe_load((FIXED / "resourceclaim.yaml").read_text()))
    claim.metadata.namespace = "default"
    claim.metadata.name = name
    claim.metadata.uid = uid
    return claim


def _allocated(claim, cluster: DeviceAllocator, node: str | None = None):
    placement = cluster.allocate([claim]) if node is None else cluster.allocate_on_node([claim], node)
    cluster.commit([claim], placement)
    return msgspec.structs.replace(claim, status=ResourceClaimStatus(allocation=placement.allocations[0])), placement


def _bound_pod(node: str) -> Pod:
    return Pod(metadata=ObjectMeta(name="vllm-inference", namespace="default"), spec=PodSpec(node_name=node))


def test_seed_claim_goes_to_the_h100_node_and_the_others_say_why():
    slices, classes, nodes = _cluster_objects()
    cluster = DeviceAllocator(slices=slices, classes=classes, nodes=nodes)
    claim, placement = _allocated(_seed_claim(), cluster)
    assert placement.node == "dgx-h100-0000"

    report = report_placement(_bound_pod(placement.node), [claim], slices=slices, classes=classes, nodes=nodes,
                              all_claims=[claim])
    assert report.replay_node == "dgx-h100-0000"
    assert [(d.device, d.product, format_memory(d.memory)) for d in report.devices] == [
        (placement.allocations[0].devices.results[0].device, "NVIDIA H100 80GB HBM3", "79.6Gi")]
    by_node = {o.node: o for o in report.outcomes}
    assert by_node["dgx-h100-0000"].score == pytest.approx(placement.score)
    assert by_node["mixed-0000"].score > by_node["dgx-h100-0000"].score
    for node, memory in (("l4-0000", "22.5Gi"), ("a100-mig-0000", "40Gi")):
        assert by_node[node].reason == "NoDeviceMatchesClass"
        assert by_node[node].class_matches == 0
        assert format_memory(by_node[node].largest_memory) == memory
        assert "match the selectors of device class high-memory-gpu" in by_node[node].message
    assert report.classes == {"high-memory-gpu": [classes[2].spec.selectors[0].cel.expression]}

    text = format_report(report, [("create -> bound", 0.25)])
    assert "dgx-h100-0000" in text and "<- chosen" in text
    assert "next best" in text and "on mixed-0000" in text
    assert "create -> bound  0.25s" in text
    assert "note:" not in text
    rows = [line for line in text.splitlines() if line.startswith("  ") and "NoDeviceMatchesClass" in line]
    assert len(rows) == 2 and any("40Gi" in r for r in rows) and any("22.5Gi" in r for r in rows)


def test_nodes_of_one_class_that_fare_the_same_share_a_row():
    slices, classes, nodes = _cluster_objects(per_profile=3)
    cluster = DeviceAllocator(slices=slices, classes=classes, nodes=nodes)
    claim, placement = _allocated(_seed_claim(), cluster)
    report = report_placement(_bound_pod(placement.node), [claim], slices=slices, classes=classes, nodes=nodes,
                              all_claims=[claim])
    groups = {(g.node_class, g.outcome.reason, len(g.nodes)) for g in group_outcomes(report)}
    assert ("l4", "NoDeviceMatchesClass", 3) in groups
    assert ("a100-mig", "NoDeviceMatchesClass", 3) in groups
    first = group_outcomes(report)[0]
    assert first.nodes == [placement.node]  # the chosen node has a row of its own, first
    assert "3 nodes (l4-0000 .. l4-0002)" in format_report(report)


def test_devices_held_by_other_claims_are_the_reason_a_node_is_out():
    slices, classes, nodes = _cluster_objects()
    cluster = DeviceAllocator(slices=slices, classes=classes, nodes=nodes)
    others = []
    for i in range(8):  # every H100 of the dgx-h100 node
        other, _ = _allocated(_seed_claim(f"other-{i}", f"uid-other-{i}"), cluster, "dgx-h100-0000")
        others.append(other)
    claim, placement = _allocated(_seed_claim(), cluster)
    assert placement.node == "mixed-0000"

    report = report_placement(_bound_pod("mixed-0000"), [claim], slices=slices, classes=classes, nodes=nodes,
                              all_claims=[*others, claim])
    by_node = {o.node: o for o in report.outcomes}
    assert by_node["dgx-h100-0000"].reason == "DevicesInUse"
    assert by_node["dgx-h100-0000"].class_matches == 8
    assert report.replay_node == "mixed-0000"
    assert "the only node that fits" in format_report(report)


def test_a_replay_that_disagrees_says_so():
    slices, classes, nodes = _cluster_objects()
    cluster = DeviceAllocator(slices=slices, classes=classes, nodes=nodes)
    claim, _ = _allocated(_seed_claim(), cluster, "mixed-0000")
    report = report_placement(_bound_pod("mixed-0000"), [claim], slices=slices, classes=classes, nodes=nodes,
                              all_claims=[claim])
    assert report.replay_node == "dgx-h100-0000"
    assert "note: asked today, the core would pick dgx-h100-0000" in format_report(report)


def test_an_unbound_pod_or_unallocated_claim_is_refused_by_name():
    slices, classes, nodes = _cluster_objects()
    claim = _seed_claim()
    with pytest.raises(ReportError, match=r"Pod default/vllm-inference: spec.nodeName is empty"):
        report_placement(Pod(metadata=ObjectMeta(name="vllm-inference", namespace="default")), [claim],
                         slices=slices, classes=classes, nodes=nodes, all_claims=[])
    with pytest.raises(ReportError, match=r"ResourceClaim default/vllm-gpu-claim: status.allocation is empty"):
        report_placement(_bound_pod("l4-0000"), [claim], slices=slices, classes=classes, nodes=nodes, all_claims=[])
    with pytest.raises(ReportError, match=r"spec.resourceClaims"):
        report_placement(_bound_pod("l4-0000"), [], slices=slices, classes=classes, nodes=nodes, all_claims=[])
