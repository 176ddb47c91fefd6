"""The parts of core/v1 PersistentVolumeClaim and PersistentVolume, and storage.k8s.io/v1
StorageClass, CSINode, CSIDriver and VolumeAttachment, that kube-scheduler's volume plugins read.

Partial, like draplane.api.core: these are read, and written only through merge patches (a
PersistentVolume's claimRef, a claim's selected-node annotation), never by sending a decoded
object back, which would drop the fields not modelled here.
"""

from __future__ import annotations

import msgspec

from draplane.api.meta import Base, ListMeta, NodeSelector, ObjectMeta
from draplane.api.policy import LabelSelector

# Set by the PV controller on a claim once its binding is complete (kube-scheduler waits for it).
ANNOTATION_BIND_COMPLETED = "pv.kubernetes.io/bind-completed"
# Set by whoever bound a volume to a claim that did not name it (the PV controller, or a scheduler).
ANNOTATION_BOUND_BY_CONTROLLER = "pv.kubernetes.io/bound-by-controller"
# Set by a scheduler on a WaitForFirstConsumer claim to ask its provisioner for a volume there.
ANNOTATION_SELECTED_NODE = "volume.kubernetes.io/selected-node"
# The old way to name a class, read before spec.storageClassName, as Kubernetes still does.
ANNOTATION_BETA_STORAGE_CLASS = "volume.beta.kubernetes.io/storage-class"
# A StorageClass whose volumes are made by hand (local volumes): nothing provisions for it.
NO_PROVISIONER = "kubernetes.io/no-provisioner"


class ObjectReference(Base, kw_only=True):
    kind: str | None = None
    namespace: str | None = None
    name: str | None = None
    uid: str | None = None
    api_version: str | None = None
    resource_version: str | None = None


class VolumeResourceRequirements(Base, kw_only=True):
    requests: dict[str, str] | None = None
    limits: dict[str, str] | None = None


class PersistentVolumeClaimSpec(Base, kw_only=True):
    access_modes: list[str] | None = None
    selector: LabelSelector | None = None
    resources: VolumeResourceRequirements | None = None
    volume_name: str | None = None
    storage_class_name: str | None = None
    volume_mode: str | None = None
    volume_attributes_class_name: str | None = None


class PersistentVolumeClaimStatus(Base, kw_only=True):
    phase: str | None = None  # Pending, Bound or Lost


class PersistentVolumeClaim(Base, kw_only=True):
    api_version: str = msgspec.field(default_factory=lambda: "v1")
    kind: str = msgspec.field(default_factory=lambda: "PersistentVolumeClaim")
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: PersistentVolumeClaimSpec = msgspec.field(default_factory=PersistentVolumeClaimSpec)
    status: PersistentVolumeClaimStatus | None = None


class PersistentVolumeClaimList(Base, kw_only=True):
    metadata: ListMeta | None = None
    items: list[PersistentVolumeClaim] = msgspec.field(default_factory=list)


class VolumeNodeAffinity(Base, kw_only=True):
    required: NodeSelector | None = None


class CSIPersistentVolumeSource(Base, kw_only=True):
    driver: str
    volume_handle: str


class InTreeDiskSource(Base, kw_only=True):
    """The identity of an in-tree cloud disk that kube-scheduler counts as its CSI driver's
    (NodeVolumeLimits' migration); each source names it by one of these fields."""

    volume_id: str | None = msgspec.field(default=None, name="volumeID")
    pd_name: str | None = None
    disk_uri: str | None = msgspec.field(default=None, name="diskURI")


class PersistentVolumeSpec(Base, kw_only=True):
    capacity: dict[str, str] | None = None
    # the volume sources NodeVolumeLimits counts (the others decode to nothing): CSI, and the
    # in-tree cloud disks whose CSI migration kube-scheduler takes as on
    csi: CSIPersistentVolumeSource | None = None
    aws_elastic_block_store: InTreeDiskSource | None = None
    gce_persistent_disk: InTreeDiskSource | None = None
    azure_disk: InTreeDiskSource | None = None
    cinder: InTreeDiskSource | None = None
    portworx_volume: InTreeDiskSource | None = None
    access_modes: list[str] | None = None
    claim_ref: ObjectReference | None = None
    storage_class_name: str | None = None
    volume_mode: str | None = None
    node_affinity: VolumeNodeAffinity | None = None
    volume_attributes_class_name: str | None = None


