"""VolumeBinding and VolumeZone, pure: PreFilter's verdicts and messages, Filter's reasons per
node, and the plan PreBind carries out, as kube-scheduler 1.37 decides them."""

from __future__ import annotations

import msgspec
import pytest

from draplane.api.core import (
    EphemeralVolumeSource, PersistentVolumeClaimVolumeSource, Pod, PodSpec, Volume,
)
from draplane.api.meta import NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, ObjectMeta, OwnerReference
from draplane.api.policy import LabelSelector
from draplane.api.storage import (
    ANNOTATION_BIND_COMPLETED, ANNOTATION_SELECTED_NODE, ObjectReference, PersistentVolume, PersistentVolumeClaim,
    PersistentVolumeClaimSpec, PersistentVolumeClaimStatus, PersistentVolumeSpec, PersistentVolumeStatus,
    StorageClass, TopologySelectorLabelRequirement, TopologySelectorTerm, VolumeNodeAffinity,
    VolumeResourceRequirements,
)
from draplane.scheduling.framework.plugins import volume_binding as vb
from draplane.scheduling.framework.plugins import volume_restrictions, volume_zone
from draplane.scheduling.framework.runtime import volume_plan, volume_reasons
from draplane.scheduling.messages import PendingPod, PodRef, decode_message, encode_message

HOST = "kubernetes.io/hostname"


def pod(*claims: str, ephemeral: tuple[str, ...] = (), uid: str = "pod-uid") -> Pod:
    volumes = [Volume(name=f"v{i}", persistent_volume_claim=PersistentVolumeClaimVolumeSource(claim_name=c))
               for i, c in enumerate(claims)]
    volumes += [Volume(name=name, ephemeral=EphemeralVolumeSource(volume_claim_template={})) for name in ephemeral]
    volumes.append(Volume(name="scratch"))  # an emptyDir: no claim
    return Pod(metadata=ObjectMeta(name="web", namespace="ns", uid=uid), spec=PodSpec(volumes=volumes))


def claim(name: str, *, size: str = "1Gi", class_name: str | None = "wffc", volume: str | None = None,
          bound: bool = False, phase: str | None = None, annotations: dict | None = None, deleting: bool = False,
          access: tuple[str, ...] = ("ReadWriteOnce",), selector: LabelSelector | None = None,
          owner: str | None = None) -> PersistentVolumeClaim:
    notes = dict(annotations or {})
    if bound:
        notes[ANNOTATION_BIND_COMPLETED] = "yes"
    return PersistentVolumeClaim(
        metadata=ObjectMeta(name=name, namespace="ns", uid=f"uid-{name}", annotations=notes or None,
                            deletion_timestamp="2026-01-01T00:00:00Z" if deleting else None,
                            owner_references=[OwnerReference(api_version="v1", kind="Pod", name="web", uid=owner,
                                                             controller=True)] if owner else None),
        spec=PersistentVolumeClaimSpec(access_modes=list(access), storage_class_name=class_name, volume_name=volume,
                                       selector=selector,
                                       resources=VolumeResourceRequirements(requests={"storage": size})),
        status=PersistentVolumeClaimStatus(phase=phase) if phase else None,
    )


def on_nodes(*names: str) -> VolumeNodeAffinity:
    return VolumeNodeAffinity(required=NodeSelector(node_selector_terms=[NodeSelectorTerm(match_expressions=[
        NodeSelectorRequirement(key=HOST, operator="In", values=list(names))])]))


def volume(name: str, *, size: str = "1Gi", class_name: str = "wffc", nodes: tuple[str, ...] = (),
           phase: str = "Available", claim_ref: str | None = None, labels: dict | None = None,
           access: tuple[str, ...] = ("ReadWriteOnce",), mode: str | None = None) -> PersistentVolume:
    return PersistentVolume(
        metadata=ObjectMeta(name=name, labels=labels),
        spec=PersistentVolumeSpec(capacity={"storage": size}, access_modes=list(access), storage_class_name=class_name,
                                  node_affinity=on_nodes(*nodes) if nodes else None, volume_mode=mode,
                                  claim_ref=ObjectReference(namespace="ns", name=claim_ref) if claim_ref else None),
        status=PersistentVolumeStatus(phase=phase),
    )


