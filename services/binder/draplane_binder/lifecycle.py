"""The claim lifecycle the resourceclaim controller runs in a full cluster, as pure decisions.

Where no kube-controller-manager runs (the local environment), the binder does its job: create
claims from ResourceClaimTemplates, record them in the pod's status, drop `reservedFor` entries of
pods that are gone or finished, deallocate claims nobody reserves, and delete template claims whose
pod is gone (there is no garbage collector either). Each function takes objects and returns what to
change; the asyncio shell applies it.
"""

from __future__ import annotations

from datetime import datetime
from collections.abc import Iterable, Mapping

import msgspec

from draplane.api.core import Pod, PodResourceClaimStatus
from draplane.api.meta import ObjectMeta, OwnerReference
from draplane.api.resource import (
    AllocationResult,
    ResourceClaim,
    ResourceClaimConsumerReference,
    ResourceClaimStatus,
    ResourceClaimTemplate,
)
from draplane.scheduling.framework.plugins import scheduling_gates

POD_CLAIM_NAME_ANNOTATION = "resource.kubernetes.io/pod-claim-name"
DELETE_PROTECTION_FINALIZER = "resource.kubernetes.io/delete-protection"
# A name has at most 63 characters here; the apiserver appends 5 random ones to generateName.
_MAX_GENERATE_NAME = 57


class ClaimProblem(msgspec.Struct, frozen=True, kw_only=True):
    """Why a pod's claims are not ready: a missing template or claim, said so a user can fix it."""

    pod_claim: str
    message: str
    # Only waiting for kube-controller-manager to create the claim, or for our cache to see it:
    # no problem to tell the user, as kube-scheduler's PreEnqueue tells nobody either.
    waiting: bool = False


class PodClaims(msgspec.Struct, kw_only=True):
    """A pod's claims, resolved to ResourceClaim names in its namespace."""

    # pod claim name -> ResourceClaim name, for those that exist
    names: dict[str, str]
    # template claims to create (pod claim name, template)
    to_create: list[tuple[str, ResourceClaimTemplate]]
    # template claims that exist but are not yet in pod.status.resourceClaimStatuses
    statuses_to_record: list[PodResourceClaimStatus]
    problems: list[ClaimProblem]

    @property
    def ready(self) -> bool:
        return not self.to_create and not self.problems and not self.statuses_to_record


