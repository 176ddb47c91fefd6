"""A device allocated by someone else (kube-scheduler), written straight into a claim's status, is
never given to one of ours: the shards build their allocated set from every claim in the cluster."""

from __future__ import annotations

import uuid

import pytest

from draplane.api.core import Pod
from draplane.api.meta import NodeSelector, NodeSelectorRequirement, NodeSelectorTerm
from draplane.api.resource import (
    AllocationResult,
    DeviceAllocationResult,
    DeviceRequestAllocationResult,
    ResourceClaim,
    ResourceClaimConsumerReference,
    ResourceClaimStatus,
)
from draplane.simulation import scenario
from conftest import all_claims_devices, ensure_class, pod_scheduled_false  # noqa: E402

pytestmark = pytest.mark.integration


async def test_a_device_in_use_by_kube_scheduler_is_never_reused(scheduling, kube, namespace):
    class_name = f"gpu-{uuid.uuid4().hex[:6]}"
    await ensure_class(kube, scenario.device_class(class_name))
    node = f"foreign-{namespace[-6:]}"
    await scheduling.put_node(scenario.gpu_node(node), [scenario.gpu_slice(node, 2, "80Gi")])

    # kube-scheduler's pod and claim, before draplane starts: bound, allocated gpu-1, reserved
    theirs = await kube.create(scenario.pod(namespace, "theirs", claim_name="theirs", scheduler_name="default-scheduler-elsewhere"))
    await kube.bind_pod(namespace, "theirs", node, theirs.metadata.uid)
    claim = await kube.create(scenario.claim(namespace, "theirs", class_name))
    claim.status = ResourceClaimStatus(
        allocation=AllocationResult(
            devices=DeviceAllocationResult(results=[DeviceRequestAllocationResult(
                request="gpu", driver=scenario.GPU_DRIVER, pool=node, device="gpu-1")]),
            node_selector=NodeSelector(node_selector_terms=[NodeSelectorTerm(match_fields=[
                NodeSelectorRequirement(key="metadata.name", operator="In", values=[node])])]),
        ),
        reserved_for=[ResourceClaimConsumerReference(resource="pods", name="theirs", uid=theirs.metadata.uid)],
    )
    await kube.update_status(claim)

    await scheduling.start(shards=2)
    for name in ("a", "b"):
        await kube.create(scenario.claim(namespace, name, class_name))
        await kube.create(scheduling.pod(namespace, name, claim_name=name))

    async def settled():
        pods = {p.metadata.name: p for p in (await kube.list(Pod, namespace))[0]}
        bound = [n for n in ("a", "b") if pods[n].spec.node_name]
        waiting = [n for n in ("a", "b") if pod_scheduled_false(pods[n])]
        return (bound, waiting) if len(bound) == 1 and len(waiting) == 1 else None

    bound, waiting = await scheduling.wait_for(settled, what="one pod bound, one explained")
    claims = {c.metadata.name: c for c in (await kube.list(ResourceClaim, namespace))[0]}
    assert claims[bound[0]].status.allocation.devices.results[0].device == "gpu-0"
    assert claims[waiting[0]].status is None or claims[waiting[0]].status.allocation is None
    devices = all_claims_devices(list(claims.values()))
    assert sorted(devices) == [(scenario.GPU_DRIVER, node, "gpu-0"), (scenario.GPU_DRIVER, node, "gpu-1")]
    # their claim is untouched: still allocated, still reserved for their pod
    assert claims["theirs"].status.allocation.devices.results[0].device == "gpu-1"
    assert [r.name for r in claims["theirs"].status.reserved_for] == ["theirs"]
