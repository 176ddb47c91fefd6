"""The seed scenario and template claims, end to end on real NATS, etcd and kube-apiserver."""

from __future__ import annotations

import uuid

import pytest

from draplane.api.codec import load_files
from draplane.api.core import Pod
from draplane.api.resource import DeviceClass, ResourceClaim
from draplane.cli import explain
from draplane.kube import KubeApiError
from draplane.simulation import scenario
from draplane_binder.lifecycle import DELETE_PROTECTION_FINALIZER, POD_CLAIM_NAME_ANNOTATION

pytestmark = pytest.mark.integration


async def ensure_class(kube, device_class: DeviceClass) -> None:
    try:
        await kube.create(device_class)
    except KubeApiError as exc:
        if not exc.is_already_exists:
            raise


async def force_delete_pod(kube, namespace: str, name: str) -> None:
    await kube.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}", query={"gracePeriodSeconds": 0})


def corrected_seed(raw_dir, class_name: str):
    """The seed's three objects with the two fixes DESIGN.md names, and nothing else changed."""
    import yaml

    device_class = yaml.safe_load((raw_dir / "deviceclass.yaml").read_text())
    device_class["metadata"]["name"] = class_name
    device_class["spec"]["selectors"][0]["cel"]["expression"] = scenario.HIGH_MEMORY_EXPRESSION
    claim = yaml.safe_load((raw_dir / "resourceclaim.yaml").read_text())
    request = claim["spec"]["devices"]["requests"][0]
    request["exactly"] = {"deviceClassName": class_name, "count": request.pop("count")}
    request.pop("deviceClassName")
    pod = yaml.safe_load((raw_dir / "pod.yaml").read_text())
    from draplane.api.codec import decode_object

    return decode_object(device_class), decode_object(claim), decode_object(pod)


async def test_seed_pod_binds_to_the_80gi_gpu_with_kube_scheduler_status(scheduling, kube, namespace, seed_example_dir):
    class_name = f"high-memory-gpu-{uuid.uuid4().hex[:6]}"
    device_class, claim, pod = corrected_seed(seed_example_dir, class_name)
    await ensure_class(kube, device_class)
    suffix = namespace[-6:]
    for size in ("24", "40", "80"):
        name = f"seed-{size}-{suffix}"
        await scheduling.put_node(scenario.gpu_node(name), [scenario.gpu_slice(name, 1, f"{size}Gi")])
    # the local environment's setting: the seed's pod names no scheduler
    await scheduling.start(scheduler_names=("draplane", "default-scheduler"))

    claim.metadata.namespace = namespace
    pod.metadata.namespace = namespace
    await kube.create(claim)
    created = await kube.create(pod)
    assert created.spec.scheduler_name == "default-scheduler"  # applied verbatim, no scheduler named

    bound = await scheduling.bound_pod(namespace, "vllm-inference")
    assert bound.spec.node_name == f"seed-80-{suffix}"

    got = await kube.get(ResourceClaim, "vllm-gpu-claim", namespace)
    assert got.metadata.finalizers == [DELETE_PROTECTION_FINALIZER]
    allocation = got.status.allocation
    (result,) = allocation.devices.results
    assert (result.request, result.driver, result.pool, result.device) == (
        "gpu", "gpu.nvidia.com", f"seed-80-{suffix}", "gpu-0"
    )
    # exactly the fields kube-scheduler sets for a plain request: nothing else
    assert result.admin_access is None and result.share_id is None and result.consumed_capacity is None
    assert allocation.devices.config is None
    (term,) = allocation.node_selector.node_selector_terms
    assert term.match_expressions is None
    (field,) = term.match_fields
    assert (field.key, field.operator, field.values) == ("metadata.name", "In", [f"seed-80-{suffix}"])
    (consumer,) = got.status.reserved_for
    assert (consumer.resource, consumer.name, consumer.uid, consumer.api_group) == (
        "pods", "vllm-inference", bound.metadata.uid, None
    )


async def test_template_claims_are_created_allocated_released_and_reused(scheduling, kube, namespace, control_plane):
    class_name = f"gpu-{uuid.uuid4().hex[:6]}"
    await ensure_class(kube, scenario.device_class(class_name))
    node = f"tmpl-{namespace[-6:]}"
    await scheduling.put_node(scenario.gpu_node(node), [scenario.gpu_slice(node, 1, "80Gi")])
    await scheduling.start()
    await kube.create(scenario.claim_template(namespace, "one-gpu", class_name))

    await kube.create(scheduling.pod(namespace, "first", template_name="one-gpu"))
    first = await scheduling.bound_pod(namespace, "first")
    (status,) = first.status.resource_claim_statuses
    claim = await kube.get(ResourceClaim, status.resource_claim_name, namespace)
    assert status.name == "gpu" and claim.metadata.name.startswith("first-gpu-")
    assert len(claim.metadata.name) == len("first-gpu-") + 5
    assert claim.metadata.annotations[POD_CLAIM_NAME_ANNOTATION] == "gpu"
    (owner,) = claim.metadata.owner_references
    # as kube-controller-manager's resourceclaim controller writes it (no blockOwnerDeletion)
    assert (owner.kind, owner.name, owner.uid, owner.controller, owner.block_owner_deletion) == (
        "Pod", "first", first.metadata.uid, True, None
    )
    assert claim.status.allocation.devices.results[0].device == "gpu-0"

    # the only GPU is taken: a second pod waits, with a reason
    await kube.create(scheduling.pod(namespace, "second", template_name="one-gpu"))

    async def explained():
        pod = await kube.get(Pod, "second", namespace)
        conditions = {c.type: c for c in (pod.status.conditions or ())}
        c = conditions.get("PodScheduled")
        return c if c is not None and c.status == "False" else None

    condition = await scheduling.wait_for(explained, what="an Unschedulable condition")
    assert condition.reason == "Unschedulable"
    assert "capacity exhausted" in condition.message, condition.message

    # `draplane explain` reads the same cluster and says the same, per node class
    snapshot = await explain.gather(control_plane.kubeconfig)
    text = "\n".join(explain.explain_pod(snapshot, explain.find_target(snapshot, "pod/second", namespace)))
    assert "is pending" in text and f"capacity exhausted (too few free matching devices): 1 node ({node})" in text
    text = "\n".join(explain.explain_pod(snapshot, explain.find_target(snapshot, "pod/first", namespace)))
    assert f"is bound to node {node}" in text and "device gpu-0" in text

    # delete the first pod: its claim is deallocated and deleted, and the GPU goes to the second
    # no kubelet runs here to finish a graceful deletion, so delete at once
    await force_delete_pod(kube, namespace, "first")
    second = await scheduling.bound_pod(namespace, "second", timeout=30)
    assert second.spec.node_name == node

    async def first_claim_gone():
        try:
            await kube.get(ResourceClaim, claim.metadata.name, namespace)
            return False
        except KubeApiError as exc:
            return exc.is_not_found

    await scheduling.wait_for(first_claim_gone, what="the first pod's claim to be deleted")
    (status,) = second.status.resource_claim_statuses
    second_claim = await kube.get(ResourceClaim, status.resource_claim_name, namespace)
    assert second_claim.status.allocation.devices.results[0].device == "gpu-0"
