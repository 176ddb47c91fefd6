"""Randomised parity with the real kube-apiserver: valid objects are mutated (fields removed, values
swapped for awkward ones, list entries duplicated, unknown fields added) and sent with dryRun=All.
draplane must take the same decision and name the same fields. Deterministic: fixed seeds.
"""

from __future__ import annotations

import copy
import os
import random
from typing import Any

import pytest

from draplane.kube import KubeApiError
from draplane.validation import validate_object
from draplane.validation.problem import UNKNOWN_FIELD, WRONG_TYPE
from draplane.validation.schema import OBJECTS, ListOf, MapOf, Struct
from test_validation_apiserver import _apiserver_fields, _send, _unknown_fields, _validated_fields

pytestmark = pytest.mark.integration

# More rounds or another seed for a longer hunt: DRAPLANE_FUZZ_ROUNDS=5000 DRAPLANE_FUZZ_SEED=7
ROUNDS = int(os.environ.get("DRAPLANE_FUZZ_ROUNDS", "400"))
SEED = int(os.environ.get("DRAPLANE_FUZZ_SEED", "20260601"))

AWKWARD = [
    "", "Bad_Name", "-x", "x" * 70, "a/b/c", "gpu.nvidia.com/", "gpu.nvidia.com/memory", "memory", "0abc",
    "All", "ExactCount", "Exists", "Equal", "NoSchedule", "NoExecute", "None", "PreferNoSchedule", "In",
    "1.2.3", "v1", "80Gi", "-1", "1e3", "10 Gi", 'device.driver == "x"', "device.driver", "true",
    "gpu", "nic/fast", "nic/slow", "gpu/x", "FromClass", "derived/numa",
    -1, 0, 1, 33, 2**40, True, False, None, [], {}, ["x"], {"a": 1}, 1.5,
]


