import msgspec
import pytest

from draplane.api.meta import NodeSelector, NodeSelectorRequirement, NodeSelectorTerm
from draplane.api.resource import AllocationResult, DeviceAllocationResult, DeviceRequestAllocationResult
from draplane.scheduling.messages import (
    ClaimPlacement,
    ClaimRef,
    ClaimReleased,
    MessageError,
    PendingPod,
    Placement,
    PodRef,
    Subjects,
    decode_message,
    encode_message,
    partition_key,
    shard_for,
)

POD = PodRef(namespace="ns", name="p", uid="u1")


def test_round_trip_every_message_kind():
    allocation = AllocationResult(
        devices=DeviceAllocationResult(
            results=[DeviceRequestAllocationResult(request="gpu", driver="gpu.nvidia.com", pool="n1", device="gpu-0")]
        ),
        node_selector=NodeSelector(
            node_selector_terms=[
                NodeSelectorTerm(match_fields=[NodeSelectorRequirement(key="metadata.name", operator="In", values=["n1"])])
            ]
        ),
    )
    messages = [
        PendingPod(pod=POD, claims=[ClaimRef(namespace="ns", name="c", uid="c1")], first_seen=1.5),
        Placement(
            pod=POD,
            node="n1",
            claims=[ClaimPlacement(claim=ClaimRef(namespace="ns", name="c", uid="c1"), allocation=allocation)],
            shard=2,
            first_seen=1.0,
            expires_at=9.0,
        ),
        ClaimReleased(claim=ClaimRef(namespace="ns", name="c", uid="c1"), node="n1"),
    ]
    for message in messages:
        assert decode_message(encode_message(message)) == message


def test_wrong_version_is_rejected_by_name():
    data = encode_message(PendingPod(version=99, pod=POD, claims=[], first_seen=0.0))
    with pytest.raises(MessageError, match="PendingPod: field version is 99"):
        decode_message(data)


def test_garbage_is_rejected():
    with pytest.raises(MessageError):
        decode_message(b"\x00\x01garbage")
    with pytest.raises(MessageError):
        decode_message(msgspec.msgpack.encode({"type": "nope"}))


def test_shard_is_stable_and_spread():
    assert shard_for("ns/claim-a", 4) == shard_for("ns/claim-a", 4)
    counts = [0] * 4
    for i in range(4000):
        counts[shard_for(f"ns/claim-{i}", 4)] += 1
    assert min(counts) > 800
    with pytest.raises(ValueError):
        shard_for("x", 0)


def test_pods_sharing_a_claim_share_a_partition():
    a = PendingPod(pod=POD, claims=[ClaimRef(namespace="ns", name="shared", uid="s")], first_seen=0)
    b = PendingPod(
        pod=PodRef(namespace="ns", name="q", uid="u2"),
        claims=[ClaimRef(namespace="ns", name="shared", uid="s")],
        first_seen=0,
    )
    assert partition_key(a) == partition_key(b) == "ns/shared"


def test_members_of_a_gang_share_a_partition_whatever_their_claims():
    from draplane.api.core import PodSchedulingGroup, PodSpec

    in_group = PodSpec(scheduling_group=PodSchedulingGroup(pod_group_name="train"))
    members = [
        PendingPod(pod=PodRef(namespace="ns", name=f"w-{i}", uid=f"u{i}"),
                   claims=[ClaimRef(namespace="ns", name=f"w-{i}-gpus", uid=f"c{i}")], first_seen=0, spec=in_group)
        for i in range(16)
    ]
    assert {partition_key(m) for m in members} == {"podgroup:ns/train"}
    assert len({shard_for(partition_key(m), 4) for m in members}) == 1
    # Decoded from the wire as the binder sends it, the group survives.
    decoded = decode_message(encode_message(members[0]))
    assert partition_key(decoded) == "podgroup:ns/train"
    alone = PendingPod(pod=POD, claims=[ClaimRef(namespace="ns", name="c", uid="c")], first_seen=0, spec=PodSpec())
    assert partition_key(alone) == "ns/c"


def test_subject_names_are_valid_stream_names():
    subjects = Subjects(prefix="t-42.draplane.")
    assert subjects.pending(3) == "t-42.draplane.pending.3"
    assert subjects.pending_stream == "T-42_DRAPLANE_PENDING"
    assert subjects.reservations_bucket == "T-42_DRAPLANE_RESERVATIONS"


def test_pending_pod_carries_the_scheduling_spec_and_reads_without_it():
    from draplane.simulation import scenario

    spec = scenario.pod("ns", "p", template_name="t", cpu="2").spec
    decoded = decode_message(encode_message(PendingPod(pod=POD, claims=[], first_seen=0.0, spec=spec)))
    assert decoded.spec == spec
    # from a binder that predates the field: the shard reads the pod instead
    fields = msgspec.msgpack.decode(encode_message(PendingPod(pod=POD, claims=[], first_seen=0.0)))
    fields.pop("spec", None)
    old = msgspec.msgpack.encode(fields)
    assert decode_message(old).spec is None


def test_pods_whose_placement_counts_other_pods_share_their_namespaces_partition():
    from draplane.api.core import PodSpec

    def replica(i: int, spec: dict) -> PendingPod:
        return PendingPod(pod=PodRef(namespace="ns", name=f"web-{i}", uid=f"u{i}"),
                          claims=[ClaimRef(namespace="ns", name=f"web-{i}-gpu", uid=f"c{i}")], first_seen=0,
                          spec=msgspec.convert({"containers": [{"name": "c"}], **spec}, PodSpec))

    spread = {"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule",
                                             "labelSelector": {"matchLabels": {"app": "web"}}}],
              "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}]}
    anti = {"affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"app": "web"}}}]}}}
    assert {partition_key(replica(i, spread)) for i in range(8)} == {"constrained:ns"}
    assert {partition_key(replica(i, anti)) for i in range(8)} == {"constrained:ns"}
    # ScheduleAnyway and preferred terms score by the pods placed before (pod_scores): replicas on
    # two shards at once would each see the same empty node, so they share the namespace's shard too
    soft = {"topologySpreadConstraints": [{**spread["topologySpreadConstraints"][0], "whenUnsatisfiable": "ScheduleAnyway"}]}
    assert partition_key(replica(0, soft)) == "constrained:ns"
    preferred = {"affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 100, "podAffinityTerm": anti["affinity"]["podAntiAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"][0]}]}}}
    assert partition_key(replica(0, preferred)) == "constrained:ns"
    assert partition_key(replica(0, {})) == "ns/web-0-gpu"  # no constraint: the claims decide
    # a claim shared with other pods keeps the pod on the claim's shard
    shared = {**anti, "resourceClaims": [{"name": "gpu", "resourceClaimName": "web-0-gpu"}]}
    assert partition_key(replica(0, shared)) == "ns/web-0-gpu"
