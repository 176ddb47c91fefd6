"""Claim status (what draplane allocate reads as "in use" and the binder writes) against the real
kube-apiserver v1.37: a claim is created, then its status is updated with dryRun=All, so the
apiserver validates the allocation exactly as it would validate the binder's write."""

from __future__ import annotations

import json

import pytest

from draplane.kube import KubeApiError
from draplane.validation import validate_object

pytestmark = pytest.mark.integration

RESULT = {"request": "gpu", "driver": "gpu.nvidia.com", "pool": "node-1", "device": "gpu-0"}
SELECTOR = {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-1"]}]}]}
CONFIG = {"source": "FromClaim", "requests": ["gpu"], "opaque": {"driver": "gpu.nvidia.com", "parameters": {"a": 1}}}

STATUSES = {
    "valid": {"allocation": {"devices": {"results": [RESULT], "config": [CONFIG]}, "nodeSelector": SELECTOR}},
    "valid-reserved": {"allocation": {"devices": {"results": [RESULT]}},
                       "reservedFor": [{"resource": "pods", "name": "p", "uid": "8b1c6d1e-0b0c-4a47-9d3f-0e4c9a1f2b3c"}]},
    "33-results": {"allocation": {"devices": {"results": [dict(RESULT, device=f"gpu-{i}") for i in range(33)]}}},
    "unknown-request": {"allocation": {"devices": {"results": [dict(RESULT, request="tpu")]}}},
    "bad-names": {"allocation": {"devices": {"results": [dict(RESULT, driver="Bad_Driver", pool="Node_1",
                                                              device="GPU_0")]}}},
    "bad-share-id": {"allocation": {"devices": {"results": [dict(RESULT, shareID="NOT-A-UUID")]}}},
    "upper-share-id": {"allocation": {"devices": {"results": [dict(RESULT, shareID="8B1C6D1E-0B0C-4A47-9D3F-0E4C9A1F2B3C")]}}},
    "bad-config": {"allocation": {"devices": {"results": [RESULT], "config": [
        {"source": "FromSomewhere", "opaque": {"driver": "gpu.nvidia.com", "parameters": {"a": 1}}},
        {"source": "FromClass"}, {"source": "FromClaim", "requests": ["nope"],
                                  "opaque": {"driver": "gpu.nvidia.com", "parameters": {}}}]}}},
    "reserved-without-allocation": {"reservedFor": [{"resource": "pods", "name": "p",
                                                     "uid": "8b1c6d1e-0b0c-4a47-9d3f-0e4c9a1f2b3c"}]},
    "reserved-incomplete": {"allocation": {"devices": {"results": [RESULT]}}, "reservedFor": [{"resource": "pods"}]},
    "binding-conditions": {"allocation": {"devices": {"results": [dict(RESULT, bindingConditions=["Ready"])]}}},
    "bad-node-selector": {"allocation": {"devices": {"results": [RESULT]}, "nodeSelector": {"nodeSelectorTerms": []}}},
    "device-status-valid": {"allocation": {"devices": {"results": [RESULT]}}, "devices": [dict(
        driver="gpu.nvidia.com", pool="node-1", device="gpu-0", data={"a": 1},
        conditions=[{"type": "Ready", "status": "True", "reason": "Prepared",
                     "lastTransitionTime": "2026-01-01T00:00:00Z"}],
        networkData={"interfaceName": "eth1", "ips": ["192.0.2.5/24", "2001:db8::5/64"], "hardwareAddress": "aa"})]},
    "device-status-bad": {"allocation": {"devices": {"results": [RESULT]}}, "devices": [
        dict(driver="gpu.nvidia.com", pool="node-1", device="gpu-9"),
        dict(driver="gpu.nvidia.com", pool="node-1", device="gpu-0", data=[1],
             conditions=[{"type": "-Ready", "status": "Maybe", "reason": "not ok"}],
             networkData={"interfaceName": "x" * 300, "ips": ["192.0.2.5", "192.0.2.6/24", "192.0.2.6/24"]}),
        dict(driver="gpu.nvidia.com", pool="node-1", device="gpu-0")]},
    "device-status-9-conditions": {"allocation": {"devices": {"results": [RESULT]}}, "devices": [dict(
        driver="gpu.nvidia.com", pool="node-1", device="gpu-0",
        conditions=[{"type": f"C{i}", "status": "True", "reason": "R", "lastTransitionTime": "2026-01-01T00:00:00Z"}
                    for i in range(9)])]},
    "bad-toleration": {"allocation": {"devices": {"results": [dict(RESULT, tolerations=[{"operator": "Exists", "value": "x"}])]}}},
}


@pytest.mark.parametrize("case", list(STATUSES))
async def test_claim_status_verdict_matches_the_apiserver(case, build, kube, namespace):
    claim = build.claim()
    claim["metadata"]["namespace"] = namespace
    claim["metadata"]["name"] = f"claim-{case}"
    base = f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims"
    created = json.loads(await kube.request("POST", base, body=claim))
    created["status"] = STATUSES[case]
    mine = {p.field for p in validate_object(created)}
    try:
        await kube.request("PUT", f"{base}/{claim['metadata']['name']}/status", body=created, query={"dryRun": "All"})
        theirs = set()
    except KubeApiError as error:
        assert error.status == 422, error
        theirs = {c.get("field") for c in (error.details or {}).get("causes") or []}
    assert mine == theirs, f"apiserver {sorted(theirs)}; draplane {sorted(mine)}"


async def test_objects_as_the_apiserver_returns_them_are_valid(build, kube, namespace):
    """Server-filled fields (uid, resourceVersion, managedFields, timeAdded, defaults) pass the schema."""
    slice_ = build.slice([build.device("gpu-0", taints=[{"key": "example.com/t", "effect": "NoSchedule"}])])
    slice_["metadata"]["name"] = f"returned-{namespace}"[:63]
    claim = build.claim([build.exact("gpu", tolerations=[{"operator": "Exists"}])])
    claim["metadata"]["namespace"] = namespace
    returned = [
        json.loads(await kube.request("POST", "/apis/resource.k8s.io/v1/resourceslices", body=slice_,
                                      query={"dryRun": "All"})),
        json.loads(await kube.request("POST", f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims",
                                      body=claim, query={"dryRun": "All"})),
        json.loads(await kube.request("POST", "/apis/resource.k8s.io/v1/deviceclasses",
                                      body=build.device_class('device.driver == "gpu.nvidia.com"'),
                                      query={"dryRun": "All"})),
    ]
    assert returned[0]["spec"]["devices"][0]["taints"][0].get("timeAdded")  # filled in by the server
    assert returned[1]["spec"]["devices"]["requests"][0]["exactly"]["allocationMode"] == "ExactCount"
    for obj in returned:
        assert validate_object(obj) == [], obj
