"""2 shards, more GPUs asked for than there are, with the claims users really bring: 1-, 2-, 4- and
8-GPU claims (the 2-GPU ones under one PCIe root), adminAccess claims that watch devices in use,
and shares of devices that allow multiple allocations (consumable capacity).

The audit is the invariant: no device held whole by two claims (adminAccess results aside), no
shared device given beyond its capacity, every constraint held, every pod bound with its claims
or explained. DRAPLANE_CONTENTION_MIXED_PODS (default 120) sets the size.
"""

from __future__ import annotations

import os
import random
import uuid
from collections import defaultdict

import pytest

from draplane.api.meta import ObjectMeta
from draplane.api.quantity import parse_quantity
from draplane.api.resource import (
    CapacityRequirements,
    DeviceAttribute,
    DeviceCapacity,
    DeviceConstraint,
    Device,
    ResourceClaimTemplate,
    ResourceClaimTemplateSpec,
    ResourcePool,
    ResourceSlice,
    ResourceSliceSpec,
)
from draplane.simulation import scenario
from conftest import audit, create_many, ensure_class  # noqa: E402  (tests/services/conftest.py)

pytestmark = pytest.mark.integration

PODS = int(os.environ.get("DRAPLANE_CONTENTION_MIXED_PODS", "120"))
GPU_NODES = 6  # x 8 GPUs
SHARED_NODES = 2  # x 1 GPU of 80Gi shared in 20Gi pieces
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
# template -> (share of pods in %, GPUs)
MIX = {"one": (35, 1), "two-one-root": (20, 2), "four": (10, 4), "eight": (5, 8), "admin": (10, 1),
       "share": (20, 0)}


def shared_gpu_slice(node: str) -> ResourceSlice:
    device = Device(
        name="shared-0",
        attributes={"type": DeviceAttribute(string_value="shared")},
        capacity={"memory": DeviceCapacity(value="80Gi")},
        allow_multiple_allocations=True,
    )
    return ResourceSlice(
        metadata=ObjectMeta(name=f"{node}-{scenario.GPU_DRIVER}"),
        spec=ResourceSliceSpec(driver=scenario.GPU_DRIVER, pool=ResourcePool(name=node, generation=1, resource_slice_count=1),
                               node_name=node, devices=[device]),
    )


def templates(namespace: str, gpu_class: str, shared_class: str) -> list[ResourceClaimTemplate]:
    made = []
    for name, (_, gpus) in MIX.items():
        spec = scenario.claim_spec(shared_class if name == "share" else gpu_class, max(gpus, 1))
        request = spec.devices.requests[0].exactly
        if name == "two-one-root":
            spec.devices.constraints = [DeviceConstraint(requests=["gpu"], match_attribute=PCIE_ROOT)]
        if name == "admin":
            request.admin_access = True
        if name == "share":
            request.capacity = CapacityRequirements(requests={"memory": "20Gi"})
        made.append(ResourceClaimTemplate(metadata=ObjectMeta(name=name, namespace=namespace),
                                          spec=ResourceClaimTemplateSpec(spec=spec)))
    return made


async def test_two_shards_with_multi_device_admin_and_shared_claims_never_overcommit(scheduling, kube, kubectl,
                                                                                    namespace):
    gpu_class, shared_class = f"gpu-{uuid.uuid4().hex[:6]}", f"shared-{uuid.uuid4().hex[:6]}"
    await ensure_class(kube, scenario.device_class(gpu_class, 'device.attributes["gpu.nvidia.com"].type == "gpu"'))
    await ensure_class(kube, scenario.device_class(shared_class, 'device.attributes["gpu.nvidia.com"].type == "shared"'))
    await kubectl("label", "namespace", namespace, "resource.kubernetes.io/admin-access=true")
    suffix = namespace[-6:]
    roots = {}
    for i in range(GPU_NODES):
        name = f"mixed-{i}-{suffix}"
        gpu_slice = scenario.gpu_slice(name, 8, "80Gi")
        roots.update({(name, d.name): d.attributes[PCIE_ROOT].string_value for d in gpu_slice.spec.devices})
        await scheduling.put_node(scenario.gpu_node(name), [gpu_slice])
    for i in range(SHARED_NODES):
        name = f"shared-{i}-{suffix}"
        await scheduling.put_node(scenario.gpu_node(name), [shared_gpu_slice(name)])
    await scheduling.start(shards=2)
    for template in templates(namespace, gpu_class, shared_class):
        await kube.create(template)

    rng = random.Random(PODS)
    kinds = rng.choices(list(MIX), [share for share, _ in MIX.values()], k=PODS)
    pods = [scheduling.pod(namespace, f"p-{i:04d}", template_name=kind) for i, kind in enumerate(kinds)]
    await create_many(kube, pods)

    previous = [None]

    async def settled():
        result = await audit(kube, namespace)
        state = (len(result["bound"]), len(result["explained"]))
        done = not result["unexplained"] and sum(state) == PODS and previous[0] == state
        previous[0] = state
        return result if done else None

    result = await scheduling.wait_for(settled, timeout=60 + PODS, what="every pod bound or explained", interval=1.0)
    assert result["bound_without_claim"] == []

    whole: dict[tuple, list[str]] = defaultdict(list)
    shared_use: dict[tuple, int] = defaultdict(int)
    admin_results = 0
    for claim in result["claims"]:
        allocation = claim.status.allocation if claim.status else None
        if allocation is None:
            continue
        results = allocation.devices.results
        for r in results:
            key = (r.pool, r.device)
            if r.admin_access:
                admin_results += 1
            elif r.share_id:
                shared_use[key] += parse_quantity(r.consumed_capacity["memory"]).value
            else:
                whole[key].append(claim.metadata.name)
        if len(results) == 2:
            # the 2-GPU claims are the only ones with two results: both under one PCIe root
            assert roots[(results[0].pool, results[0].device)] == roots[(results[1].pool, results[1].device)], results
    twice = {k: v for k, v in whole.items() if len(v) > 1}
    assert twice == {}, twice
    assert all(used <= 80 * 2**30 for used in shared_use.values()), shared_use
    bound = len(result["bound"])
    print(f"\nmixed contention: {PODS} pods, {bound} bound, {len(result['explained'])} explained, "
          f"{len(whole)} GPUs held whole, {admin_results} adminAccess results, "
          f"{float(sum(shared_use.values())) / 2**30:.0f}Gi of shared capacity; {scheduling.diagnostics()}")
    # the admin claims and the shares found room: they never compete for whole devices
    assert admin_results > 0 and shared_use
    for pod in result["explained"]:
        condition = next(c for c in pod.status.conditions if c.type == "PodScheduled")
        assert condition.reason == "Unschedulable", condition
    for shard in scheduling.shards:
        assert shard.counters["errors"] == 0, shard.counters