def generate_name(pod_name: str, pod_claim_name: str) -> str:
    """`<pod>-<claim>-`; when too long both parts are shortened in proportion, so neither vanishes."""
    base = f"{pod_name}-{pod_claim_name}-"
    if len(base) <= _MAX_GENERATE_NAME:
        return base
    budget = _MAX_GENERATE_NAME - 2  # two hyphens
    pod_part = max(1, len(pod_name) * budget // (len(pod_name) + len(pod_claim_name)))
    claim_part = max(1, budget - pod_part)
    return f"{pod_name[:pod_part]}-{pod_claim_name[:claim_part]}-"


def owned_by_pod(claim: ResourceClaim, pod_uid: str) -> bool:
    return any(
        ref.uid == pod_uid and ref.controller and ref.kind == "Pod" for ref in claim.metadata.owner_references or ()
    )


def pod_group_owner(claim: ResourceClaim, pod: Pod) -> OwnerReference | None:
    """The PodGroup that owns the claim, where it is the pod's own (DRAWorkloadResourceClaims: a
    PodGroup's claim template gives one claim its members share, owned by the group)."""
    group = pod.spec.scheduling_group.pod_group_name if pod.spec.scheduling_group else None
    if not group:
        return None
    return next((ref for ref in claim.metadata.owner_references or ()
                 if ref.controller and ref.kind == "PodGroup" and ref.name == group), None)


def consumer_for(claim: ResourceClaim, pod: Pod) -> ResourceClaimConsumerReference:
    """Who the claim is reserved for when the pod uses it: its PodGroup for a claim the group owns
    (one entry for all its members, so no 256-entry limit), else the pod."""
    group = pod_group_owner(claim, pod)
    if group is not None:
        return ResourceClaimConsumerReference(api_group="scheduling.k8s.io", resource="podgroups", name=group.name,
                                              uid=group.uid)
    return pod_consumer(pod)


def claim_from_template(pod: Pod, pod_claim_name: str, template: ResourceClaimTemplate) -> ResourceClaim:
    """The claim the resourceclaim controller would create, plus the delete-protection finalizer.

    The controller leaves the finalizer to the scheduler, which adds it with one more update just
    before allocating. Created with it, the claim skips that write (one of five per pod); the
    lifecycle removes it again from a claim that is deleted unallocated, as it does for any claim.
    """
    template_meta = template.spec.metadata or ObjectMeta()
    annotations = dict(template_meta.annotations or {})
    annotations[POD_CLAIM_NAME_ANNOTATION] = pod_claim_name
    return ResourceClaim(
        metadata=ObjectMeta(
            generate_name=generate_name(pod.metadata.name or "", pod_claim_name),
            namespace=pod.metadata.namespace,
            labels=dict(template_meta.labels) if template_meta.labels else None,
            annotations=annotations,
            finalizers=[DELETE_PROTECTION_FINALIZER],
            owner_references=[
                OwnerReference(
                    api_version="v1",
                    kind="Pod",
                    name=pod.metadata.name or "",
                    uid=pod.metadata.uid or "",
                    controller=True,
                )
            ],
        ),
        spec=template.spec.spec,
    )


def resolve_pod_claims(
    pod: Pod,
    claims: Mapping[str, ResourceClaim],
    templates: Mapping[str, ResourceClaimTemplate],
    *,
    manage_templates: bool,
    related: Iterable[ResourceClaim] | None = None,
) -> PodClaims:
    """Which ResourceClaims a pod uses, and what must happen before it can be scheduled.

    `claims` and `templates` are the pod's namespace, by name. A template claim is found through
    pod.status.resourceClaimStatuses, or, when a create succeeded but the status write did not, by
    its owner reference and annotation, so a retry never creates a second claim.

    `related`: the claims that name the pod (owner reference or reservedFor), when the caller keeps
    that index; otherwise the whole namespace is searched, once per pod, which is quadratic.
    """
    names: dict[str, str] = {}
    to_create: list[tuple[str, ResourceClaimTemplate]] = []
    to_record: list[PodResourceClaimStatus] = []
    problems: list[ClaimProblem] = []
    recorded = {s.name: s.resource_claim_name for s in (pod.status.resource_claim_statuses if pod.status else None) or ()}
    pod_uid = pod.metadata.uid or ""
    for pod_claim in pod.spec.resource_claims or ():
        if pod_claim.resource_claim_name:
            name = pod_claim.resource_claim_name
            if name in claims:
                names[pod_claim.name] = name
            else:
                problems.append(
                    ClaimProblem(pod_claim=pod_claim.name, message=f'resourceclaim "{name}" not found')
                )
            continue
        if not pod_claim.resource_claim_template_name:
            problems.append(
                ClaimProblem(
                    pod_claim=pod_claim.name,
                    message=f"pod claim {pod_claim.name} sets neither resourceClaimName nor resourceClaimTemplateName",
                )
            )
            continue
        if pod_claim.name in recorded:
            name = recorded[pod_claim.name]
            if name is None:
                continue  # kube-controller-manager's way of saying "no claim needed"
            claim = claims.get(name)
            if claim is not None and (owned_by_pod(claim, pod_uid) or pod_group_owner(claim, pod) is not None):
                names[pod_claim.name] = name
            else:
                problems.append(
                    ClaimProblem(pod_claim=pod_claim.name, message=f'resourceclaim "{name}" not found (yet)', waiting=True)
                )
            continue
        existing = next(
            (
                c
                for c in (claims.values() if related is None else related)
                if owned_by_pod(c, pod_uid)
                and (c.metadata.annotations or {}).get(POD_CLAIM_NAME_ANNOTATION) == pod_claim.name
            ),
            None,
        )
        if existing is not None:
            if not manage_templates:
                # kube-controller-manager made it and records it in the pod's status itself, next:
                # writing it here too costs a write per pod and collides with its own.
                problems.append(ClaimProblem(pod_claim=pod_claim.name, waiting=True,
                                             message="waiting for the claim to be recorded in the pod's status"))
                continue
            to_record.append(PodResourceClaimStatus(name=pod_claim.name, resource_claim_name=existing.metadata.name))
            continue
        template = templates.get(pod_claim.resource_claim_template_name)
        if template is None:
            problems.append(
                ClaimProblem(
                    pod_claim=pod_claim.name,
                    message=f'resourceclaimtemplate "{pod_claim.resource_claim_template_name}" not found',
                )
            )
        elif not manage_templates:
            problems.append(
                ClaimProblem(pod_claim=pod_claim.name, message="waiting for the claim to be created from its template",
                             waiting=True)
            )
        else:
            to_create.append((pod_claim.name, template))
    return PodClaims(names=names, to_create=to_create, statuses_to_record=to_record, problems=problems)


def merged_claim_statuses(pod: Pod, new: Iterable[PodResourceClaimStatus]) -> list[PodResourceClaimStatus]:
    current = {s.name: s for s in (pod.status.resource_claim_statuses if pod.status else None) or ()}
    for status in new:
        current[status.name] = status
    return sorted(current.values(), key=lambda s: s.name)


# --- reservedFor and deallocation ----------------------------------------------------------------


def pod_consumer(pod: Pod) -> ResourceClaimConsumerReference:
    return ResourceClaimConsumerReference(resource="pods", name=pod.metadata.name or "", uid=pod.metadata.uid or "")


def pod_is_done(pod: Pod) -> bool:
    """A pod that will never use its claims again: finished, or deleted before it was bound."""
    phase = pod.status.phase if pod.status else None
    if phase in ("Succeeded", "Failed"):
        return True
    return pod.metadata.deletion_timestamp is not None and not pod.spec.node_name


def pod_is_gated(pod: Pod) -> bool:
    """Held by `spec.schedulingGates`: kube-scheduler's SchedulingGates plugin keeps such a pod out
    of every scheduling attempt until the last gate is removed."""
    return scheduling_gates.pre_enqueue(pod) is not None


def reserved_for_to_drop(claim: ResourceClaim, pods_by_uid: Mapping[str, Pod]) -> list[ResourceClaimConsumerReference]:
    """Consumers that are pods which no longer exist (by UID) or are done."""
    drop = []
    for ref in (claim.status.reserved_for if claim.status else None) or ():
        if ref.resource != "pods" or (ref.api_group or "") != "":
            continue  # some other controller's consumer: not ours to judge
        pod = pods_by_uid.get(ref.uid)
        if pod is None or pod_is_done(pod):
            drop.append(ref)
    return drop


def status_without_consumers(
    claim: ResourceClaim, drop: Iterable[ResourceClaimConsumerReference]
) -> ResourceClaimStatus:
    """The status with those consumers gone; with no consumer left the allocation goes too."""
    status = claim.status or ResourceClaimStatus()
    drop_uids = {ref.uid for ref in drop}
    remaining = [ref for ref in status.reserved_for or () if ref.uid not in drop_uids]
    if remaining:
        return msgspec.structs.replace(status, reserved_for=remaining)
    return ResourceClaimStatus()


def needs_deallocation(claim: ResourceClaim) -> bool:
    """Allocated, reserved by nobody, and so free to be taken back (as the resourceclaim controller does).

    A claim being written by our own binder is never in this state: the allocation and the first
    `reservedFor` entry are written in one status update.
    """
    status = claim.status
    return status is not None and status.allocation is not None and not status.reserved_for


def is_template_claim_of_gone_pod(claim: ResourceClaim, pods_by_uid: Mapping[str, Pod]) -> bool:
    """A claim generated for a pod that is gone or done: delete it (no garbage collector runs here)."""
    if POD_CLAIM_NAME_ANNOTATION not in (claim.metadata.annotations or {}):
        return False
    owners = [r for r in claim.metadata.owner_references or () if r.controller and r.kind == "Pod"]
    if not owners:
        return False
    pod = pods_by_uid.get(owners[0].uid)
    return pod is None or pod_is_done(pod)


def finalizers_without_protection(claim: ResourceClaim) -> list[str] | None:
    """The finalizer list without ours, or None when ours is not there (nothing to write)."""
    finalizers = claim.metadata.finalizers or []
    if DELETE_PROTECTION_FINALIZER not in finalizers:
        return None
    return [f for f in finalizers if f != DELETE_PROTECTION_FINALIZER]


# --- writing a placement -------------------------------------------------------------------------


class WriteStatus(msgspec.Struct, frozen=True):
    status: ResourceClaimStatus


class AlreadyWritten(msgspec.Struct, frozen=True):
    pass


class AllocatedElsewhere(msgspec.Struct, frozen=True):
    message: str


ClaimWrite = WriteStatus | AlreadyWritten | AllocatedElsewhere


def same_allocation(a: AllocationResult | None, b: AllocationResult | None) -> bool:
    """Equal devices and node selector; the timestamp does not make two allocations different."""
    if a is None or b is None:
        return a is b
    return msgspec.structs.replace(a, allocation_timestamp=None) == msgspec.structs.replace(b, allocation_timestamp=None)


def plan_claim_write(claim: ResourceClaim, allocation: AllocationResult, pod: Pod, *,
                     now: str | None = None) -> ClaimWrite:
    """What step 2 of the placement protocol writes for one claim, given its current state.

    Idempotent: the claim already carrying this allocation and this pod is done; carrying it without
    the pod (a shared claim, or a crash mid-way) needs only the pod added. A new allocation gets
    `now` (RFC 3339) as its allocationTimestamp, as kube-scheduler 1.37 writes it: the binding
    conditions' timeout counts from it.
    """
    status = claim.status or ResourceClaimStatus()
    consumer = consumer_for(claim, pod)
    reserved = list(status.reserved_for or ())
    has_pod = any(r.uid == consumer.uid for r in reserved)
    if status.allocation is None:
        if now is not None and allocation.allocation_timestamp is None:
            allocation = msgspec.structs.replace(allocation, allocation_timestamp=now)
        return WriteStatus(
            msgspec.structs.replace(status, allocation=allocation, reserved_for=[*reserved, consumer])
        )
    if not same_allocation(status.allocation, allocation):
        return AllocatedElsewhere(
            f"resourceclaim {claim.metadata.namespace}/{claim.metadata.name} is already allocated with other devices"
        )
    if has_pod:
        return AlreadyWritten()
    return WriteStatus(msgspec.structs.replace(status, reserved_for=[*reserved, consumer]))


BINDING_TIMEOUT = "device binding timeout"


def has_binding_conditions(allocation: AllocationResult | None) -> bool:
    return allocation is not None and any(r.binding_conditions for r in allocation.devices.results or ())


class BindingWait(msgspec.Struct, frozen=True):
    """Where a claim's devices stand against their binding conditions."""

    ready: bool
    error: str = ""  # the attempt fails with it: a failure condition, or the timeout


def binding_readiness(claim: ResourceClaim, now: datetime, timeout_seconds: float) -> BindingWait:
    """kube-scheduler's isClaimReadyForBinding and isClaimTimeout for one claim: ready once every
    binding condition of every allocated device is True in `status.devices`; failed once a
    binding failure condition is True, or when the conditions are still unmet `timeout_seconds`
    after the allocation's timestamp."""
    status = claim.status
    allocation = status.allocation if status is not None else None
    if allocation is None:
        return BindingWait(ready=False)
    name = claim.metadata.name
    devices = {(d.driver, d.pool, d.device): d for d in (status.devices or ())}
    ready = True
    for result in allocation.devices.results or ():
        if not result.binding_conditions:
            continue
        device = devices.get((result.driver, result.pool, result.device))
        if device is None:
            ready = False
            continue
        conditions = {c.type: c for c in device.conditions or ()}
        for wanted in result.binding_failure_conditions or ():
            failed = conditions.get(wanted)
            if failed is not None and failed.status == "True":
                return BindingWait(ready=False, error=f"device binding failed: claim={name}, reason={failed.reason or ''}, "
                                                      f'message="{failed.message or ""}"')
        if not all(conditions.get(c) is not None and conditions[c].status == "True" for c in result.binding_conditions):
            ready = False
    if ready:
        return BindingWait(ready=True)
    allocated_at = parse_rfc3339(allocation.allocation_timestamp)
    if allocated_at is not None and (now - allocated_at).total_seconds() > timeout_seconds:
        return BindingWait(ready=False, error=f"{BINDING_TIMEOUT}: claim={name}")
    return BindingWait(ready=False)


def parse_rfc3339(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def status_without_pod(claim: ResourceClaim, pod_uid: str) -> ResourceClaimStatus | None:
    """Undo of step 2 for one pod; None when the pod is not among the consumers."""
    status = claim.status
    if status is None or not any(r.uid == pod_uid for r in status.reserved_for or ()):
        return None
    remaining = [r for r in status.reserved_for or () if r.uid != pod_uid]
    if remaining:
        return msgspec.structs.replace(status, reserved_for=remaining)
    return ResourceClaimStatus()
