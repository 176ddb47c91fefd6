"""VolumeBinding: where a pod's PersistentVolumeClaims let it run.

Split as kube-scheduler splits it, because the two halves run in different processes here:

- PreFilter (`pre_filter`, in the binder, which watches claims, volumes and classes): the pod's
  claims must exist, not be lost or being deleted, and every claim that binds immediately must be
  bound already. What the node-level half needs is summed up in a `PodVolumes`, which travels to
  the shard inside the PendingPod: bound claims with their volume's node affinity and zones, and
  WaitForFirstConsumer claims with the volumes that could take them and how to provision one.
- Filter (`filter_node`, in the shard, per node): a bound claim's volume must be reachable from the
  node; each unbound claim must find an available volume there (the smallest that fits, none
  chosen twice) or be provisionable there. Its answer for the chosen node is also the plan the
  binder carries out in PreBind (`plan_for_node`, after the runtime has run all four volume
  filters again), so both halves decide alike.

The binder's PreFilter also gathers what VolumeRestrictions, NodeVolumeLimits and VolumeZone read
on each node, since only it sees claims and volumes; their Filters are their own modules.

Reason strings and messages are kube-scheduler 1.37's. Not modelled: CSI storage capacity
(CSIStorageCapacity objects), CSI migration of in-tree volumes, and VolumeAttributesClass beyond
the equality check.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

import msgspec

from draplane.api.core import Pod
from draplane.api.meta import NodeSelector
from draplane.api.policy import LabelSelectorError, label_selector_matches
from draplane.api.quantity import QuantityError, parse_quantity
from draplane.api.storage import (
    ANNOTATION_BETA_STORAGE_CLASS, ANNOTATION_BIND_COMPLETED, ANNOTATION_SELECTED_NODE, NO_PROVISIONER,
    PersistentVolume, PersistentVolumeClaim, StorageClass, TopologySelectorTerm,
)
from draplane.component_helpers.errors import SpecError
from draplane.component_helpers.node_affinity import term_matches
from draplane.scheduling.framework.plugins import volume_zone
from draplane.scheduling.framework.plugins.volume_restrictions import READ_WRITE_ONCE_POD
from draplane.scheduling.framework.plugins.volume_zone import ZoneRequirement

NAME = "VolumeBinding"

# Filter reasons, in the order kube-scheduler appends them for one node.
REASON_NODE_CONFLICT = "node(s) didn't match PersistentVolume's node affinity"
REASON_BIND_CONFLICT = "node(s) didn't find available persistent volumes to bind"
REASON_PV_NOT_EXIST = "node(s) unavailable due to one or more pvc(s) bound to non-existent pv(s)"
REASON_UNBOUND_IMMEDIATE = "pod has unbound immediate PersistentVolumeClaims"

WAIT_FOR_FIRST_CONSUMER = "WaitForFirstConsumer"



class VolumeUnschedulable(Exception):
    """PreFilter's verdict: no node can take the pod until its claims change (the message is
    kube-scheduler's, and goes after `0/N nodes are available:`)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BoundVolume(msgspec.Struct, frozen=True, kw_only=True):
    """A claim bound to a volume: the node must satisfy the volume's node affinity and zones."""

    claim: str
    volume: str
    found: bool = True  # False: the claim names a volume that does not exist
    node_affinity: NodeSelector | None = None
    zones: tuple[ZoneRequirement, ...] = ()


class CandidateVolume(msgspec.Struct, frozen=True, kw_only=True):
    """An available volume that fits a claim in everything but the node (class, size, mode,
    access modes, selector); `prebound` when it names the claim already."""

    name: str
    capacity: int  # bytes
    node_affinity: NodeSelector | None = None
    prebound: bool = False


class UnboundClaim(msgspec.Struct, frozen=True, kw_only=True):
    """A WaitForFirstConsumer claim: bound to a candidate volume on the chosen node, or provisioned there."""

    claim: str
    request: int  # bytes
    candidates: tuple[CandidateVolume, ...] = ()
    # Set by an earlier scheduling attempt: the provisioner works on it, so only that node will do.
    selected_node: str | None = None
    provisioner: str = ""  # the class's; "" or kubernetes.io/no-provisioner cannot provision
    allowed_topologies: tuple[TopologySelectorTerm, ...] = ()


