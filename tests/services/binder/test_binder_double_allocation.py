"""Another scheduler writes one GPU into two claims (as kube-scheduler beside draplane can, over
the same slices): the live binder reports it as a Warning Event on both claims, a metric and an
audit record; an adminAccess claim on the same device is not reported."""

from __future__ import annotations

import json

import pytest

from draplane.api.resource import ResourceClaim
from draplane.messages import audit

from conftest import eventually  # noqa: E402  (tests/services/conftest.py)
from test_preemption_flows import audit_events  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def claim(name: str, *, admin: bool = False) -> dict:
    exactly = {"deviceClassName": "gpu.nvidia.com"}
    if admin:
        exactly["adminAccess"] = True
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}}


async def allocate_elsewhere(kube, namespace: str, name: str, device: str, *, admin: bool = False) -> None:
    """What another scheduler writes: the claim's allocation, through the status subresource."""
    result = {"request": "gpu", "driver": "gpu.nvidia.com", "pool": "other-node", "device": device}
    if admin:
        result["adminAccess"] = True
    selector = {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In",
                                                         "values": ["other-node"]}]}]}
    await kube.patch(ResourceClaim, name, {"status": {"allocation": {"devices": {"results": [result]},
                                                                      "nodeSelector": selector}}},
                     namespace, subresource="status")


async def test_a_device_allocated_to_two_claims_is_reported_on_both(scheduling, kube, kubectl, namespace, nats,
                                                                     subject_prefix):
    await scheduling.start()
    await kubectl("label", "namespace", namespace, "resource.kubernetes.io/admin-access=true")
    await kubectl("-n", namespace, "apply", "-f", "-",
                  stdin="\n---\n".join(json.dumps(c) for c in (claim("first"), claim("second"), claim("monitor", admin=True),
                                                                claim("elsewhere"))))
    for name, device in (("first", "gpu-3"), ("monitor", "gpu-3"), ("elsewhere", "gpu-4")):
        await allocate_elsewhere(kube, namespace, name, device, admin=name == "monitor")
    await allocate_elsewhere(kube, namespace, "second", "gpu-3")

    async def warnings():
        found = json.loads(await kubectl("-n", namespace, "get", "events", "-o", "json",
                                         "--field-selector", "reason=DeviceAllocatedTwice"))["items"]
        return found if len(found) >= 2 else None

    events = await eventually(warnings, timeout=30, what="DeviceAllocatedTwice events")
    assert sorted(e["involvedObject"]["name"] for e in events) == ["first", "second"]
    assert all(e["involvedObject"]["kind"] == "ResourceClaim" and e["type"] == "Warning" for e in events)
    assert ("device gpu.nvidia.com/other-node/gpu-3 is allocated to both ResourceClaim" in events[0]["message"]
            and "adminAccess" in events[0]["message"])
    assert scheduling.binder.metrics.double_allocations._value.get() == 1

    async def conflicts():
        return await audit_events(nats, subject_prefix, "conflict") or None

    (record,) = await eventually(conflicts, timeout=30, what="the audit record")
    assert record.kind == "conflict" and record.node == "other-node"
    assert sorted(c.name for c in record.claims) == ["first", "second"]
    assert all(c.devices[0].device == "gpu-3" for c in record.claims)
    assert record.id == audit.double_allocation_id(
        "gpu.nvidia.com/other-node/gpu-3/" + "/".join(sorted(c.uid for c in record.claims)))
