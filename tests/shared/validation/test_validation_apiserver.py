"""Conformance against the real kube-apiserver v1.37 (all DRA gates on): for each object, draplane's
validator and the apiserver agree on whether it is valid, and draplane names every field the
apiserver names. Objects are sent with dryRun=All, so nothing is stored.
"""

from __future__ import annotations

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
    "claim-constraint-names": lambda b: b.claim(constraints=[
        {"matchAttribute": v} for v in ("a/b/c", "x/0bad", "/x", "a/", "A.io/x", "a.io/" + "x" * 33)]),
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
    "slice-65-declarative": lambda b: b.slice([dict(
        b.device(f"mig-{i}", taints=[{"key": "k"}] if i == 2 else None,
                 consumesCounters=[{"counterSet": "g", "counters": {"m": {"value": "1"}}}] * (2 if i == 1 else 1)),
        **({"name": "Mig_3"} if i == 3 else {})) for i in range(65)]),
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
    # metadata
    "meta-labels": lambda b: dict(b.device_class(), metadata={"name": "c", "labels": {"-bad": "x", "ok": "-bad"},
                                                             "annotations": {"a/b/c": "x"}}),
    "meta-generate-name": lambda b: dict(b.device_class(), metadata={"generateName": "gpu-class-"}),
    "meta-claim-name": lambda b: dict(b.claim(), metadata={"name": "Claim_A"}),
    # more claim rules
    "claim-constraint-both": lambda b: b.claim(constraints=[{"matchAttribute": "x.io/a", "distinctAttribute": "x.io/b"}]),
    "claim-config-ref-subrequest": lambda b: b.claim([{"name": "gpu", "firstAvailable": [
        {"name": "big", "deviceClassName": "c"}]}], config=[
        {"requests": ["gpu/big", "gpu/small", "gpu"], "opaque": {"driver": "gpu.nvidia.com", "parameters": {"a": 1}}}]),
    "claim-capacity-bad-key": lambda b: b.claim([_req(b, capacity={"requests": {"bad-name": "1Gi"}})]),
    "claim-subrequest-count": lambda b: b.claim([{"name": "gpu", "firstAvailable": [
        {"name": "a", "deviceClassName": "c", "count": -2}, {"name": "b", "deviceClassName": "Bad_Class"}]}]),
    "claim-derived-unused": lambda b: b.claim([_req(b, derivedAttributes=[
        {"name": "derived/numa", "expression": 'device.attributes["gpu.nvidia.com"].numa'}])]),
    "claim-derived-used": lambda b: b.claim([_req(b, derivedAttributes=[
        {"name": "derived/numa", "expression": 'device.attributes["gpu.nvidia.com"].numa'}])],
        constraints=[{"matchAttribute": "derived/numa"}]),
    "claim-derived-bad-name": lambda b: b.claim([_req(b, derivedAttributes=[{"name": "numa", "expression": "1"}])],
                                                constraints=[{"matchAttribute": "x.io/numa"}]),
    "claim-toleration-bad-key": lambda b: b.claim([_req(b, tolerations=[{"key": "-k", "operator": "Exists"},
                                                                       {"key": "k", "value": "-v"}])]),
    "template-valid": lambda b: {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                                 "metadata": {"name": "t"}, "spec": {"metadata": {"labels": {"app": "vllm"}},
                                                                     "spec": b.claim()["spec"]}},
    "template-bad": lambda b: {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                               "metadata": {"name": "t"}, "spec": {"metadata": {"labels": {"-x": "y"}},
                                                                   "spec": b.claim([{"name": "gpu"}])["spec"]}},
    # more slice rules
    "slice-node-selector": lambda b: b.slice(nodeName=None, nodeSelector={"nodeSelectorTerms": [{"matchExpressions": [
        {"key": "zone", "operator": "In"}, {"key": "-bad", "operator": "Exists"}, {"key": "n", "operator": "Gt",
                                                                                  "values": ["x"]},
        {"key": "z", "operator": "Near", "values": ["a"]}]}]}),
    "slice-node-selector-values": lambda b: b.slice(nodeName=None, nodeSelector={"nodeSelectorTerms": [{
        "matchExpressions": [{"key": "zone", "operator": "In", "values": ["-odd value-", "x" * 70]},
                             {"key": "n", "operator": "Lt", "values": ["1", "2"]}],
        "matchFields": [{"key": "metadata.uid", "operator": "In", "values": ["a", "b"]}]}]}),
    "slice-node-selector-no-terms": lambda b: b.slice(nodeName=None, nodeSelector={"nodeSelectorTerms": []}),
    "slice-node-selector-valid": lambda b: b.slice(nodeName=None, nodeSelector={"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}],
         "matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-1"]}]}]}),
    "slice-empty-node-name": lambda b: b.slice(nodeName=""),
    "slice-bad-node-name": lambda b: b.slice(nodeName="Node_1"),
    "slice-valid-values": lambda b: b.slice([{"name": "gpu-0", "allowMultipleAllocations": True, "capacity": {
        "memory": {"value": "80Gi", "requestPolicy": {"default": "3Gi", "validValues": ["2Gi", "1Gi", "100Gi"]}}}}]),
    "slice-valid-values-ok": lambda b: b.slice([{"name": "gpu-0", "allowMultipleAllocations": True, "capacity": {
        "memory": {"value": "80Gi", "requestPolicy": {"default": "1Gi", "validValues": ["1Gi", "2Gi"]}}}}]),
    "slice-range-bounds": lambda b: b.slice([{"name": "gpu-0", "allowMultipleAllocations": True, "capacity": {
        "memory": {"value": "80Gi", "requestPolicy": {"default": "1Gi", "validRange": {"min": "4Gi", "max": "100Gi"}}}}}]),
    "slice-counter-names": lambda b: b.slice(None, sharedCounters=[{"name": "GPU_0", "counters": {"Mem_": {"value": "1"}}},
                                                                  {"name": "gpu-1"}]),
    "slice-33-counters": lambda b: b.slice(None, sharedCounters=[{"name": "gpu-0", "counters": {
        f"c{i}": {"value": "1"} for i in range(33)}}]),
    "slice-partition-type": lambda b: b.slice(partitionTypeAttribute="gpu.nvidia.com/profile"),
    "slice-skip-ops": lambda b: b.slice(skipNodeOperations=["NodePrepareResources"]),
    "slice-list-attrs-65": lambda b: b.slice([b.device(f"gpu-{i}", attributes={"models": {"strings": ["a", "b"]}})
                                              for i in range(65)]),
    "slice-version-list": lambda b: b.slice([{"name": "gpu-0", "attributes": {"v": {"versions": ["1.2.3", "1.2"]}}}]),
    "slice-attr-name-long": lambda b: b.slice([{"name": "gpu-0", "attributes": {"x" * 33: {"int": 1},
                                                                                 "a/b/c": {"int": 1}}}]),
    "slice-binding-5": lambda b: b.slice([b.device("gpu-0", bindingConditions=[f"c{i}" for i in range(5)],
                                                   bindingFailureConditions=["f"])]),
}


