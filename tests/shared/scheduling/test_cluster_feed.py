"""The cluster bucket's keys and values (draplane.scheduling.cluster_feed): pure."""

import msgspec
import pytest

from draplane.api.core import Affinity, Container, Node, NodeSpec, NodeStatus, Pod, PodSchedulingGroup, PodSpec, PodStatus, \
    ResourceRequirements, Taint
from draplane.api.meta import Condition, ObjectMeta
from draplane.api.policy import PodDisruptionBudget
from draplane.api.resource import AllocatedDeviceStatus, DeviceClass, ResourceClaim, ResourceClaimStatus
from draplane.api.scheduling import PodGroup
from draplane.scheduling import cluster_feed as feed


def _pod(node: str | None = "n1", phase: str | None = "Running", group: str | None = None) -> Pod:
    return Pod(
        metadata=ObjectMeta(name="p", namespace="ns", uid="pod-uid", resource_version="7",
                            annotations={"big": "x" * 1000}, managed_fields=[{"manager": "kubectl"}]),
        spec=PodSpec(containers=[Container(name="c", image="registry/image:tag",
                                           resources=ResourceRequirements(requests={"cpu": "1"}))],
                     node_name=node, priority=5,
                     scheduling_group=PodSchedulingGroup(pod_group_name=group) if group else None),
        status=PodStatus(phase=phase, conditions=[Condition(type="Ready", status="True")]),
    )


def test_keys_name_the_kind_and_the_object():
    assert feed.key_of(_pod()) == "pod.pod-uid"
    assert feed.key_of(Node(metadata=ObjectMeta(name="gpu-node.rack-1"))) == "node.gpu-node.rack-1"
    assert feed.key_of(PodGroup(metadata=ObjectMeta(name="g", namespace="team"))) == "podgroup.team.g"
    assert feed.key_of(PodDisruptionBudget(metadata=ObjectMeta(name="b", namespace="team"))) == "pdb.team.b"
    assert feed.key_of(ResourceClaim(metadata=ObjectMeta(name="c", namespace="ns", uid="u1"))) == "claim.u1"
    assert feed.kind_of_key("claim.u1") is ResourceClaim
    assert feed.kind_of_key(feed.SYNCED_KEY) is None
    assert feed.kind_of_key("widget.x") is None


def test_an_object_without_its_key_field_is_refused_by_name():
    with pytest.raises(feed.FeedError, match="ResourceClaim ns/c: no uid"):
        feed.key_of(ResourceClaim(metadata=ObjectMeta(name="c", namespace="ns")))
    with pytest.raises(feed.FeedError, match="not a kind of the cluster feed"):
        feed.trimmed(object())


def test_what_scheduling_does_not_read_is_left_out():
    pod = feed.decode("pod.pod-uid", feed.encode(_pod()))
    assert pod.metadata.annotations is None and pod.metadata.managed_fields is None
    assert pod.metadata.resource_version is None
    assert pod.spec.containers[0].image is None
    assert pod.spec.containers[0].resources.requests == {"cpu": "1"}
    assert pod.status.conditions is None and pod.status.phase == "Running"
    assert pod.spec.priority == 5 and pod.spec.node_name == "n1"


def test_a_pod_keeps_its_pod_affinity_terms_and_drops_its_node_affinity():
    """Other pods' placement reads a bound pod's pod (anti-)affinity: required anti-affinity
    filters, the rest scores (pod_scores.score_terms); its node affinity concerns itself only."""
    pod = _pod()
    term = {"topologyKey": "zone", "labelSelector": {"matchLabels": {"app": "web"}}}
    pod.spec.affinity = msgspec.convert({
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}]}},
        "podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term],
                        "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 5, "podAffinityTerm": term}]},
        "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 7, "podAffinityTerm": term}]},
    }, Affinity)
    kept = feed.decode("pod.pod-uid", feed.encode(pod)).spec.affinity
    assert kept.node_affinity is None
    assert kept.pod_affinity == pod.spec.affinity.pod_affinity
    assert kept.pod_anti_affinity == pod.spec.affinity.pod_anti_affinity
    pod.spec.affinity = msgspec.convert({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}]}}}, Affinity)
    assert feed.decode("pod.pod-uid", feed.encode(pod)).spec.affinity is None


