"""NodeVolumeLimits, pure: which volumes count against a node's CSI attach limits, and the nodes
it refuses, as kube-scheduler 1.37's CSILimits plugin decides (the differential against it is
test_kube_scheduler_parity.py)."""

from __future__ import annotations

from draplane.api.core import EphemeralVolumeSource, PersistentVolumeClaimVolumeSource, Pod, PodSpec, Volume
from draplane.api.meta import ObjectMeta, OwnerReference
from draplane.api.storage import (
    CSIDriver, CSIDriverSpec, CSINode, CSINodeDriver, CSINodeSpec, CSIPersistentVolumeSource, PersistentVolume,
    PersistentVolumeClaim, PersistentVolumeClaimSpec, PersistentVolumeSpec, StorageClass, VolumeNodeResources,
)
from draplane.scheduling.framework.plugins import node_volume_limits as nvl
from draplane.scheduling.framework.plugins import volume_binding as vb
from draplane.scheduling.framework.plugins import volume_restrictions
from draplane.scheduling.framework.runtime import volume_reasons

EBS = "ebs.csi.aws.com"
BLOCK = "block.csi.example.com"


def pod(name: str, *claims: str, node: str | None = None, ephemeral: tuple[str, ...] = ()) -> Pod:
    volumes = [Volume(name=f"v{i}", persistent_volume_claim=PersistentVolumeClaimVolumeSource(claim_name=c))
               for i, c in enumerate(claims)]
    volumes += [Volume(name=e, ephemeral=EphemeralVolumeSource(volume_claim_template={})) for e in ephemeral]
    volumes.append(Volume(name="scratch"))  # an emptyDir: never counted
    return Pod(metadata=ObjectMeta(name=name, namespace="ns", uid=f"uid-{name}"),
               spec=PodSpec(volumes=volumes, node_name=node))


def claim(name: str, *, volume: str | None = None, class_name: str | None = "block",
          owner: str | None = None) -> PersistentVolumeClaim:
    owners = [OwnerReference(api_version="v1", kind="Pod", name="x", uid=owner, controller=True)] if owner else None
    return PersistentVolumeClaim(metadata=ObjectMeta(name=name, namespace="ns", owner_references=owners),
                                 spec=PersistentVolumeClaimSpec(volume_name=volume, storage_class_name=class_name))


def csi_volume(name: str, driver: str = BLOCK, handle: str | None = None) -> PersistentVolume:
    return PersistentVolume(metadata=ObjectMeta(name=name), spec=PersistentVolumeSpec(
        csi=CSIPersistentVolumeSource(driver=driver, volume_handle=handle or f"handle-{name}")))


def csinode(node: str, **limits: int | None) -> CSINode:
    """limits: driver (dots as underscores) -> count, None for a driver registered without one."""
    return CSINode(metadata=ObjectMeta(name=node), spec=CSINodeSpec(drivers=[
        CSINodeDriver(name=name.replace("_", "."), node_id=node,
                      allocatable=VolumeNodeResources(count=count) if count is not None else None)
        for name, count in limits.items()]))


CLASSES = {
    "block": StorageClass(metadata=ObjectMeta(name="block"), provisioner=BLOCK),
    "gp2": StorageClass(metadata=ObjectMeta(name="gp2"), provisioner="kubernetes.io/aws-ebs"),
    "files": StorageClass(metadata=ObjectMeta(name="files"), provisioner="kubernetes.io/azure-file"),
}
BLOCK_KEY = BLOCK.replace(".", "_")


class Cluster:
    def __init__(self, *, claims=(), volumes=(), pods=(), csinodes=(), drivers=(), attachments=()):
        self.claims = {c.metadata.name: c for c in claims}
        self.volumes = {v.metadata.name: v for v in volumes}
        self.pods = list(pods)
        self.objects = nvl.VolumeObjects(
            claims=lambda namespace: self.claims if namespace == "ns" else {}, volumes=self.volumes, classes=CLASSES,
            csinodes={c.metadata.name: c for c in csinodes}, drivers=list(drivers),
            pods_on=lambda node: [p for p in self.pods if p.spec.node_name == node],
            attachments_on=lambda node: [(attacher, pv) for where, attacher, pv in attachments if where == node])

    def refused(self, new: Pod, nodes=("n1", "n2")) -> dict[str, str]:
        return nvl.nodes_over_limit(new, nodes, self.objects)


