from draplane.api.core import Pod, PodResourceClaim, PodResourceClaimStatus, PodSpec, PodStatus
from draplane.api.meta import ObjectMeta
from draplane.api.resource import (
    AllocationResult,
    DeviceAllocationResult,
    DeviceRequestAllocationResult,
    ResourceClaim,
    ResourceClaimConsumerReference,
    ResourceClaimStatus,
    ResourceClaimTemplate,
    ResourceClaimTemplateSpec,
)
from draplane_binder import lifecycle as lc


def pod(name="web", uid="pod-uid", claims=(), statuses=None, phase=None, node=None, deleting=False) -> Pod:
    return Pod(
        metadata=ObjectMeta(
            name=name, namespace="ns", uid=uid, deletion_timestamp="2026-01-01T00:00:00Z" if deleting else None
        ),
        spec=PodSpec(resource_claims=list(claims), node_name=node),
        status=PodStatus(phase=phase, resource_claim_statuses=statuses),
    )


def template(name="gpu-template") -> ResourceClaimTemplate:
    return ResourceClaimTemplate(
        metadata=ObjectMeta(name=name, namespace="ns"),
        spec=ResourceClaimTemplateSpec(metadata=ObjectMeta(labels={"team": "a"}, annotations={"x": "y"})),
    )


def allocation(device="gpu-0") -> AllocationResult:
    return AllocationResult(
        devices=DeviceAllocationResult(
            results=[DeviceRequestAllocationResult(request="gpu", driver="gpu.nvidia.com", pool="n1", device=device)]
        )
    )


def test_claim_from_template_has_kubernetes_name_annotation_and_owner():
    p = pod(claims=[PodResourceClaim(name="gpu", resource_claim_template_name="gpu-template")])
    claim = lc.claim_from_template(p, "gpu", template())
    assert claim.metadata.generate_name == "web-gpu-"
    assert claim.metadata.annotations == {"x": "y", lc.POD_CLAIM_NAME_ANNOTATION: "gpu"}
    assert claim.metadata.labels == {"team": "a"}
    assert claim.metadata.finalizers == [lc.DELETE_PROTECTION_FINALIZER]  # saves the scheduler's update
    (owner,) = claim.metadata.owner_references
    assert (owner.api_version, owner.kind, owner.name, owner.uid) == ("v1", "Pod", "web", "pod-uid")
    # as kube-controller-manager 1.37 writes it: controller, no blockOwnerDeletion
    assert owner.controller is True and owner.block_owner_deletion is None


def test_long_names_keep_both_parts():
    name = lc.generate_name("p" * 60, "c" * 30)
    assert len(name) <= 57 and name.endswith("-") and "-c" in name and name.startswith("p")


def test_resolve_creates_missing_template_claims_once():
    p = pod(claims=[PodResourceClaim(name="gpu", resource_claim_template_name="gpu-template")])
    resolved = lc.resolve_pod_claims(p, {}, {"gpu-template": template()}, manage_templates=True)
    assert [name for name, _ in resolved.to_create] == ["gpu"] and not resolved.ready
    # Created, but the pod status write was lost: found by owner + annotation, not created again.
    created = lc.claim_from_template(p, "gpu", template())
    created.metadata.name = "web-gpu-abcde"
    resolved = lc.resolve_pod_claims(p, {"web-gpu-abcde": created}, {"gpu-template": template()}, manage_templates=True)
    assert resolved.to_create == []
    assert resolved.statuses_to_record == [PodResourceClaimStatus(name="gpu", resource_claim_name="web-gpu-abcde")]
    # The same answer from the caller's index of claims that name the pod, without a namespace scan.
    namespace = {"web-gpu-abcde": created}
    indexed = lc.resolve_pod_claims(p, namespace, {"gpu-template": template()}, manage_templates=True, related=[created])
    assert indexed.statuses_to_record == resolved.statuses_to_record
    # Recorded: ready.
    p.status.resource_claim_statuses = resolved.statuses_to_record
    resolved = lc.resolve_pod_claims(p, {"web-gpu-abcde": created}, {}, manage_templates=True)
    assert resolved.ready and resolved.names == {"gpu": "web-gpu-abcde"}


def test_without_manage_claims_a_template_claim_is_waited_for_until_the_pod_records_it():
    # kube-controller-manager creates the claim and then records it in the pod's status: the
    # binder writes neither, and tells nobody about the wait (kube-scheduler's PreEnqueue).
    p = pod(claims=[PodResourceClaim(name="gpu", resource_claim_template_name="gpu-template")])
    resolved = lc.resolve_pod_claims(p, {}, {"gpu-template": template()}, manage_templates=False)
    assert resolved.to_create == [] and [problem.waiting for problem in resolved.problems] == [True]
    made = lc.claim_from_template(p, "gpu", template())
    made.metadata.name = "web-gpu-abcde"
    resolved = lc.resolve_pod_claims(p, {"web-gpu-abcde": made}, {"gpu-template": template()}, manage_templates=False)
    assert resolved.statuses_to_record == [] and [problem.waiting for problem in resolved.problems] == [True]
    p.status.resource_claim_statuses = [PodResourceClaimStatus(name="gpu", resource_claim_name="web-gpu-abcde")]
    resolved = lc.resolve_pod_claims(p, {"web-gpu-abcde": made}, {}, manage_templates=False)
    assert resolved.ready and resolved.names == {"gpu": "web-gpu-abcde"}