class PodVolumes(msgspec.Struct, frozen=True, kw_only=True):
    bound: tuple[BoundVolume, ...] = ()
    unbound: tuple[UnboundClaim, ...] = ()
    # VolumeRestrictions: the pod's ReadWriteOncePod claims that a scheduled pod uses already
    in_use_elsewhere: tuple[str, ...] = ()
    # NodeVolumeLimits: the nodes it refuses, with the reason (draplane.scheduling.framework.plugins.node_volume_limits)
    over_limit: dict[str, str] | None = None


class VolumePlan(msgspec.Struct, frozen=True, kw_only=True):
    """What PreBind does on the chosen node: bind these volumes to these claims, ask for these
    claims to be provisioned there."""

    bindings: tuple[tuple[str, str], ...] = ()  # (claim, volume)
    provisions: tuple[str, ...] = ()  # claims

    @property
    def empty(self) -> bool:
        return not self.bindings and not self.provisions


# --- PreFilter (the binder) ----------------------------------------------------------------------


def pod_claim_names(pod: Pod) -> list[tuple[str, bool]]:
    """The claims the pod's volumes use, in order: (name, from an ephemeral volume)."""
    names = []
    for volume in pod.spec.volumes or ():
        if volume.persistent_volume_claim is not None:
            names.append((volume.persistent_volume_claim.claim_name, False))
        elif volume.ephemeral is not None:
            names.append((f"{pod.metadata.name}-{volume.name}", True))
    return names


def claim_class(claim: PersistentVolumeClaim) -> str:
    annotations = claim.metadata.annotations or {}
    if ANNOTATION_BETA_STORAGE_CLASS in annotations:
        return annotations[ANNOTATION_BETA_STORAGE_CLASS]
    return claim.spec.storage_class_name or ""


def volume_class(volume: PersistentVolume) -> str:
    annotations = volume.metadata.annotations or {}
    if ANNOTATION_BETA_STORAGE_CLASS in annotations:
        return annotations[ANNOTATION_BETA_STORAGE_CLASS]
    return volume.spec.storage_class_name or ""


def is_fully_bound(claim: PersistentVolumeClaim) -> bool:
    """Bound by the PV controller to the end: what kube-scheduler's PreBind waits for."""
    return bool(claim.spec.volume_name) and ANNOTATION_BIND_COMPLETED in (claim.metadata.annotations or {})


def volume_is_bound_to(volume: PersistentVolume, claim: PersistentVolumeClaim) -> bool:
    ref = volume.spec.claim_ref
    if ref is None or ref.name != claim.metadata.name or ref.namespace != claim.metadata.namespace:
        return False
    return not ref.uid or ref.uid == claim.metadata.uid