def test_a_node_at_its_limit_refuses_a_new_volume_and_takes_one_its_pods_use_already():
    cluster = Cluster(claims=[claim("a", volume="pv-a"), claim("b", volume="pv-b")],
                      volumes=[csi_volume("pv-a"), csi_volume("pv-b")],
                      pods=[pod("running", "a", node="n1")],
                      csinodes=[csinode("n1", **{BLOCK_KEY: 1}), csinode("n2", **{BLOCK_KEY: 1})])
    assert cluster.refused(pod("new", "b")) == {"n1": nvl.REASON_MAX_VOLUME_COUNT}
    # the same volume, used by the pod on n1: attached once, so n1 takes it
    assert cluster.refused(pod("shares", "a")) == {}


def test_the_limit_is_per_driver_and_a_node_without_limits_takes_any_number():
    cluster = Cluster(claims=[claim("a", volume="pv-a"), claim("e", volume="pv-e")],
                      volumes=[csi_volume("pv-a"), csi_volume("pv-e", driver=EBS)],
                      pods=[pod("running", "a", node="n1")],
                      csinodes=[csinode("n1", **{BLOCK_KEY: 1, "ebs_csi_aws_com": 5}), csinode("n2", **{BLOCK_KEY: None})])
    assert cluster.refused(pod("new", "e")) == {}  # EBS has room on n1; n2 sets no limit
    assert cluster.refused(pod("zero", "a", "e"), nodes=("n1",)) == {}  # a is attached already
    # a driver over its limit already (the limit lowered) refuses only pods adding its volumes
    cluster.objects.csinodes["n1"] = csinode("n1", **{BLOCK_KEY: 0, "ebs_csi_aws_com": 5})
    assert cluster.refused(pod("zero", "a", "e"), nodes=("n1",)) == {}
    cluster.objects.csinodes["n1"] = csinode("n1", **{BLOCK_KEY: 5, "ebs_csi_aws_com": 0})
    assert cluster.refused(pod("zero", "a", "e"), nodes=("n1",)) == {"n1": nvl.REASON_MAX_VOLUME_COUNT}


def test_an_attachment_counts_once_against_the_pods_but_not_against_the_new_pods_own_volume():
    claims = [claim("a", volume="pv-a"), claim("b", volume="pv-b")]
    volumes = [csi_volume("pv-a"), csi_volume("pv-b")]
    limits = [csinode("n1", **{BLOCK_KEY: 2})]
    # pv-a is attached to n1 and a pod there uses it: one volume in use, room for b
    cluster = Cluster(claims=claims, volumes=volumes, pods=[pod("running", "a", node="n1")], csinodes=limits,
                      attachments=[("n1", BLOCK, "pv-a")])
    assert cluster.refused(pod("new", "b"), nodes=("n1",)) == {}
    # pv-b still attached to n1 after its pod went: kube-scheduler counts the attachment and the
    # new pod's use of the same volume both (it does not match the two)
    cluster = Cluster(claims=claims, volumes=volumes, pods=[pod("running", "a", node="n1")], csinodes=limits,
                      attachments=[("n1", BLOCK, "pv-b")])
    assert cluster.refused(pod("new", "b"), nodes=("n1",)) == {"n1": nvl.REASON_MAX_VOLUME_COUNT}
    # an attachment of a volume that is not CSI, or gone, or without an attacher: not counted
    cluster = Cluster(claims=claims, volumes=volumes, csinodes=[csinode("n1", **{BLOCK_KEY: 1})],
                      attachments=[("n1", BLOCK, "gone"), ("n1", "", "pv-a")])
    assert cluster.refused(pod("new", "b"), nodes=("n1",)) == {}


def test_an_unbound_claim_counts_by_its_class_and_once_however_many_pods_mount_it():
    cluster = Cluster(claims=[claim("wait"), claim("other")], pods=[pod("running", "wait", node="n1")],
                      csinodes=[csinode("n1", **{BLOCK_KEY: 1})])
    assert cluster.refused(pod("same", "wait"), nodes=("n1",)) == {}
    assert cluster.refused(pod("new", "other"), nodes=("n1",)) == {"n1": nvl.REASON_MAX_VOLUME_COUNT}
    # no class, or a class that is gone: nothing to count it by
    orphan = Cluster(claims=[claim("x", class_name=None), claim("y", class_name="gone")],
                     csinodes=[csinode("n1", **{BLOCK_KEY: 0})])
    assert orphan.refused(pod("new", "x", "y"), nodes=("n1",)) == {}


