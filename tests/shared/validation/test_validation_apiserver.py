"""Conformance against the real kube-apiserver v1.37 (all DRA gates on): for each object, draplane's
validator and the apiserver agree on whether it is valid, and draplane names every field the
apiserver names. Objects are sent with dryRun=All, so nothing is stored.
"""

from __future__ import annotations

import json
import re

import pytest

from draplane.kube import KubeApiError
from draplane.kube.client import raw_collection_path
from draplane.validation import validate_object
from draplane.validation.problem import UNKNOWN_FIELD

pytestmark = pytest.mark.integration

LONG_CEL = " || ".join(['device.driver == "gpu.nvidia.com"'] * 400)
TAINT = {"key": "example.com/unhealthy", "effect": "NoSchedule"}


def _req(b, **fields):
    return b.exact("gpu", **fields)


CASES = {
    # DeviceClass
    "class-valid": lambda b: b.device_class('device.driver == "gpu.nvidia.com"'),
    "class-neutral-memory": lambda b: b.device_class(
        '"memory" in device.capacity[device.driver] && '
        'device.capacity[device.driver].memory.isGreaterThan(quantity("40Gi"))'),
    "class-seed-cel": lambda b: b.device_class('device.capacity["memory"].isGreaterThan(quantity("40Gi"))'),
    "class-syntax": lambda b: b.device_class('device.driver == "gpu.nvidia.com" &&'),
    "class-type": lambda b: b.device_class("device.driver > 3"),
    "class-not-bool": lambda b: b.device_class("device.driver"),
    "class-undeclared": lambda b: b.device_class('devices.driver == "a"'),
    "class-too-long": lambda b: b.device_class(LONG_CEL),
    "class-33-selectors": lambda b: b.device_class(*['device.driver == "a.b"'] * 33),
    "class-bad-name": lambda b: b.device_class(name="High_Memory"),
    "class-no-cel": lambda b: dict(b.device_class(), spec={"selectors": [{}]}),
    "class-config-no-opaque": lambda b: b.device_class(config=[{}]),
    "class-config-params-list": lambda b: b.device_class(
        config=[{"opaque": {"driver": "gpu.nvidia.com", "parameters": [1, 2]}}]),
    "class-semver": lambda b: b.device_class(
        'device.attributes["gpu.nvidia.com"].driverVersion.isGreaterThan(semver("550.0.0"))'),
    # ResourceClaim
    "claim-valid": lambda b: b.claim([
        _req(b, count=2),
        {"name": "nic", "firstAvailable": [{"name": "fast", "deviceClassName": "nic"},
                                           {"name": "any", "deviceClassName": "nic", "allocationMode": "All"}]},
    ], constraints=[{"requests": ["gpu", "nic/fast"], "matchAttribute": "resource.kubernetes.io/pcieRoot"}],
        config=[{"requests": ["gpu"], "opaque": {"driver": "gpu.nvidia.com", "parameters": {"a": 1}}}]),
    "claim-seed-shape": lambda b: b.claim([{"name": "gpu", "deviceClassName": "high-memory-gpu", "count": 1}]),
    "claim-no-exactly": lambda b: b.claim([{"name": "gpu"}]),
    "claim-both": lambda b: b.claim([dict(_req(b), firstAvailable=[{"name": "a", "deviceClassName": "c"}])]),
    "claim-33-requests": lambda b: b.claim([b.exact(f"r{i}") for i in range(33)]),
    "claim-32-requests": lambda b: b.claim([b.exact(f"r{i}") for i in range(32)]),
    "claim-dup-requests": lambda b: b.claim([b.exact("gpu"), b.exact("gpu")]),
    "claim-bad-request-name": lambda b: b.claim([b.exact("GPU_0")]),
    "claim-no-class": lambda b: b.claim([{"name": "gpu", "exactly": {"count": 1}}]),
    "claim-bad-mode": lambda b: b.claim([_req(b, allocationMode="Some")]),
    "claim-negative-count": lambda b: b.claim([_req(b, count=-1)]),
    "claim-all-with-count": lambda b: b.claim([_req(b, allocationMode="All", count=2)]),
    "claim-9-subrequests": lambda b: b.claim([{"name": "gpu", "firstAvailable": [
        {"name": f"s{i}", "deviceClassName": "c"} for i in range(9)]}]),
    "claim-dup-subrequests": lambda b: b.claim([{"name": "gpu", "firstAvailable": [
        {"name": "s", "deviceClassName": "c"}, {"name": "s", "deviceClassName": "c"}]}]),
    "claim-tolerations": lambda b: b.claim([_req(b, tolerations=[
        {"key": "k", "operator": "Exists", "effect": "NoExecute"}, {"operator": "Exists", "value": "v"},
        {"key": "k", "operator": "In"}, {"key": "k", "operator": "Exists", "effect": "PreferNoSchedule"}])]),
    "claim-17-tolerations": lambda b: b.claim([_req(b, tolerations=[{"operator": "Exists"}] * 17)]),
    "claim-constraints": lambda b: b.claim([b.exact("gpu"), b.exact("nic")], constraints=[
        {"requests": ["gpu", "nope"], "matchAttribute": "resource.kubernetes.io/pcieRoot"},
        {"matchAttribute": "pcieRoot"}, {"requests": ["gpu"]},
        {"requests": ["gpu/a/b"], "distinctAttribute": "gpu.nvidia.com/uuid"}]),
    "claim-33-constraints": lambda b: b.claim(constraints=[{"matchAttribute": "x.io/a"}] * 33),
    "claim-config": lambda b: b.claim(config=[
        {"requests": ["gpu"]}, {"opaque": {"driver": "gpu.nvidia.com"}},
        {"opaque": {"driver": "Bad_Driver", "parameters": {"a": 1}}},
        {"opaque": {"driver": "gpu.nvidia.com", "parameters": {"blob": "x" * 11000}}}]),
    "claim-selector-type-error": lambda b: b.claim([_req(b, selectors=[{"cel": {"expression": "device.driver > 1"}}])]),
    "claim-capacity-request": lambda b: b.claim([_req(b, capacity={"requests": {"memory": "10Gi"}})]),
    "claim-unknown-field": lambda b: b.claim([{"name": "gpu", "exactly": {"deviceClassName": "c", "cuont": 1}}]),
    # ResourceSlice
    "slice-valid": lambda b: b.slice(),
    "slice-128": lambda b: b.slice([b.device(f"gpu-{i}") for i in range(128)]),
    "slice-129": lambda b: b.slice([b.device(f"gpu-{i}") for i in range(129)]),
    "slice-65-tainted": lambda b: b.slice([b.device(f"gpu-{i}", taints=[TAINT] if i == 0 else None) for i in range(65)]),
    "slice-64-tainted": lambda b: b.slice([b.device(f"gpu-{i}", taints=[TAINT]) for i in range(64)]),
    "slice-dup-devices": lambda b: b.slice([b.device("gpu-0"), b.device("gpu-0")]),
    "slice-bad-device-name": lambda b: b.slice([b.device("GPU_0")]),
    "slice-no-node": lambda b: b.slice(nodeName=None),
    "slice-two-nodes": lambda b: b.slice(allNodes=True),
    "slice-all-nodes-false": lambda b: b.slice(nodeName=None, allNodes=False),
    "slice-pool": lambda b: b.slice(pool={"name": "Node_1", "generation": -1, "resourceSliceCount": 0}),
    "slice-driver": lambda b: b.slice(driver="GPU_driver"),
    "slice-33-attrs": lambda b: b.slice([{"name": "gpu-0", "attributes": {f"a{i}": {"int": i} for i in range(30)},
                                          "capacity": {f"c{i}": {"value": "1"} for i in range(3)}}]),
    "slice-attr-values": lambda b: b.slice([{"name": "gpu-0", "attributes": {
        "both": {"int": 1, "string": "x"}, "none": {}, "long": {"string": "x" * 65}, "ver": {"version": "v12.4"},
        "0bad": {"bool": True}, "empty": {"strings": []}}}]),
    "slice-policy-no-multi": lambda b: b.slice([{"name": "gpu-0", "capacity": {"memory": {
        "value": "80Gi", "requestPolicy": {"default": "10Gi", "validValues": ["10Gi", "20Gi"]}}}}]),
    "slice-policy-range": lambda b: b.slice([{"name": "gpu-0", "allowMultipleAllocations": True, "capacity": {
        "memory": {"value": "80Gi", "requestPolicy": {"default": "6Gi", "validRange": {
            "min": "4Gi", "max": "64Gi", "step": "4Gi"}}}}}]),
    "slice-counters": lambda b: b.slice(None, sharedCounters=[
        {"name": f"gpu-{i}", "counters": {"memory": {"value": "80Gi"}}} for i in range(9)]),
    "slice-counters-and-devices": lambda b: b.slice(sharedCounters=[{"name": "g", "counters": {"m": {"value": "1"}}}]),
    "slice-consumes": lambda b: b.slice([b.device("mig-0", consumesCounters=[
        {"counterSet": "gpu-0", "counters": {"memory": {"value": "10Gi"}}}] * 2)]),
    "slice-taints": lambda b: b.slice([b.device("gpu-0", taints=[
        {"key": "k"}, {"key": "k", "effect": "PreferNoSchedule"}, {"effect": "None"}])]),
    "slice-per-device": lambda b: b.slice([b.device("gpu-0", nodeName="node-1"), b.device("gpu-1")],
                                          nodeName=None, perDeviceNodeSelection=True),
    "slice-device-node-without-per-device": lambda b: b.slice([b.device("gpu-0", allNodes=True)]),
    "slice-binding": lambda b: b.slice([b.device("gpu-0", bindingConditions=["Ready"],
                                                 bindingFailureConditions=["Ready"])]),
    "slice-basic-v1beta1": lambda b: b.slice([{"name": "gpu-0", "basic": {"attributes": {"a": {"int": 1}}}}]),
}