class PersistentVolumeStatus(Base, kw_only=True):
    phase: str | None = None  # Pending, Available, Bound, Released or Failed


class PersistentVolume(Base, kw_only=True):
    api_version: str = msgspec.field(default_factory=lambda: "v1")
    kind: str = msgspec.field(default_factory=lambda: "PersistentVolume")
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: PersistentVolumeSpec = msgspec.field(default_factory=PersistentVolumeSpec)
    status: PersistentVolumeStatus | None = None


class PersistentVolumeList(Base, kw_only=True):
    metadata: ListMeta | None = None
    items: list[PersistentVolume] = msgspec.field(default_factory=list)


class TopologySelectorLabelRequirement(Base, kw_only=True):
    key: str
    values: list[str]


class TopologySelectorTerm(Base, kw_only=True):
    match_label_expressions: list[TopologySelectorLabelRequirement] | None = None


class StorageClass(Base, kw_only=True):
    api_version: str = msgspec.field(default_factory=lambda: "storage.k8s.io/v1")
    kind: str = msgspec.field(default_factory=lambda: "StorageClass")
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    provisioner: str = ""
    # Immediate (the apiserver's default) or WaitForFirstConsumer
    volume_binding_mode: str | None = None
    allowed_topologies: list[TopologySelectorTerm] | None = None


class StorageClassList(Base, kw_only=True):
    metadata: ListMeta | None = None
    items: list[StorageClass] = msgspec.field(default_factory=list)


class VolumeNodeResources(Base, kw_only=True):
    count: int | None = None  # how many of the driver's volumes the node can attach; None: no limit


class CSINodeDriver(Base, kw_only=True):
    name: str
    node_id: str = msgspec.field(default="", name="nodeID")
    topology_keys: list[str] | None = None
    allocatable: VolumeNodeResources | None = None


class CSINodeSpec(Base, kw_only=True):
    # null from a kubelet with no CSI driver registered yet (the apiserver keeps it so)
    drivers: list[CSINodeDriver] | None = None


class CSINode(Base, kw_only=True):
    """The CSI drivers registered on a node (named as the node), with their attach limits."""

    api_version: str = msgspec.field(default_factory=lambda: "storage.k8s.io/v1")
    kind: str = msgspec.field(default_factory=lambda: "CSINode")
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: CSINodeSpec = msgspec.field(default_factory=CSINodeSpec)


class CSINodeList(Base, kw_only=True):
    metadata: ListMeta | None = None
    items: list[CSINode] = msgspec.field(default_factory=list)


class CSIDriverSpec(Base, kw_only=True):
    # VolumeLimitScaling (beta, on in 1.37): a node whose CSINode lacks the driver takes no pod
    # with one of its volumes
    prevent_pod_scheduling_if_missing: bool | None = None


class CSIDriver(Base, kw_only=True):
    api_version: str = msgspec.field(default_factory=lambda: "storage.k8s.io/v1")
    kind: str = msgspec.field(default_factory=lambda: "CSIDriver")
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: CSIDriverSpec = msgspec.field(default_factory=CSIDriverSpec)


class CSIDriverList(Base, kw_only=True):
    metadata: ListMeta | None = None
    items: list[CSIDriver] = msgspec.field(default_factory=list)


class VolumeAttachmentSource(Base, kw_only=True):
    persistent_volume_name: str | None = None


class VolumeAttachmentSpec(Base, kw_only=True):
    attacher: str = ""
    source: VolumeAttachmentSource = msgspec.field(default_factory=VolumeAttachmentSource)
    node_name: str = ""


class VolumeAttachment(Base, kw_only=True):
    """A volume attached (or being attached or detached) to a node: it counts against the node's
    limit whether or not a pod there still uses it."""

    api_version: str = msgspec.field(default_factory=lambda: "storage.k8s.io/v1")
    kind: str = msgspec.field(default_factory=lambda: "VolumeAttachment")
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: VolumeAttachmentSpec = msgspec.field(default_factory=VolumeAttachmentSpec)


class VolumeAttachmentList(Base, kw_only=True):
    metadata: ListMeta | None = None
    items: list[VolumeAttachment] = msgspec.field(default_factory=list)