def test_a_migrated_in_tree_provisioner_counts_as_its_csi_driver_only_where_the_node_has_a_csinode():
    cluster = Cluster(claims=[claim("disk", class_name="gp2"), claim("share", class_name="files")],
                      csinodes=[csinode("n1", ebs_csi_aws_com=0, file_csi_azure_com=0)])
    assert cluster.refused(pod("new", "disk"), nodes=("n1", "n2")) == {"n1": nvl.REASON_MAX_VOLUME_COUNT}
    # azure-file is translated but never counted
    assert cluster.refused(pod("new", "share"), nodes=("n1",)) == {}


def test_a_driver_that_must_be_registered_keeps_its_pods_off_nodes_without_it():
    strict = CSIDriver(metadata=ObjectMeta(name=BLOCK), spec=CSIDriverSpec(prevent_pod_scheduling_if_missing=True))
    relaxed = CSIDriver(metadata=ObjectMeta(name=BLOCK), spec=CSIDriverSpec())
    base = dict(claims=[claim("a", volume="pv-a")], volumes=[csi_volume("pv-a")],
                csinodes=[csinode("n1", **{BLOCK_KEY: None}), csinode("n2", ebs_csi_aws_com=3)])
    missing = f"{BLOCK} CSI driver is not installed on the node"
    assert Cluster(drivers=[strict], **base).refused(pod("new", "a"), nodes=("n1", "n2", "n3")) == {
        "n2": missing, "n3": missing}
    assert Cluster(drivers=[relaxed], **base).refused(pod("new", "a"), nodes=("n1", "n2", "n3")) == {}
    # a pod with no CSI volume is not held to it
    assert Cluster(drivers=[strict], **base).refused(pod("none"), nodes=("n2",)) == {}


def test_an_ephemeral_volume_counts_when_its_claim_is_the_pods_own():
    mine = claim("new-scratch2", owner="uid-new")
    theirs = claim("new-data", owner="uid-someone-else")
    cluster = Cluster(claims=[mine, theirs], csinodes=[csinode("n1", **{BLOCK_KEY: 0})])
    assert cluster.refused(pod("new", ephemeral=("scratch2",)), nodes=("n1",)) == {"n1": nvl.REASON_MAX_VOLUME_COUNT}
    assert cluster.refused(pod("new", ephemeral=("data",)), nodes=("n1",)) == {}


def test_the_pod_itself_on_the_node_is_not_counted_against_itself():
    # A placement tried again after its pod's volumes were held on the node
    cluster = Cluster(claims=[claim("a", volume="pv-a"), claim("b", volume="pv-b")],
                      volumes=[csi_volume("pv-a"), csi_volume("pv-b")],
                      pods=[pod("new", "a", "b", node="n1")], csinodes=[csinode("n1", **{BLOCK_KEY: 2})])
    assert cluster.refused(pod("new", "a", "b"), nodes=("n1",)) == {}


def test_filter_reads_the_node_only_when_it_limits_one_of_the_pods_drivers():
    wanted = {"x": nvl.AttachableVolume(BLOCK)}

    def never():
        raise AssertionError("asked what is attached to a node without limits for the pod's drivers")

    assert nvl.filter_node(wanted, None, frozenset(), never) is None
    assert nvl.filter_node(wanted, csinode("n1", ebs_csi_aws_com=0), frozenset(), never) is None


def test_the_shards_filter_gives_the_refused_nodes_their_reason_after_volume_restrictions():
    volumes = vb.PodVolumes(over_limit={"n1": nvl.REASON_MAX_VOLUME_COUNT})
    assert volume_reasons(volumes, "n1", {}) == [nvl.REASON_MAX_VOLUME_COUNT]
    assert volume_reasons(volumes, "n2", {}) == []
    both = vb.PodVolumes(over_limit={"n1": nvl.REASON_MAX_VOLUME_COUNT}, in_use_elsewhere=("rwop",))
    assert volume_reasons(both, "n1", {}) == [volume_restrictions.REASON_RWOP_CONFLICT]