def test_missing_template_and_missing_claim_are_problems():
    p = pod(
        claims=[
            PodResourceClaim(name="a", resource_claim_template_name="nope"),
            PodResourceClaim(name="b", resource_claim_name="absent"),
        ]
    )
    resolved = lc.resolve_pod_claims(p, {}, {}, manage_templates=True)
    assert [pr.message for pr in resolved.problems] == [
        'resourceclaimtemplate "nope" not found',
        'resourceclaim "absent" not found',
    ]


def test_reserved_for_of_gone_or_finished_pods_is_dropped_and_then_deallocated():
    claim = ResourceClaim(
        metadata=ObjectMeta(name="c", namespace="ns"),
        status=ResourceClaimStatus(
            allocation=allocation(),
            reserved_for=[
                ResourceClaimConsumerReference(resource="pods", name="gone", uid="u-gone"),
                ResourceClaimConsumerReference(resource="pods", name="done", uid="u-done"),
                ResourceClaimConsumerReference(resource="pods", name="live", uid="u-live"),
            ],
        ),
    )
    pods = {"u-done": pod(name="done", uid="u-done", phase="Succeeded"), "u-live": pod(name="live", uid="u-live", node="n1")}
    drop = lc.reserved_for_to_drop(claim, pods)
    assert [r.name for r in drop] == ["gone", "done"]
    status = lc.status_without_consumers(claim, drop)
    assert status.allocation is not None and [r.name for r in status.reserved_for] == ["live"]
    del pods["u-live"]
    status = lc.status_without_consumers(claim, lc.reserved_for_to_drop(claim, pods))
    assert status == ResourceClaimStatus()
    assert lc.needs_deallocation(ResourceClaim(status=ResourceClaimStatus(allocation=allocation())))
    assert not lc.needs_deallocation(claim)


def test_plan_claim_write_is_idempotent_and_refuses_other_allocations():
    p = pod(node=None)
    claim = ResourceClaim(metadata=ObjectMeta(name="c", namespace="ns"))
    plan = lc.plan_claim_write(claim, allocation(), p)
    assert isinstance(plan, lc.WriteStatus)
    assert plan.status.allocation == allocation() and [r.uid for r in plan.status.reserved_for] == ["pod-uid"]
    claim.status = plan.status
    assert isinstance(lc.plan_claim_write(claim, allocation(), p), lc.AlreadyWritten)
    assert isinstance(lc.plan_claim_write(claim, allocation("gpu-1"), p), lc.AllocatedElsewhere)
    # a shared claim allocated for another pod gets this pod added
    other = pod(name="other", uid="other-uid")
    plan = lc.plan_claim_write(claim, allocation(), other)
    assert [r.uid for r in plan.status.reserved_for] == ["pod-uid", "other-uid"]
    # undo removes only that pod; undoing the last consumer clears the allocation
    claim.status = plan.status
    assert [r.uid for r in lc.status_without_pod(claim, "other-uid").reserved_for] == ["pod-uid"]
    claim.status = lc.status_without_pod(claim, "other-uid")
    assert lc.status_without_pod(claim, "pod-uid") == ResourceClaimStatus()
    assert lc.status_without_pod(claim, "nobody") is None


def test_template_claims_of_gone_pods_are_deleted():
    p = pod(claims=[PodResourceClaim(name="gpu", resource_claim_template_name="gpu-template")])
    claim = lc.claim_from_template(p, "gpu", template())
    assert lc.is_template_claim_of_gone_pod(claim, {})
    assert not lc.is_template_claim_of_gone_pod(claim, {"pod-uid": p})
    assert lc.is_template_claim_of_gone_pod(claim, {"pod-uid": pod(phase="Failed")})
    assert not lc.is_template_claim_of_gone_pod(ResourceClaim(metadata=ObjectMeta(name="plain")), {})


# --- allocation timestamp and binding conditions ----------------------------------------------------

from datetime import datetime, timedelta, timezone  # noqa: E402

import msgspec  # noqa: E402

from draplane.api.meta import Condition  # noqa: E402
from draplane.api.resource import AllocatedDeviceStatus  # noqa: E402

NOW = datetime(2026, 12, 5, 12, 0, 0, tzinfo=timezone.utc)


def attached_allocation(stamp: str | None = "2026-12-05T12:00:00Z") -> AllocationResult:
    base = allocation()
    results = [msgspec.structs.replace(r, binding_conditions=["example.com/attached"],
                                       binding_failure_conditions=["example.com/failed"])
               for r in base.devices.results]
    return msgspec.structs.replace(base, devices=msgspec.structs.replace(base.devices, results=results),
                                   allocation_timestamp=stamp)