def _bytes(text: str | None, *, round_up: bool) -> int:
    if not text:
        return 0
    try:
        value = parse_quantity(text).value
    except QuantityError:
        return 0  # the apiserver validated it; a value we cannot read must not crash the binder
    return -((-value.numerator) // value.denominator) if round_up else value.numerator // value.denominator


def owned_by(claim: PersistentVolumeClaim, pod: Pod) -> bool:
    return claim.metadata.namespace == pod.metadata.namespace and any(
        ref.controller and ref.uid == pod.metadata.uid for ref in claim.metadata.owner_references or ())


def pre_filter(pod: Pod, claims: Mapping[str, PersistentVolumeClaim], volumes: Mapping[str, PersistentVolume],
               classes: Mapping[str, StorageClass],
               used_by_other_pod: Callable[[str], bool] | None = None) -> PodVolumes | None:
    """VolumeRestrictions' and VolumeBinding's PreFilters over the pod's namespace's claims (by
    name), every volume and every class (by name). None when the pod uses no claim; raises
    VolumeUnschedulable when no node can take it. `used_by_other_pod(claim)`: whether a pod
    scheduled already (not this one) uses the claim, for ReadWriteOncePod claims."""
    names = pod_claim_names(pod)
    if not names:
        return None
    namespace, pod_name = pod.metadata.namespace, pod.metadata.name
    found: list[PersistentVolumeClaim] = []
    for name, ephemeral in names:
        claim = claims.get(name)
        if claim is None:
            if ephemeral:
                raise VolumeUnschedulable(f'waiting for ephemeral volume controller to create the '
                                          f'persistentvolumeclaim "{name}"')
            raise VolumeUnschedulable(f'persistentvolumeclaim "{name}" not found')
        if claim.status is not None and claim.status.phase == "Lost":
            raise VolumeUnschedulable(f'persistentvolumeclaim "{name}" bound to non-existent persistentvolume '
                                      f'"{claim.spec.volume_name or ""}"')
        if claim.metadata.deletion_timestamp:
            raise VolumeUnschedulable(f'persistentvolumeclaim "{name}" is being deleted')
        if ephemeral and not owned_by(claim, pod):
            raise VolumeUnschedulable(f"PVC {claim.metadata.namespace}/{name} was not created for pod "
                                      f"{namespace}/{pod_name} (pod is not owner)")
        found.append(claim)

    bound: list[BoundVolume] = []
    unbound: list[UnboundClaim] = []
    immediate = False
    for claim in found:
        name = claim.metadata.name or ""
        if is_fully_bound(claim):
            volume = volumes.get(claim.spec.volume_name or "")
            if volume is None:
                bound.append(BoundVolume(claim=name, volume=claim.spec.volume_name or "", found=False))
            else:
                bound.append(BoundVolume(
                    claim=name, volume=volume.metadata.name or "", zones=volume_zone.volume_zones(volume),
                    node_affinity=volume.spec.node_affinity.required if volume.spec.node_affinity else None))
            continue
        class_name = claim_class(claim)
        storage_class = classes.get(class_name) if class_name else None
        delayed = storage_class is not None and storage_class.volume_binding_mode == WAIT_FOR_FIRST_CONSUMER
        if not delayed or claim.spec.volume_name:
            immediate = True  # a pre-bound claim counts as immediate, as in kube-scheduler
            continue
        annotations = claim.metadata.annotations or {}
        request = _bytes((claim.spec.resources.requests or {}).get("storage") if claim.spec.resources else None,
                         round_up=True)
        unbound.append(UnboundClaim(
            claim=name, request=request, candidates=_candidates(claim, class_name, request, volumes.values()),
            selected_node=annotations.get(ANNOTATION_SELECTED_NODE),
            provisioner=storage_class.provisioner, allowed_topologies=tuple(storage_class.allowed_topologies or ())))
    if immediate:
        raise VolumeUnschedulable(REASON_UNBOUND_IMMEDIATE)
    in_use = tuple(c.metadata.name or "" for c in found if used_by_other_pod is not None
                   and READ_WRITE_ONCE_POD in (c.spec.access_modes or ()) and used_by_other_pod(c.metadata.name or ""))
    return PodVolumes(bound=tuple(bound), unbound=tuple(unbound), in_use_elsewhere=in_use)


def _candidates(claim: PersistentVolumeClaim, class_name: str, request: int,
                volumes: Iterable[PersistentVolume]) -> tuple[CandidateVolume, ...]:
    """FindMatchingVolume's checks that do not depend on the node, in a stable order (smallest
    first, then by name), so that every shard and the binder pick alike. `request`: bytes."""
    wanted_mode = claim.spec.volume_mode or "Filesystem"
    wanted_access = set(claim.spec.access_modes or ())
    out = []
    for volume in volumes:
        if volume_class(volume) != class_name:
            continue
        prebound = volume_is_bound_to(volume, claim)
        if volume.spec.claim_ref is not None and not prebound:
            continue
        capacity = _bytes((volume.spec.capacity or {}).get("storage"), round_up=False)
        if capacity < request or (volume.spec.volume_mode or "Filesystem") != wanted_mode:
            continue
        if (claim.spec.volume_attributes_class_name or "") != (volume.spec.volume_attributes_class_name or ""):
            continue
        if volume.metadata.deletion_timestamp:
            continue
        if not prebound:
            if volume.status is None or volume.status.phase != "Available":
                continue
            if claim.spec.selector is not None:
                try:
                    if not label_selector_matches(claim.spec.selector, volume.metadata.labels or {}):
                        continue
                except LabelSelectorError:
                    continue
            if not wanted_access <= set(volume.spec.access_modes or ()):
                continue
        out.append(CandidateVolume(
            name=volume.metadata.name or "", capacity=capacity, prebound=prebound,
            node_affinity=volume.spec.node_affinity.required if volume.spec.node_affinity else None))
    out.sort(key=lambda c: (c.capacity, c.name))
    return tuple(out)


# --- Filter (the shard), and PreBind's plan (the binder) ----------------------------------------


def _affinity_holds(selector: NodeSelector | None, labels: Mapping[str, str]) -> bool:
    """CheckNodeAffinity: the volume's required terms (ORed) against the node's labels alone, as
    kube-scheduler passes them (a matchFields term sees no node name, so it never matches)."""
    if selector is None:
        return True
    for term in selector.node_selector_terms:
        try:
            if term_matches(term, labels, ""):
                return True
        except SpecError:
            continue  # a term that cannot be read selects nothing, as in Kubernetes
    return False


def _topology_allows(terms: tuple[TopologySelectorTerm, ...], labels: Mapping[str, str]) -> bool:
    if not terms:
        return True
    for term in terms:
        expressions = term.match_label_expressions or ()
        if expressions and all(labels.get(e.key) in e.values for e in expressions):
            return True
    return False


def _matching_volume(claim: UnboundClaim, labels: Mapping[str, str], chosen: set[str]) -> str | None:
    smallest = None
    for candidate in claim.candidates:
        if candidate.name in chosen:
            continue
        reachable = _affinity_holds(candidate.node_affinity, labels)
        if candidate.prebound:
            # A volume that names the claim is the only one it may take.
            return candidate.name if reachable else None
        if reachable and smallest is None:
            smallest = candidate.name  # candidates come smallest first
    return smallest


def _provisionable(claim: UnboundClaim, labels: Mapping[str, str]) -> bool:
    if not claim.provisioner or claim.provisioner == NO_PROVISIONER:
        return False
    return _topology_allows(claim.allowed_topologies, labels)


def filter_node(volumes: PodVolumes, node: str, labels: Mapping[str, str]) -> tuple[list[str], VolumePlan]:
    """VolumeBinding's Filter for one node: its reasons (none: the node will do) and, when it
    will do, what PreBind must bind and provision there."""
    affinity_holds = volumes_found = unbound_satisfied = True
    bindings: list[tuple[str, str]] = []
    provisions: list[str] = []

    def reasons() -> list[str]:
        out = []
        if not affinity_holds:
            out.append(REASON_NODE_CONFLICT)
        if not unbound_satisfied:
            out.append(REASON_BIND_CONFLICT)
        if not volumes_found:
            out.append(REASON_PV_NOT_EXIST)
        return out

    for bound in volumes.bound:
        if not bound.found:
            volumes_found = False
            break
        if not _affinity_holds(bound.node_affinity, labels):
            affinity_holds = False
            break
    if volumes.unbound:
        to_match, to_provision = [], []
        for claim in volumes.unbound:
            if claim.selected_node is not None:
                if claim.selected_node != node:
                    unbound_satisfied = False
                    return reasons(), VolumePlan()
                to_provision.append(claim)
            else:
                to_match.append(claim)
        chosen: set[str] = set()
        for claim in sorted(to_match, key=lambda c: c.request):
            volume = _matching_volume(claim, labels, chosen)
            if volume is None:
                unbound_satisfied = False
                to_provision.append(claim)
                continue
            chosen.add(volume)
            bindings.append((claim.claim, volume))
        if to_provision:
            # kube-scheduler overwrites the matching verdict with the provisioning one: a claim no
            # volume fits is still fine when it can be provisioned on the node.
            unbound_satisfied = all(_provisionable(c, labels) for c in to_provision)
            provisions = [c.claim for c in to_provision if c.selected_node is None]
    found = reasons()
    if found:
        return found, VolumePlan()
    return [], VolumePlan(bindings=tuple(bindings), provisions=tuple(provisions))


def plan_for_node(volumes: PodVolumes | None, node: str, labels: Mapping[str, str]) -> VolumePlan | list[str]:
    """PreBind's plan on the chosen node, or VolumeBinding's reasons it no longer will do (the
    volumes changed since the shard looked). The runtime runs the other volume filters first."""
    if volumes is None:
        return VolumePlan()
    found, plan = filter_node(volumes, node, labels)
    return found or plan