def test_the_bound_on_volumes_in_use_never_changes_a_verdict():
    """nodes_over_limit with `at_most` (the binder's count of claims mounted on each node, plus its
    attachments) skips counting nodes far from their limits: on random clusters it refuses the
    same nodes, for the same reasons, as counting every node."""
    import random

    rng = random.Random(7)
    for _ in range(300):
        nodes = [f"n{i}" for i in range(4)]
        claims = [claim(f"c{i}", volume=f"pv{i}" if rng.random() < 0.7 else None,
                        class_name=rng.choice(["block", "gp2", None])) for i in range(8)]
        volumes = [csi_volume(f"pv{i}", driver=rng.choice([BLOCK, EBS]), handle=f"h{rng.randint(0, 5)}")
                   for i in range(8)]
        pods = [pod(f"p{i}", *rng.sample([c.metadata.name for c in claims], rng.randint(0, 3)),
                    node=rng.choice(nodes)) for i in range(rng.randint(0, 8))]
        attachments = [(rng.choice(nodes), rng.choice([BLOCK, EBS]), f"pv{rng.randint(0, 9)}")
                       for _ in range(rng.randint(0, 4))]
        csinodes = [csinode(n, **{BLOCK_KEY: rng.randint(0, 4), "ebs_csi_aws_com": rng.randint(0, 4)})
                    for n in nodes if rng.random() < 0.8]
        cluster = Cluster(claims=claims, volumes=volumes, pods=pods, csinodes=csinodes, attachments=attachments)
        new = pod("new", *rng.sample([c.metadata.name for c in claims], rng.randint(1, 3)))

        def at_most(node: str) -> int:
            return sum(len(vb.pod_claim_names(p)) for p in pods if p.spec.node_name == node) + \
                sum(1 for where, _, _ in attachments if where == node)

        assert nvl.nodes_over_limit(new, nodes, cluster.objects, at_most=at_most) == cluster.refused(new, nodes)


def test_a_kubelets_csinode_without_drivers_decodes_and_limits_nothing():
    """A kubelet writes its CSINode before any CSI driver registers, with `drivers: null`: it
    decodes (a list of them once broke the binder's CSINode watch, and with it every placement),
    sets no limit, and lacks every driver that must be there."""
    import msgspec

    from draplane.api.storage import CSINodeList

    (bare,) = msgspec.json.decode(
        b'{"items": [{"metadata": {"name": "n1"}, "spec": {"drivers": null}}]}', type=CSINodeList).items
    assert nvl.volume_limits(bare) == {}
    strict = CSIDriver(metadata=ObjectMeta(name=BLOCK), spec=CSIDriverSpec(prevent_pod_scheduling_if_missing=True))
    cluster = Cluster(claims=[claim("a", volume="pv-a")], volumes=[csi_volume("pv-a")], csinodes=[bare])
    assert cluster.refused(pod("new", "a"), nodes=("n1",)) == {}
    cluster.objects.drivers.append(strict)
    assert cluster.refused(pod("new", "a"), nodes=("n1",)) == {"n1": nvl.driver_missing(BLOCK)}


def test_an_in_tree_ebs_volume_counts_as_the_ebs_csi_drivers_where_the_node_has_a_csinode():
    """A gp2 claim, once bound, sits on a PersistentVolume with an awsElasticBlockStore source:
    kube-scheduler translates it and counts it as ebs.csi.aws.com's (on nodes with a CSINode)."""
    from draplane.api.storage import InTreeDiskSource

    def ebs(name: str, volume_id: str) -> PersistentVolume:
        return PersistentVolume(metadata=ObjectMeta(name=name), spec=PersistentVolumeSpec(
            aws_elastic_block_store=InTreeDiskSource(volume_id=volume_id)))

    cluster = Cluster(claims=[claim("a", volume="pv-a", class_name="gp2"), claim("b", volume="pv-b", class_name="gp2")],
                      volumes=[ebs("pv-a", "vol-0a"), ebs("pv-b", "vol-0b")], pods=[pod("running", "a", node="n1")],
                      csinodes=[csinode("n1", ebs_csi_aws_com=1)])
    assert cluster.refused(pod("new", "b"), nodes=("n1", "n2")) == {"n1": nvl.REASON_MAX_VOLUME_COUNT}
    assert cluster.refused(pod("shares", "a"), nodes=("n1",)) == {}  # the same disk: attached once
