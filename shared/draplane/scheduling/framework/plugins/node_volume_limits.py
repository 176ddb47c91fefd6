"""kube-scheduler's NodeVolumeLimits (its CSILimits plugin): a node takes no more of a CSI
driver's volumes than its CSINode's `allocatable.count` for that driver.

A node's count of a driver is its volumes in use, each counted once by driver and volume handle:
those of the pods on the node, then those of the node's VolumeAttachments that no pod there
uses (a volume still attached after its pod went). The pod's own volumes count unless a pod on
the node uses them already. With VolumeLimitScaling (beta, on in kube-scheduler 1.37), a driver
whose CSIDriver sets `preventPodSchedulingIfMissing` keeps its volumes' pods off nodes whose
CSINode does not list it.

A volume is counted when it is a claim's: bound to a CSI PersistentVolume (driver and handle), or
not bound yet, with a StorageClass whose provisioner names the driver (the handle is then the
claim's own name, so one claim counts once). Claims of the in-tree provisioners kube-scheduler
migrates to CSI count as their CSI driver's, on nodes with a CSINode, and so do PersistentVolumes
of those in-tree cloud disks (awsElasticBlockStore, gcePersistentDisk, azureDisk, cinder,
portworxVolume). Not modelled: such disks inline in a pod's volumes (draplane does not decode
them), and, as in kube-scheduler, VolumeAttachments of in-tree PersistentVolumes.

The binder evaluates it, holding the claims, volumes, classes, CSINodes and attachments, when it
publishes a pending pod (the nodes it refuses go in PodVolumes.over_limit, which the shard's
Filter reads) and again in PreBind, counting the pods it is binding meanwhile.

Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping

import msgspec

from draplane.api.core import Pod
from draplane.api.storage import CSIDriver, CSINode, PersistentVolume, PersistentVolumeClaim, StorageClass
from draplane.scheduling.framework.plugins import volume_binding

NAME = "NodeVolumeLimits"
REASON_MAX_VOLUME_COUNT = "node(s) exceed max volume count"

# The in-tree provisioners that kube-scheduler translates to a CSI driver and counts
# (csi-translation-lib's names; isCSIMigrationOn: azure-file and vsphere-volume are translated
# but never counted).
MIGRATED_PROVISIONERS = {
    "kubernetes.io/aws-ebs": "ebs.csi.aws.com",
    "kubernetes.io/gce-pd": "pd.csi.storage.gke.io",
    "kubernetes.io/azure-disk": "disk.csi.azure.com",
    "kubernetes.io/cinder": "cinder.csi.openstack.org",
    "kubernetes.io/portworx-volume": "pxd.portworx.com",
}
_TRANSLATED_NOT_COUNTED = frozenset({"kubernetes.io/azure-file", "kubernetes.io/vsphere-volume"})

# The handle of a claim not bound yet: no real volume's (kube-scheduler draws a random prefix).
_UNBOUND_HANDLE = "\x00unbound:"


def driver_missing(driver: str) -> str:
    """The reason for a node whose CSINode lacks a driver that prevents scheduling without it."""
    return f"{driver} CSI driver is not installed on the node"


class AttachableVolume(msgspec.Struct, frozen=True, array_like=True):
    driver: str
    # counted only on a node with a CSINode: an in-tree provisioner's claim (its migration is
    # known to be on only where the node registered its drivers)
    needs_csinode: bool = False


def volume_unique_name(driver: str, handle: str) -> str:
    return f"{driver}/{handle}"


def uses_claims(pod: Pod) -> bool:
    """PreFilter: a pod without claims in its volumes skips the plugin."""
    return bool(volume_binding.pod_claim_names(pod))


def _from_class(claim: PersistentVolumeClaim, classes: Mapping[str, StorageClass]) -> tuple[str, AttachableVolume] | None:
    storage_class = classes.get(volume_binding.claim_class(claim))
    if storage_class is None:
        return None
    handle = f"{_UNBOUND_HANDLE}{claim.metadata.namespace}/{claim.metadata.name}"
    provisioner = storage_class.provisioner
    if provisioner in MIGRATED_PROVISIONERS:
        driver = MIGRATED_PROVISIONERS[provisioner]
        return volume_unique_name(driver, handle), AttachableVolume(driver, needs_csinode=True)
    if provisioner in _TRANSLATED_NOT_COUNTED or not provisioner:
        return None
    return volume_unique_name(provisioner, handle), AttachableVolume(provisioner)


def _migrated(volume: PersistentVolume) -> tuple[str, AttachableVolume] | None:
    """An in-tree cloud disk PersistentVolume, as kube-scheduler translates it to CSI: counted as
    its driver's on nodes with a CSINode, by the disk's own identity."""
    spec = volume.spec
    for source, plugin, handle in (
            (spec.aws_elastic_block_store, "kubernetes.io/aws-ebs", lambda d: d.volume_id),
            (spec.gce_persistent_disk, "kubernetes.io/gce-pd", lambda d: d.pd_name),
            (spec.azure_disk, "kubernetes.io/azure-disk", lambda d: d.disk_uri),
            (spec.cinder, "kubernetes.io/cinder", lambda d: d.volume_id),
            (spec.portworx_volume, "kubernetes.io/portworx-volume", lambda d: d.volume_id)):
        if source is not None:
            driver = MIGRATED_PROVISIONERS[plugin]
            return (volume_unique_name(driver, handle(source) or volume.metadata.name or ""),
                    AttachableVolume(driver, needs_csinode=True))
    return None


def attachable_volumes(pod: Pod, claims: Mapping[str, PersistentVolumeClaim], volumes: Mapping[str, PersistentVolume],
                       classes: Mapping[str, StorageClass]) -> dict[str, AttachableVolume]:
    """The pod's volumes that count against attach limits, by unique name (driver/handle).

    `claims` are the pod's namespace's, by name. A claim that is missing, or an ephemeral volume's
    claim another pod owns, is not counted (for the pod being placed, VolumeBinding's PreFilter
    has refused it already)."""
    found: dict[str, AttachableVolume] = {}
    for name, ephemeral in volume_binding.pod_claim_names(pod):
        claim = claims.get(name)
        if claim is None or (ephemeral and not volume_binding.owned_by(claim, pod)):
            continue
        counted: tuple[str, AttachableVolume] | None
        volume = volumes.get(claim.spec.volume_name) if claim.spec.volume_name else None
        if volume is None:
            # not bound yet, or bound to a volume not seen: by its class, as kube-scheduler does
            counted = _from_class(claim, classes)
        elif volume.spec.csi is not None:
            counted = (volume_unique_name(volume.spec.csi.driver, volume.spec.csi.volume_handle),
                       AttachableVolume(volume.spec.csi.driver))
        else:
            counted = _migrated(volume)
        if counted is not None:
            found[counted[0]] = counted[1]
    return found


def attached_by_attachments(node: str, attachments: Iterable[tuple[str, str]],
                            volumes: Mapping[str, PersistentVolume]) -> dict[str, str]:
    """The node's VolumeAttachments, as (attacher, PersistentVolume name), by unique name ->
    driver: those of CSI volumes that exist."""
    found = {}
    for attacher, volume_name in attachments:
        volume = volumes.get(volume_name)
        if not attacher or volume is None or volume.spec.csi is None:
            continue
        found[volume_unique_name(attacher, volume.spec.csi.volume_handle)] = attacher
    return found


def volume_limits(csinode: CSINode | None) -> dict[str, int]:
    if csinode is None:
        return {}
    return {d.name: d.allocatable.count for d in csinode.spec.drivers or ()
            if d.allocatable is not None and d.allocatable.count is not None}


def drivers_required_on_node(drivers: Iterable[CSIDriver]) -> frozenset[str]:
    """The CSI drivers that keep their volumes' pods off nodes that lack them."""
    return frozenset(d.metadata.name or "" for d in drivers if d.spec.prevent_pod_scheduling_if_missing)