def classes(provisioner: str = "kubernetes.io/no-provisioner", topologies=None) -> dict[str, StorageClass]:
    return {
        "wffc": StorageClass(metadata=ObjectMeta(name="wffc"), provisioner=provisioner,
                             volume_binding_mode="WaitForFirstConsumer", allowed_topologies=topologies),
        "now": StorageClass(metadata=ObjectMeta(name="now"), provisioner="example.com/disk",
                            volume_binding_mode="Immediate"),
    }


def by_name(*objects):
    return {o.metadata.name: o for o in objects}


def labels(node: str, **extra) -> dict[str, str]:
    return {HOST: node, **extra}


# --- PreFilter -----------------------------------------------------------------------------------


def test_a_pod_without_claims_has_nothing_to_filter():
    assert vb.pre_filter(pod(), {}, {}, classes()) is None


@pytest.mark.parametrize("claims, message", [
    ({}, 'persistentvolumeclaim "data" not found'),
    ({"data": claim("data", phase="Lost", volume="gone")},
     'persistentvolumeclaim "data" bound to non-existent persistentvolume "gone"'),
    ({"data": claim("data", deleting=True)}, 'persistentvolumeclaim "data" is being deleted'),
    ({"data": claim("data", class_name="now")}, "pod has unbound immediate PersistentVolumeClaims"),
    # no class, or a class that does not exist: immediate binding
    ({"data": claim("data", class_name=None)}, "pod has unbound immediate PersistentVolumeClaims"),
    ({"data": claim("data", class_name="missing")}, "pod has unbound immediate PersistentVolumeClaims"),
    # pre-bound to a volume, not bound yet: counted as immediate, as kube-scheduler does
    ({"data": claim("data", volume="pv-1")}, "pod has unbound immediate PersistentVolumeClaims"),
])
def test_pre_filter_rejects_with_kube_schedulers_message(claims, message):
    with pytest.raises(vb.VolumeUnschedulable) as raised:
        vb.pre_filter(pod("data"), claims, {}, classes())
    assert raised.value.message == message


def test_ephemeral_volumes_read_the_claim_named_after_the_pod_and_must_own_it():
    with pytest.raises(vb.VolumeUnschedulable, match='waiting for ephemeral volume controller to create the '
                                                     'persistentvolumeclaim "web-cache"'):
        vb.pre_filter(pod(ephemeral=("cache",)), {}, {}, classes())
    stranger = claim("web-cache", owner="someone-else")
    with pytest.raises(vb.VolumeUnschedulable, match=r"PVC ns/web-cache was not created for pod ns/web \(pod is not owner\)"):
        vb.pre_filter(pod(ephemeral=("cache",)), {"web-cache": stranger}, {}, classes())
    mine = claim("web-cache", owner="pod-uid")
    got = vb.pre_filter(pod(ephemeral=("cache",)), {"web-cache": mine}, {}, classes())
    assert [u.claim for u in got.unbound] == ["web-cache"]


def test_the_first_problem_in_volume_order_is_reported():
    claims = {"b": claim("b", deleting=True)}
    with pytest.raises(vb.VolumeUnschedulable, match='"a" not found'):
        vb.pre_filter(pod("a", "b"), claims, {}, classes())


def test_bound_claims_carry_their_volumes_node_affinity_and_zones():
    pv = volume("pv-1", nodes=("n2",), labels={"topology.kubernetes.io/zone": "z1__z2"})
    got = vb.pre_filter(pod("data"), {"data": claim("data", volume="pv-1", bound=True)}, {"pv-1": pv}, classes())
    (bound,) = got.bound
    assert bound.volume == "pv-1" and bound.found
    assert bound.zones == (volume_zone.ZoneRequirement("topology.kubernetes.io/zone", ("z1", "z2")),)
    assert volume_reasons(got, "n2", labels("n2")) == []
    assert volume_reasons(got, "n1", labels("n1")) == [vb.REASON_NODE_CONFLICT]