def test_a_node_heartbeat_or_a_claim_device_status_trims_to_the_same_bytes():
    node = Node(metadata=ObjectMeta(name="n1", resource_version="1", labels={"zone": "a"}),
                spec=NodeSpec(taints=[Taint(key="k", effect="NoSchedule")]),
                status=NodeStatus(allocatable={"cpu": "8"}, conditions=[Condition(type="Ready", status="True")]))
    beat = msgspec.structs.replace(node, metadata=msgspec.structs.replace(node.metadata, resource_version="2"),
                                   status=NodeStatus(allocatable={"cpu": "8"},
                                                     conditions=[Condition(type="Ready", status="Unknown")]))
    assert feed.encode(node) == feed.encode(beat)
    tainted = msgspec.structs.replace(node, spec=NodeSpec(taints=[]))
    assert feed.encode(node) != feed.encode(tainted)
    # NodeDeclaredFeatures reads the node's declared features: they travel
    declaring = msgspec.structs.replace(node, status=NodeStatus(
        allocatable={"cpu": "8"}, declared_features=["RestartAllContainersOnContainerExits"]))
    assert feed.decode("node.n1", feed.encode(declaring)).status.declared_features == [
        "RestartAllContainersOnContainerExits"]

    claim = ResourceClaim(metadata=ObjectMeta(name="c", namespace="ns", uid="u1"), status=ResourceClaimStatus())
    with_devices = msgspec.structs.replace(claim, status=ResourceClaimStatus(
        devices=[AllocatedDeviceStatus(driver="d", pool="p", device="g0")]))
    assert feed.encode(claim) == feed.encode(with_devices)


def test_a_pod_group_keeps_its_annotations_other_kinds_do_not():
    group = PodGroup(metadata=ObjectMeta(name="g", namespace="ns", annotations={"draplane.dev/topology": "preferred"}))
    assert feed.decode("podgroup.ns.g", feed.encode(group)).metadata.annotations == {"draplane.dev/topology": "preferred"}
    device_class = DeviceClass(metadata=ObjectMeta(name="gpu", annotations={"a": "b"}))
    assert feed.decode("class.gpu", feed.encode(device_class)).metadata.annotations is None


@pytest.mark.parametrize(("node", "phase", "group", "published"), [
    ("n1", "Running", None, True),
    ("n1", "Succeeded", None, False),  # finished: no longer counted on its node
    (None, "Pending", None, False),  # pending pods travel in their PendingPods
    (None, "Pending", "gang", True),  # ...but a gang's must be seen to go while the gang waits
    (None, "Failed", "gang", False),
])
def test_which_pods_are_published(node, phase, group, published):
    assert feed.published_pod(_pod(node, phase, group)) is published


def test_unreadable_entries_name_the_key():
    with pytest.raises(feed.FeedError, match="'pod.x': not a Pod"):
        feed.decode("pod.x", b"\xc1garbage")
    with pytest.raises(feed.FeedError, match="not a kind this shard knows"):
        feed.decode("widget.x", b"")
    # a value under another object's key is refused, not taken for it
    with pytest.raises(feed.FeedError, match="holds Pod 'pod.pod-uid'"):
        feed.decode("pod.other", feed.encode(_pod()))
    with pytest.raises(feed.FeedError, match="meta.synced"):
        feed.decode_synced(b"\x01")


def test_the_synced_marker_round_trips():
    marker = feed.Synced(binder="draplane-binder-1", at=12.5)
    assert feed.decode_synced(feed.encode_synced(marker)) == marker