class Attached(msgspec.Struct, frozen=True, kw_only=True):
    """What is in use on a node, by unique name -> driver."""

    by_pods: dict[str, str]
    by_attachments: dict[str, str]


def filter_node(wanted: Mapping[str, AttachableVolume], csinode: CSINode | None, required_drivers: frozenset[str],
                attached: Callable[[], Attached], at_most: int | None = None) -> str | None:
    """The Filter for one node: its reason, or None when the node takes the pod's volumes.
    `attached` is asked only when the node has limits for them, and only when `at_most` (a bound
    on the volumes in use there: its pods' claims and its attachments, each counted, duplicates
    too) plus the pod's new volumes could pass one of those limits."""
    new = {name: v.driver for name, v in wanted.items() if csinode is not None or not v.needs_csinode}
    if not new:
        return None
    if required_drivers:
        registered = {d.name for d in csinode.spec.drivers or ()} if csinode is not None else set()
        for driver in sorted(set(new.values())):
            if driver in required_drivers and driver not in registered:
                return driver_missing(driver)
    limits = volume_limits(csinode)
    limited = [limits[driver] for driver in set(new.values()) if driver in limits]
    if not limited:
        return None
    if at_most is not None and at_most + len(new) <= min(limited):
        return None  # even every volume there of the pod's drivers leaves room for all of its own
    in_use = attached()
    count: dict[str, int] = {}
    for name, driver in in_use.by_pods.items():
        new.pop(name, None)  # a volume a pod here uses already is not attached again
        count[driver] = count.get(driver, 0) + 1
    for name, driver in in_use.by_attachments.items():
        if name not in in_use.by_pods:
            count[driver] = count.get(driver, 0) + 1
    adding: dict[str, int] = {}
    for driver in new.values():
        adding[driver] = adding.get(driver, 0) + 1
    for driver, more in adding.items():
        limit = limits.get(driver)
        if limit is not None and count.get(driver, 0) + more > limit:
            return REASON_MAX_VOLUME_COUNT
    return None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class VolumeObjects:
    """What the plugin reads of the cluster. `claims(namespace)`: that namespace's claims by name;
    `pods_on(node)`: the pods on the node (scheduled, not finished: kube-scheduler's node info);
    `attachments_on(node)`: its VolumeAttachments as (attacher, PersistentVolume name)."""

    claims: Callable[[str], Mapping[str, PersistentVolumeClaim]]
    volumes: Mapping[str, PersistentVolume]
    classes: Mapping[str, StorageClass]
    csinodes: Mapping[str, CSINode]
    drivers: Iterable[CSIDriver]
    pods_on: Callable[[str], Iterable[Pod]]
    attachments_on: Callable[[str], Iterable[tuple[str, str]]]

    def attachable(self, pod: Pod) -> dict[str, AttachableVolume]:
        return attachable_volumes(pod, self.claims(pod.metadata.namespace or "default"), self.volumes, self.classes)

    def attached(self, node: str, *, without: str | None = None) -> Attached:
        """What the node's pods (but the one named by uid `without`) and attachments use."""
        by_pods: dict[str, str] = {}
        for other in self.pods_on(node):
            if other.metadata.uid != without:
                by_pods.update((name, volume.driver) for name, volume in self.attachable(other).items())
        return Attached(by_pods=by_pods,
                        by_attachments=attached_by_attachments(node, self.attachments_on(node), self.volumes))


def nodes_over_limit(pod: Pod, nodes: Iterable[str], objects: VolumeObjects,
                     at_most: Callable[[str], int] | None = None) -> dict[str, str]:
    """The Filter over `nodes`: those it refuses, with why. `at_most(node)`: a bound on the
    volumes in use there (filter_node), which spares counting them on nodes far from a limit."""
    wanted = objects.attachable(pod)
    if not wanted:
        return {}
    required = drivers_required_on_node(objects.drivers)
    refused = {}
    for node in nodes:
        why = filter_node(wanted, objects.csinodes.get(node), required,
                          lambda node=node: objects.attached(node, without=pod.metadata.uid),
                          at_most(node) if at_most is not None else None)
        if why is not None:
            refused[node] = why
    return refused


def filter_over_limit(over_limit: Mapping[str, str] | None, node: str) -> str | None:
    """The shard's Filter: the binder found the node over its limit (nodes_over_limit)."""
    return over_limit.get(node) if over_limit else None