def _without_none(value):
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_none(v) for v in value]
    return value


_PLURALS = {"DeviceClass": "deviceclasses", "ResourceSlice": "resourceslices", "ResourceClaim": "resourceclaims",
            "ResourceClaimTemplate": "resourceclaimtemplates"}


async def _send(kube, raw, validation: str, namespace: str | None = None):
    query = {"dryRun": "All", "fieldValidation": validation}
    if namespace is None:
        path = raw_collection_path(raw)
    else:  # the object's own metadata may be broken on purpose, so the URL does not come from it
        scope = f"/namespaces/{namespace}" if raw["kind"] in ("ResourceClaim", "ResourceClaimTemplate") else ""
        path = f"/apis/resource.k8s.io/v1{scope}/{_PLURALS[raw['kind']]}"
    return await kube.request("POST", path, body=raw, query=query)


def _apiserver_fields(error: KubeApiError) -> set[str]:
    causes = (error.details or {}).get("causes") or []
    fields = {c.get("field") for c in causes if c.get("field")}
    if not fields:  # a strict-decoding error lists the fields in its message only
        fields = set(re.findall(r'unknown field "([^"]+)"', error.message))
    return fields


_SHAPE_PATHS = re.compile(r"(spec(?:\.spec)?\.devices\.requests\[\d+\]\.\w+)")


def _validated_fields(raw, problems) -> set[str]:
    """The fields draplane says the apiserver names when it drops unknown fields and validates."""
    fields = {p.field for p in problems if p.reason != UNKNOWN_FIELD}
    for p in problems:
        # The v1beta1 request shape: once its fields are dropped the request has neither exactly
        # nor firstAvailable, which the apiserver reports on the request itself.
        if p.reason == UNKNOWN_FIELD and p.field.endswith("]"):
            index = int(p.field.rsplit("[", 1)[1][:-1])
            spec = raw["spec"]["spec"] if raw["kind"] == "ResourceClaimTemplate" else raw["spec"]
            request = spec["devices"]["requests"][index]
            if "exactly" not in request and "firstAvailable" not in request:
                fields.add(p.field)
    return fields


_MAP_KEY = re.compile(r"\[([^\]]*[^\d\]][^\]]*)\]")


def _unknown_fields(problems) -> set[str]:
    """As the strict decoder names them: map keys as `.key`, not the validator's `[key]`."""
    return {_MAP_KEY.sub(r".\1", field) for field in _unknown_field_paths(problems)}


def _unknown_field_paths(problems) -> set[str]:
    fields = set()
    for p in problems:
        if p.reason != UNKNOWN_FIELD:
            continue
        if p.field.endswith("]"):  # the v1beta1 request shape names each misplaced field in its message
            fields.update(_SHAPE_PATHS.findall(p.message))
        else:
            fields.add(p.field)
    return fields


@pytest.mark.parametrize("case", list(CASES))
async def test_draplane_agrees_with_the_apiserver(case, build, kube, namespace):
    raw = _without_none(CASES[case](build))
    if raw["kind"] in ("ResourceClaim", "ResourceClaimTemplate"):
        raw["metadata"]["namespace"] = namespace
    mine = validate_object(raw)
    report = "draplane:\n" + "\n".join(str(p) for p in mine)
    # fieldValidation=Ignore: unknown fields are dropped, then the object is validated.
    try:
        await _send(kube, raw, "Ignore")
        validated = set()
    except KubeApiError as error:
        assert error.status == 422, error
        validated = _apiserver_fields(error)
    assert _validated_fields(raw, mine) == validated, report
    # fieldValidation=Strict, as kubectl sends it: unknown fields are rejected before validation.
    try:
        await _send(kube, raw, "Strict")
        unknown = set()
    except KubeApiError as error:
        unknown = _apiserver_fields(error) if error.status == 400 else set()
    assert _unknown_fields(mine) == unknown, report