def test_a_claim_bound_to_a_volume_that_does_not_exist_fails_every_node():
    got = vb.pre_filter(pod("data"), {"data": claim("data", volume="gone", bound=True)}, {}, classes())
    assert volume_reasons(got, "n1", labels("n1")) == [vb.REASON_PV_NOT_EXIST]


def test_candidates_leave_out_what_cannot_fit_the_claim_on_any_node():
    pvs = by_name(
        volume("small", size="500Mi"),
        volume("other-class", class_name="fast"),
        volume("taken", claim_ref="someone"),
        volume("released", phase="Released"),
        volume("block", mode="Block"),
        volume("read-many-only", access=("ReadOnlyMany",)),
        volume("fits-big", size="10Gi"),
        volume("fits", size="2Gi"),
        volume("fits-too", size="2Gi"),
    )
    got = vb.pre_filter(pod("data"), {"data": claim("data")}, pvs, classes())
    (unbound,) = got.unbound
    assert [c.name for c in unbound.candidates] == ["fits", "fits-too", "fits-big"]  # smallest first, then by name


def test_a_claims_selector_picks_among_volumes():
    pvs = by_name(volume("a", labels={"tier": "slow"}), volume("b", labels={"tier": "fast"}))
    data = claim("data", selector=LabelSelector(match_labels={"tier": "fast"}))
    (unbound,) = vb.pre_filter(pod("data"), {"data": data}, pvs, classes()).unbound
    assert [c.name for c in unbound.candidates] == ["b"]


# --- Filter and the plan -------------------------------------------------------------------------


def test_the_smallest_volume_reachable_from_the_node_is_bound():
    pvs = by_name(volume("big-on-n1", size="10Gi", nodes=("n1",)), volume("small-on-n2", size="1Gi", nodes=("n2",)),
                  volume("mid-on-n1", size="5Gi", nodes=("n1",)))
    got = vb.pre_filter(pod("data"), {"data": claim("data")}, pvs, classes())
    assert vb.filter_node(got, "n1", labels("n1")) == ([], vb.VolumePlan(bindings=(("data", "mid-on-n1"),)))
    assert vb.filter_node(got, "n2", labels("n2")) == ([], vb.VolumePlan(bindings=(("data", "small-on-n2"),)))
    assert vb.filter_node(got, "n3", labels("n3"))[0] == [vb.REASON_BIND_CONFLICT]


def test_two_claims_never_get_one_volume_and_the_smaller_claim_chooses_first():
    pvs = by_name(volume("pv-2g", size="2Gi", nodes=("n1",)), volume("pv-5g", size="5Gi", nodes=("n1",)))
    claims = {"big": claim("big", size="2Gi"), "small": claim("small", size="1Gi")}
    got = vb.pre_filter(pod("big", "small"), claims, pvs, classes())
    reasons, plan = vb.filter_node(got, "n1", labels("n1"))
    assert reasons == [] and sorted(plan.bindings) == [("big", "pv-5g"), ("small", "pv-2g")]
    only_one = vb.pre_filter(pod("big", "small"), claims, by_name(volume("pv-5g", size="5Gi")), classes())
    assert vb.filter_node(only_one, "n1", labels("n1"))[0] == [vb.REASON_BIND_CONFLICT]


def test_a_volume_that_names_the_claim_is_the_only_one_it_takes():
    pvs = by_name(volume("mine", nodes=("n2",), claim_ref="data", phase="Pending"), volume("free", nodes=("n1",)))
    got = vb.pre_filter(pod("data"), {"data": claim("data")}, pvs, classes())
    assert vb.filter_node(got, "n2", labels("n2")) == ([], vb.VolumePlan(bindings=(("data", "mine"),)))
    assert vb.filter_node(got, "n1", labels("n1"))[0] == [vb.REASON_BIND_CONFLICT]


def test_a_claim_no_volume_fits_is_provisioned_where_the_class_allows():
    topologies = [TopologySelectorTerm(match_label_expressions=[
        TopologySelectorLabelRequirement(key="zone", values=["a"])])]
    got = vb.pre_filter(pod("data"), {"data": claim("data")}, {}, classes("example.com/disk", topologies))
    assert vb.filter_node(got, "n1", labels("n1", zone="a")) == ([], vb.VolumePlan(provisions=("data",)))
    assert vb.filter_node(got, "n2", labels("n2", zone="b"))[0] == [vb.REASON_BIND_CONFLICT]
    # no provisioner: only static volumes will do
    nothing = vb.pre_filter(pod("data"), {"data": claim("data")}, {}, classes())
    assert vb.filter_node(nothing, "n1", labels("n1"))[0] == [vb.REASON_BIND_CONFLICT]