def _without_none(value):
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_none(v) for v in value]
    return value


async def _send(kube, raw, validation: str):
    query = {"dryRun": "All", "fieldValidation": validation}
    return await kube.request("POST", raw_collection_path(raw), body=raw, query=query)


def _apiserver_fields(error: KubeApiError) -> set[str]:
    causes = (error.details or {}).get("causes") or []
    fields = {c.get("field") for c in causes if c.get("field")}
    if not fields:  # a strict-decoding error lists the fields in its message only
        fields = set(re.findall(r'unknown field "([^"]+)"', error.message))
    return fields


def _covered(field: str, problems) -> bool:
    return any(p.field == field or field.startswith(p.field + ".") or field.startswith(p.field + "[")
               or p.field.startswith(field + ".") or p.field.startswith(field + "[") or field in p.message
               for p in problems)


@pytest.mark.parametrize("case", list(CASES))
async def test_draplane_agrees_with_the_apiserver(case, build, kube, namespace):
    raw = _without_none(CASES[case](build))
    if raw["kind"] == "ResourceClaim":
        raw["metadata"]["namespace"] = namespace
    mine = validate_object(raw)
    # Ignore mode: unknown fields are dropped and the object is validated; compare the rest.
    try:
        await _send(kube, raw, "Ignore")
        apiserver_fields: set[str] | None = None
    except KubeApiError as error:
        assert error.status in (400, 422), error
        apiserver_fields = _apiserver_fields(error)
    semantic = [p for p in mine if p.reason != UNKNOWN_FIELD
                or not p.field.startswith("spec.devices.requests")]  # the v1beta1 shape is both
    shape_only = [p for p in mine if p.reason == UNKNOWN_FIELD]
    report = json.dumps({"apiserver": sorted(apiserver_fields or []),
                         "draplane": [str(p) for p in mine]}, indent=1)
    if apiserver_fields is None:
        assert [p for p in mine if p.reason != UNKNOWN_FIELD] == [], report
    else:
        assert semantic or shape_only, report
        for field in apiserver_fields:
            assert _covered(field, mine), f"draplane does not name {field}\n{report}"
    # Strict mode: what kubectl sends; unknown fields are named by the apiserver and by draplane alike.
    unknown = [p for p in mine if p.reason == UNKNOWN_FIELD]
    try:
        await _send(kube, raw, "Strict")
        assert not unknown, report
    except KubeApiError as error:
        if error.status == 400:
            for field in _apiserver_fields(error):
                assert _covered(field, unknown), f"draplane does not name unknown field {field}\n{report}"