def with_device_conditions(claim_allocation: AllocationResult, **conditions: str) -> ResourceClaim:
    result = claim_allocation.devices.results[0]
    devices = [AllocatedDeviceStatus(driver=result.driver, pool=result.pool, device=result.device, conditions=[
        Condition(type=t.replace("_", "/"), status=s, reason="Test", message=f"{t} is {s}") for t, s in conditions.items()])]
    return ResourceClaim(metadata=ObjectMeta(name="c", namespace="ns"),
                         status=ResourceClaimStatus(allocation=claim_allocation, devices=devices if conditions else None))


def test_a_new_allocation_gets_kube_schedulers_allocation_timestamp_and_an_old_one_keeps_its_own():
    claim = ResourceClaim(metadata=ObjectMeta(name="c", namespace="ns"))
    plan = lc.plan_claim_write(claim, allocation(), pod(), now="2026-12-05T12:00:00Z")
    assert plan.status.allocation.allocation_timestamp == "2026-12-05T12:00:00Z"
    assert lc.same_allocation(plan.status.allocation, allocation())
    claim.status = plan.status
    later = lc.plan_claim_write(claim, allocation(), pod(name="other", uid="other-uid"), now="2026-12-05T13:00:00Z")
    assert later.status.allocation.allocation_timestamp == "2026-12-05T12:00:00Z"


def test_binding_readiness_waits_for_every_condition_fails_on_a_failure_condition_and_times_out():
    assert not lc.has_binding_conditions(allocation()) and lc.has_binding_conditions(attached_allocation())
    plain = ResourceClaim(metadata=ObjectMeta(name="c"), status=ResourceClaimStatus(allocation=allocation()))
    assert lc.binding_readiness(plain, NOW, 600) == lc.BindingWait(ready=True)
    waiting = with_device_conditions(attached_allocation())
    assert lc.binding_readiness(waiting, NOW + timedelta(seconds=599), 600) == lc.BindingWait(ready=False)
    assert lc.binding_readiness(waiting, NOW + timedelta(seconds=601), 600) == lc.BindingWait(
        ready=False, error="device binding timeout: claim=c")
    not_yet = with_device_conditions(attached_allocation(), **{"example.com_attached": "False"})
    assert not lc.binding_readiness(not_yet, NOW, 600).ready
    done = with_device_conditions(attached_allocation(), **{"example.com_attached": "True"})
    assert lc.binding_readiness(done, NOW + timedelta(days=1), 600) == lc.BindingWait(ready=True)
    failed = with_device_conditions(attached_allocation(), **{"example.com_attached": "False", "example.com_failed": "True"})
    assert lc.binding_readiness(failed, NOW, 600).error == (
        'device binding failed: claim=c, reason=Test, message="example.com_failed is True"')
    # no timestamp (written by an older scheduler): no timeout
    assert lc.binding_readiness(with_device_conditions(attached_allocation(stamp=None)), NOW + timedelta(days=1),
                                600) == lc.BindingWait(ready=False)


def test_a_claim_its_pods_group_owns_is_used_and_reserved_for_the_group():
    from draplane.api.core import PodSchedulingGroup
    from draplane.api.meta import OwnerReference

    member = pod(claims=[PodResourceClaim(name="gpu", resource_claim_template_name="one-gpu")],
                 statuses=[PodResourceClaimStatus(name="gpu", resource_claim_name="group-1-gpu-x")])
    member.spec.scheduling_group = PodSchedulingGroup(pod_group_name="group-1")
    shared = ResourceClaim(metadata=ObjectMeta(name="group-1-gpu-x", namespace="ns", owner_references=[
        OwnerReference(api_version="scheduling.k8s.io/v1beta1", kind="PodGroup", name="group-1", uid="g-uid",
                       controller=True)]))
    resolved = lc.resolve_pod_claims(member, {"group-1-gpu-x": shared}, {}, manage_templates=False)
    assert resolved.names == {"gpu": "group-1-gpu-x"} and not resolved.problems
    plan = lc.plan_claim_write(shared, allocation(), member)
    (consumer,) = plan.status.reserved_for
    assert (consumer.api_group, consumer.resource, consumer.name, consumer.uid) == (
        "scheduling.k8s.io", "podgroups", "group-1", "g-uid")
    shared.status = plan.status
    other = pod(name="other", uid="other-uid")
    other.spec.scheduling_group = PodSchedulingGroup(pod_group_name="group-1")
    assert isinstance(lc.plan_claim_write(shared, allocation(), other), lc.AlreadyWritten)
    # a pod outside the group does not get the group's claim
    stranger = pod(claims=member.spec.resource_claims, statuses=member.status.resource_claim_statuses)
    assert lc.resolve_pod_claims(stranger, {"group-1-gpu-x": shared}, {}, manage_templates=False).problems