def base_objects(build, namespace: str) -> list[dict[str, Any]]:
    claim = build.claim([
        build.exact("gpu", count=2, selectors=[{"cel": {"expression": 'device.driver == "gpu.nvidia.com"'}}],
                    tolerations=[{"key": "example.com/unhealthy", "operator": "Exists", "effect": "NoSchedule"}]),
        {"name": "nic", "firstAvailable": [{"name": "fast", "deviceClassName": "nic", "count": 1},
                                           {"name": "any", "deviceClassName": "nic", "allocationMode": "All"}]},
    ], constraints=[{"requests": ["gpu", "nic/fast"], "matchAttribute": "resource.kubernetes.io/pcieRoot"}],
        config=[{"requests": ["gpu"], "opaque": {"driver": "gpu.nvidia.com", "parameters": {"a": 1}}}])
    claim["metadata"]["namespace"] = namespace
    slice_ = build.slice([
        build.device("gpu-0", taints=[{"key": "example.com/t", "value": "v", "effect": "NoSchedule"}],
                     bindingConditions=["Ready"], bindingFailureConditions=["Failed"]),
        {"name": "gpu-1", "allowMultipleAllocations": True, "attributes": {"v": {"version": "1.2.3"}},
         "capacity": {"memory": {"value": "80Gi", "requestPolicy": {
             "default": "8Gi", "validRange": {"min": "4Gi", "max": "64Gi", "step": "4Gi"}}}}},
    ])
    counters = build.slice(None, sharedCounters=[{"name": "gpu-0", "counters": {"memory": {"value": "80Gi"}}}])
    counters["metadata"]["name"] = "node-1-counters"
    per_device = build.slice([build.device("mig-0", nodeName="node-1", consumesCounters=[
        {"counterSet": "gpu-0", "counters": {"memory": {"value": "10Gi"}}}])], nodeName=None,
        perDeviceNodeSelection=True)
    selector_slice = build.slice(nodeName=None, nodeSelector={"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]})
    device_class = build.device_class('device.capacity["gpu.nvidia.com"].memory.isGreaterThan(quantity("40Gi"))',
                                      config=[{"opaque": {"driver": "gpu.nvidia.com", "parameters": {"a": 1}}}])
    template = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                "metadata": {"name": "vllm", "namespace": namespace},
                "spec": {"metadata": {"labels": {"app": "vllm"}}, "spec": copy.deepcopy(claim["spec"])}}
    # Claims carry the most rules, so they are drawn most often.
    return [claim, claim, template, slice_, counters, per_device, selector_slice, device_class]


def _nodes(value: Any, path: tuple = ()) -> list[tuple]:
    """Paths of every node below the top level, skipping apiVersion/kind/metadata.namespace."""
    found = []
    if isinstance(value, dict):
        for key, child in value.items():
            if not path and key in ("apiVersion", "kind"):
                continue
            if path == ("metadata",) and key == "namespace":
                continue
            found.append(path + (key,))
            found.extend(_nodes(child, path + (key,)))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            found.append(path + (index,))
            found.extend(_nodes(child, path + (index,)))
    return found


def _parent(obj: Any, path: tuple) -> Any:
    for step in path[:-1]:
        obj = obj[step]
    return obj


def _schema_at(obj: dict[str, Any], path: tuple) -> Any:
    """The schema node describing the value at `path`, or None where the object left the schema."""
    node: Any = OBJECTS.get(obj.get("kind"))
    for step in path:
        if isinstance(node, Struct) and isinstance(step, str):
            node = node.fields.get(step)
        elif isinstance(node, ListOf) and isinstance(step, int):
            node = node.item
        elif isinstance(node, MapOf) and isinstance(step, str):
            node = node.value
        else:
            return None
    return node


def _plausible(schema: Any, rng: random.Random) -> Any:
    """A value of roughly the right shape, so inserts reach the rules and not only the decoder."""
    if isinstance(schema, Struct):
        return {}
    if isinstance(schema, ListOf):
        return [_plausible(schema.item, rng)]
    if isinstance(schema, MapOf):
        return {rng.choice(("memory", "gpu.nvidia.com/cores", "k")): _plausible(schema.value, rng)}
    by_type = {"string": [a for a in AWKWARD if isinstance(a, str)], "integer": [-1, 0, 1, 33, 2**40],
               "boolean": [True, False], "quantity": ["1", "80Gi", "100m", "-1"], "time": ["2026-01-01T00:00:00Z"]}
    return copy.deepcopy(rng.choice(by_type.get(getattr(schema, "type", ""), AWKWARD)))


def mutate(obj: dict[str, Any], rng: random.Random, under: tuple = ()) -> list[str]:
    """1-3 random mutations, anywhere or only below the path `under`."""
    done = []
    for _ in range(rng.randint(1, 3)):
        nodes = [n for n in _nodes(obj) if n[:len(under)] == under and len(n) > len(under)]
        if not nodes:
            break
        path = rng.choice(nodes)
        parent = _parent(obj, path)
        key = path[-1]
        operation = rng.choice(("delete", "replace", "replace", "replace", "duplicate", "unknown", "grow",
                                "insert", "insert", "insert"))
        if operation == "delete":
            del parent[key]
        elif operation == "replace":
            parent[key] = copy.deepcopy(rng.choice(AWKWARD))
        elif operation == "duplicate" and isinstance(parent, list):
            parent.append(copy.deepcopy(parent[key]))
        elif operation == "grow" and isinstance(parent, list):
            parent.extend(copy.deepcopy(parent[key]) for _ in range(rng.choice((7, 31, 64, 128))))
        elif operation == "insert" and isinstance(parent[key], dict):
            schema = _schema_at(obj, path)
            missing = [f for f in getattr(schema, "fields", {}) if f not in parent[key]]
            if not missing:
                continue
            field = rng.choice(missing)
            parent[key][field] = _plausible(schema.fields[field], rng)
            path = path + (field,)
        elif operation == "unknown" and isinstance(parent[key], dict):
            parent[key][rng.choice(("extra", "deviceClassName", "count", "basic", "Name"))] = "x"
        else:
            continue
        done.append(f"{operation} {'.'.join(map(str, path))}")
    return done


async def test_mutated_objects_get_the_apiserver_verdict(build, kube, namespace):
    rng = random.Random(SEED)
    bases = base_objects(build, namespace)
    for base in bases:  # the starting points themselves are valid
        assert validate_object(base) == [], base
    mismatches = []
    for round_ in range(ROUNDS):
        obj = copy.deepcopy(rng.choice(bases))
        operations = mutate(obj, rng)
        mine = validate_object(obj)
        try:
            await _send(kube, obj, "Ignore", namespace)
            verdict, fields = "accepted", set()
        except KubeApiError as error:
            verdict = "undecodable" if error.status == 400 else "invalid"
            fields = _apiserver_fields(error) if error.status == 422 else set()
            if error.status not in (400, 422):
                raise
        my_types = any(p.reason == WRONG_TYPE for p in mine)
        if verdict == "undecodable" or my_types:
            agree = verdict == "undecodable" and my_types
        else:
            agree = _validated_fields(obj, mine) == fields
            if agree:
                try:
                    await _send(kube, obj, "Strict", namespace)
                    agree = not _unknown_fields(mine)
                except KubeApiError as error:
                    theirs = _apiserver_fields(error) if error.status == 400 else set()
                    # The strict decoder stops listing after 100 unknown fields.
                    agree = theirs <= _unknown_fields(mine) if len(theirs) == 100 else theirs == _unknown_fields(mine)
        if not agree:
            mismatches.append(f"round {round_} {obj['kind']} {operations}: apiserver {verdict} "
                              f"{sorted(fields)[:8]}; draplane {[str(p)[:200] for p in mine[:8]]}")
    assert not mismatches, "\n".join(mismatches[:15]) + f"\n({len(mismatches)} of {ROUNDS} rounds disagree)"


STATUS_ROUNDS = max(ROUNDS // 2, 1)


async def test_mutated_claim_statuses_get_the_apiserver_verdict(build, kube, namespace):
    """The allocation part: what draplane allocate reads as in-use and what the binder writes."""
    import json

    from test_validation_apiserver_status import STATUSES

    claim = build.claim([build.exact("gpu"), {"name": "nic", "firstAvailable": [
        {"name": "fast", "deviceClassName": "nic"}]}])
    claim["metadata"]["namespace"] = namespace
    base = f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims"
    created = json.loads(await kube.request("POST", base, body=claim))
    statuses = [STATUSES["valid"], STATUSES["valid-reserved"], STATUSES["device-status-valid"]]
    rng = random.Random(SEED + 1)
    mismatches = []
    for round_ in range(STATUS_ROUNDS):
        obj = copy.deepcopy(created)
        obj["status"] = copy.deepcopy(rng.choice(statuses))
        operations = mutate(obj, rng, under=("status",))
        mine = validate_object(obj)
        try:
            await kube.request("PUT", f"{base}/{claim['metadata']['name']}/status", body=obj, query={"dryRun": "All"})
            verdict, fields = "accepted", set()
        except KubeApiError as error:
            if error.status not in (400, 422):
                raise
            verdict = "undecodable" if error.status == 400 else "invalid"
            fields = _apiserver_fields(error) if error.status == 422 else set()
        my_types = any(p.reason == WRONG_TYPE for p in mine)
        if verdict == "undecodable" or my_types:
            agree = verdict == "undecodable" and my_types
        else:
            # A status update is not strictly decoded, so unknown fields are dropped silently.
            agree = {p.field for p in mine if p.reason != UNKNOWN_FIELD} == fields
        if not agree:
            mismatches.append(f"round {round_} {operations}: apiserver {verdict} {sorted(fields)[:8]}; "
                              f"draplane {[str(p)[:200] for p in mine[:8]]}")
    assert not mismatches, "\n".join(mismatches[:15]) + f"\n({len(mismatches)} of {STATUS_ROUNDS} rounds disagree)"