def test_a_claim_being_provisioned_holds_the_pod_to_its_selected_node():
    data = claim("data", annotations={ANNOTATION_SELECTED_NODE: "n2"})
    got = vb.pre_filter(pod("data"), {"data": data}, {}, classes("example.com/disk"))
    assert vb.filter_node(got, "n2", labels("n2")) == ([], vb.VolumePlan())  # asked already: nothing more to write
    assert vb.filter_node(got, "n1", labels("n1"))[0] == [vb.REASON_BIND_CONFLICT]


def test_reasons_come_in_kube_schedulers_order():
    claims = {"bound": claim("bound", volume="pv-far", bound=True), "new": claim("new")}
    got = vb.pre_filter(pod("bound", "new"), claims, by_name(volume("pv-far", nodes=("n9",), claim_ref="bound")),
                        classes())
    assert vb.filter_node(got, "n1", labels("n1"))[0] == [vb.REASON_NODE_CONFLICT, vb.REASON_BIND_CONFLICT]


def test_volume_zone_compares_bound_volumes_zone_with_the_nodes_and_ignores_zoneless_nodes():
    pv = volume("pv", labels={"failure-domain.beta.kubernetes.io/zone": "z1"})
    got = vb.pre_filter(pod("data"), {"data": claim("data", volume="pv", bound=True)}, {"pv": pv}, classes())
    assert volume_reasons(got, "n1", labels("n1", **{"topology.kubernetes.io/zone": "z1"})) == []
    assert volume_reasons(got, "n1", labels("n1", **{"topology.kubernetes.io/zone": "z2"})) == [volume_zone.REASON]
    assert volume_reasons(got, "n1", labels("n1")) == []


def test_the_plan_on_a_node_that_no_longer_fits_is_its_reasons():
    got = vb.pre_filter(pod("data"), {"data": claim("data")}, by_name(volume("pv", nodes=("n1",))), classes())
    assert volume_plan(got, "n2", labels("n2")) == [vb.REASON_BIND_CONFLICT]
    assert volume_plan(None, "n2", labels("n2")) == vb.VolumePlan()


def test_pod_volumes_travel_in_the_pending_pod():
    got = vb.pre_filter(pod("data"), {"data": claim("data")}, by_name(volume("pv", nodes=("n1",))), classes())
    pending = PendingPod(pod=PodRef(namespace="ns", name="web", uid="u"), claims=[], first_seen=0.0,
                         spec=pod("data").spec, volumes=got)
    decoded = decode_message(encode_message(pending))
    assert decoded.volumes == got
    assert msgspec.json.decode(msgspec.json.encode(pod("data")), type=Pod).spec.volumes[0].persistent_volume_claim \
        .claim_name == "data"


def test_a_read_write_once_pod_claim_another_scheduled_pod_uses_fails_every_node_first():
    data = claim("data", volume="pv", bound=True, access=("ReadWriteOncePod",))
    pv = volume("pv", nodes=("n9",), access=("ReadWriteOncePod",))
    got = vb.pre_filter(pod("data"), {"data": data}, {"pv": pv}, classes(), lambda name: name == "data")
    assert got.in_use_elsewhere == ("data",)
    assert volume_reasons(got, "n1", labels("n1")) == [volume_restrictions.REASON_RWOP_CONFLICT]  # before the volume's affinity
    free = vb.pre_filter(pod("data"), {"data": data}, {"pv": pv}, classes(), lambda name: False)
    assert volume_reasons(free, "n9", labels("n9")) == []
    # a ReadWriteOnce claim may be shared by pods on one node: not this plugin's business
    shared = claim("data", volume="pv", bound=True)
    assert vb.pre_filter(pod("data"), {"data": shared}, {"pv": pv}, classes(), lambda name: True).in_use_elsewhere == ()
