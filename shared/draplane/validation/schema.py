"""The resource.k8s.io/v1 object schemas, and the check the apiserver's decoder makes against them.

The apiserver decodes JSON into Go structs before any validation runs: a field it does not know is
an "unknown field" (rejected with `kubectl --validate=strict`, the default, and silently dropped
otherwise), and a value of the wrong JSON type cannot be decoded at all. `check_schema` reports both
and returns a cleaned copy (unknown and ill-typed values removed) for the semantic rules to read, so
those rules never have to guard against a string where a list belongs.

Field lists follow k8s.io/api/resource/v1 of Kubernetes 1.37, including feature-gated fields,
which the apiserver knows (and drops when the gate is off) rather than treating as unknown.
"""

from __future__ import annotations

import datetime
import difflib
import re
from dataclasses import dataclass, field
from typing import Any

from draplane.api.quantity import QuantityError, parse_quantity
from draplane.validation.problem import UNKNOWN_FIELD, WRONG_TYPE, Findings


@dataclass(frozen=True, slots=True)
class Scalar:
    type: str  # string | integer | boolean | quantity | time | any


@dataclass(frozen=True, slots=True)
class ListOf:
    item: Any


@dataclass(frozen=True, slots=True)
class MapOf:
    value: Any


@dataclass(frozen=True, slots=True)
class Struct:
    name: str
    fields: dict[str, Any]
    # Names that are not fields here but which a semantic rule explains better than "unknown field"
    # (for instance the v1beta1 request shape); the walker leaves them to that rule.
    explained_elsewhere: frozenset[str] = field(default_factory=frozenset)


STRING = Scalar("string")
INTEGER = Scalar("integer")
BOOLEAN = Scalar("boolean")
QUANTITY = Scalar("quantity")
TIME = Scalar("time")
ANY = Scalar("any")  # runtime.RawExtension and other free-form JSON

# --- apimachinery / core -------------------------------------------------------------------------

OWNER_REFERENCE = Struct("OwnerReference", {
    "apiVersion": STRING, "kind": STRING, "name": STRING, "uid": STRING,
    "controller": BOOLEAN, "blockOwnerDeletion": BOOLEAN,
})

OBJECT_META = Struct("ObjectMeta", {
    "name": STRING, "generateName": STRING, "namespace": STRING, "selfLink": STRING, "uid": STRING,
    "resourceVersion": STRING, "generation": INTEGER, "creationTimestamp": TIME,
    "deletionTimestamp": TIME, "deletionGracePeriodSeconds": INTEGER,
    "labels": MapOf(STRING), "annotations": MapOf(STRING),
    "ownerReferences": ListOf(OWNER_REFERENCE), "finalizers": ListOf(STRING),
    "managedFields": ListOf(Struct("ManagedFieldsEntry", {
        "manager": STRING, "operation": STRING, "apiVersion": STRING, "time": TIME, "fieldsType": STRING,
        "fieldsV1": ANY, "subresource": STRING,
    })),
})

NODE_SELECTOR_REQUIREMENT = Struct("NodeSelectorRequirement", {
    "key": STRING, "operator": STRING, "values": ListOf(STRING),
})

NODE_SELECTOR = Struct("NodeSelector", {
    "nodeSelectorTerms": ListOf(Struct("NodeSelectorTerm", {
        "matchExpressions": ListOf(NODE_SELECTOR_REQUIREMENT),
        "matchFields": ListOf(NODE_SELECTOR_REQUIREMENT),
    })),
})

CONDITION = Struct("Condition", {
    "type": STRING, "status": STRING, "observedGeneration": INTEGER, "lastTransitionTime": TIME,
    "reason": STRING, "message": STRING,
})

# --- shared resource.k8s.io pieces ---------------------------------------------------------------

DEVICE_SELECTOR = Struct("DeviceSelector", {
    "cel": Struct("CELDeviceSelector", {"expression": STRING}),
})

OPAQUE = Struct("OpaqueDeviceConfiguration", {"driver": STRING, "parameters": ANY})

DEVICE_TOLERATION = Struct("DeviceToleration", {
    "key": STRING, "operator": STRING, "value": STRING, "effect": STRING, "tolerationSeconds": INTEGER,
})

DEVICE_TAINT = Struct("DeviceTaint", {"key": STRING, "value": STRING, "effect": STRING, "timeAdded": TIME})

CAPACITY_REQUIREMENTS = Struct("CapacityRequirements", {"requests": MapOf(QUANTITY)})

DERIVED_ATTRIBUTE = Struct("DeviceDerivedAttribute", {"name": STRING, "expression": STRING})

# Fields of ExactDeviceRequest; under v1beta1 they sat directly in the request.
EXACT_FIELDS = {
    "deviceClassName": STRING,
    "selectors": ListOf(DEVICE_SELECTOR),
    "allocationMode": STRING,
    "count": INTEGER,
    "adminAccess": BOOLEAN,
    "tolerations": ListOf(DEVICE_TOLERATION),
    "capacity": CAPACITY_REQUIREMENTS,
    "derivedAttributes": ListOf(DERIVED_ATTRIBUTE),
}

EXACT_DEVICE_REQUEST = Struct("ExactDeviceRequest", EXACT_FIELDS)

DEVICE_SUB_REQUEST = Struct("DeviceSubRequest", {
    "name": STRING,
    **{k: v for k, v in EXACT_FIELDS.items() if k != "adminAccess"},
})

DEVICE_REQUEST = Struct(
    "DeviceRequest",
    {"name": STRING, "exactly": EXACT_DEVICE_REQUEST, "firstAvailable": ListOf(DEVICE_SUB_REQUEST)},
    explained_elsewhere=frozenset(EXACT_FIELDS),
)

DEVICE_CLAIM = Struct("DeviceClaim", {
    "requests": ListOf(DEVICE_REQUEST),
    "constraints": ListOf(Struct("DeviceConstraint", {
        "requests": ListOf(STRING), "matchAttribute": STRING, "distinctAttribute": STRING,
    })),
    "config": ListOf(Struct("DeviceClaimConfiguration", {"requests": ListOf(STRING), "opaque": OPAQUE})),
})

RESOURCE_CLAIM_SPEC = Struct("ResourceClaimSpec", {"devices": DEVICE_CLAIM})

ALLOCATION_RESULT = Struct("AllocationResult", {
    "devices": Struct("DeviceAllocationResult", {
        "results": ListOf(Struct("DeviceRequestAllocationResult", {
            "request": STRING, "driver": STRING, "pool": STRING, "device": STRING,
            "adminAccess": BOOLEAN, "tolerations": ListOf(DEVICE_TOLERATION),
            "bindingConditions": ListOf(STRING), "bindingFailureConditions": ListOf(STRING),
            "shareID": STRING, "consumedCapacity": MapOf(QUANTITY), "skipNodeOperations": ListOf(STRING),
        })),
        "config": ListOf(Struct("DeviceAllocationConfiguration", {
            "source": STRING, "requests": ListOf(STRING), "opaque": OPAQUE,
        })),
    }),
    "nodeSelector": NODE_SELECTOR,
    "allocationTimestamp": TIME,
})

RESOURCE_CLAIM_STATUS = Struct("ResourceClaimStatus", {
    "allocation": ALLOCATION_RESULT,
    "reservedFor": ListOf(Struct("ResourceClaimConsumerReference", {
        "apiGroup": STRING, "resource": STRING, "name": STRING, "uid": STRING,
    })),
    "devices": ListOf(Struct("AllocatedDeviceStatus", {
        "driver": STRING, "pool": STRING, "device": STRING, "shareID": STRING,
        "conditions": ListOf(CONDITION), "data": ANY,
        "networkData": Struct("NetworkDeviceData", {
            "interfaceName": STRING, "ips": ListOf(STRING), "hardwareAddress": STRING,
        }),
    })),
})

# --- ResourceSlice -------------------------------------------------------------------------------

DEVICE_ATTRIBUTE = Struct("DeviceAttribute", {
    "int": INTEGER, "bool": BOOLEAN, "string": STRING, "version": STRING,
    "ints": ListOf(INTEGER), "bools": ListOf(BOOLEAN), "strings": ListOf(STRING), "versions": ListOf(STRING),
})

DEVICE_CAPACITY = Struct("DeviceCapacity", {
    "value": QUANTITY,
    "requestPolicy": Struct("CapacityRequestPolicy", {
        "default": QUANTITY,
        "validValues": ListOf(QUANTITY),
        "validRange": Struct("CapacityRequestPolicyRange", {"min": QUANTITY, "max": QUANTITY, "step": QUANTITY}),
    }),
})

COUNTER = Struct("Counter", {"value": QUANTITY})

DEVICE = Struct("Device", {
    "name": STRING,
    "attributes": MapOf(DEVICE_ATTRIBUTE),
    "capacity": MapOf(DEVICE_CAPACITY),
    "consumesCounters": ListOf(Struct("DeviceCounterConsumption", {
        "counterSet": STRING, "counters": MapOf(COUNTER), "compatibilityGroups": ListOf(STRING),
    })),
    "nodeName": STRING,
    "nodeSelector": NODE_SELECTOR,
    "allNodes": BOOLEAN,
    "taints": ListOf(DEVICE_TAINT),
    "bindsToNode": BOOLEAN,
    "bindingConditions": ListOf(STRING),
    "bindingFailureConditions": ListOf(STRING),
    "allowMultipleAllocations": BOOLEAN,
    "nodeAllocatableResources": MapOf(Struct("NodeAllocatableResource", {
        "mapping": Struct("NodeAllocatableMapping", {
            "capacityKey": STRING, "capacityMultiplier": QUANTITY, "deviceMultiplier": QUANTITY,
        }),
        "overhead": Struct("NodeAllocatableOverhead", {"perPod": QUANTITY, "perContainer": QUANTITY}),
    })),
}, explained_elsewhere=frozenset({"basic"}))

RESOURCE_SLICE_SPEC = Struct("ResourceSliceSpec", {
    "driver": STRING,
    "pool": Struct("ResourcePool", {"name": STRING, "generation": INTEGER, "resourceSliceCount": INTEGER}),
    "nodeName": STRING,
    "nodeSelector": NODE_SELECTOR,
    "allNodes": BOOLEAN,
    "devices": ListOf(DEVICE),
    "perDeviceNodeSelection": BOOLEAN,
    "sharedCounters": ListOf(Struct("CounterSet", {"name": STRING, "counters": MapOf(COUNTER)})),
    "partitionTypeAttribute": STRING,
    "skipNodeOperations": ListOf(STRING),
})

# --- DeviceClass ---------------------------------------------------------------------------------

DEVICE_CLASS_SPEC = Struct("DeviceClassSpec", {
    "selectors": ListOf(DEVICE_SELECTOR),
    "config": ListOf(Struct("DeviceClassConfiguration", {"opaque": OPAQUE})),
    "extendedResourceName": STRING,
})

# --- top-level objects ---------------------------------------------------------------------------

_TYPE_META = {"apiVersion": STRING, "kind": STRING, "metadata": OBJECT_META}

DEVICE_TAINT_RULE_SPEC = Struct("DeviceTaintRuleSpec", {
    "deviceSelector": Struct("DeviceTaintSelector", {"driver": STRING, "pool": STRING, "device": STRING}),
    "taint": DEVICE_TAINT,
})
DEVICE_TAINT_RULE_STATUS = Struct("DeviceTaintRuleStatus", {"conditions": ListOf(CONDITION)})

OBJECTS: dict[str, Struct] = {
    "DeviceClass": Struct("DeviceClass", {**_TYPE_META, "spec": DEVICE_CLASS_SPEC}),
    "ResourceSlice": Struct("ResourceSlice", {**_TYPE_META, "spec": RESOURCE_SLICE_SPEC}),
    "ResourceClaim": Struct(
        "ResourceClaim", {**_TYPE_META, "spec": RESOURCE_CLAIM_SPEC, "status": RESOURCE_CLAIM_STATUS}
    ),
    "ResourceClaimTemplate": Struct("ResourceClaimTemplate", {
        **_TYPE_META,
        "spec": Struct("ResourceClaimTemplateSpec", {"metadata": OBJECT_META, "spec": RESOURCE_CLAIM_SPEC}),
    }),
    "DeviceTaintRule": Struct(
        "DeviceTaintRule", {**_TYPE_META, "spec": DEVICE_TAINT_RULE_SPEC, "status": DEVICE_TAINT_RULE_STATUS}
    ),
}

_JSON_TYPE = {"string": "a string", "integer": "an integer", "boolean": "true or false"}
_TIME = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$")


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def check_schema(raw: Any, schema: Any, path: str, findings: Findings) -> Any:
    """Report unknown fields and wrong types under `path`; return the value with those removed.

    A null anywhere means "unset", as in the apiserver's decoder. Returns None for a value that
    cannot be used at all.
    """
    if raw is None:
        return None
    if isinstance(schema, Scalar):
        return _check_scalar(raw, schema, path, findings)
    if isinstance(schema, ListOf):
        if not isinstance(raw, list):
            findings.add(path, WRONG_TYPE, f"must be a list, got {_type_name(raw)}",
                         fix=f"write {path.rsplit('.', 1)[-1]} as a YAML list (one '- ' entry per item)")
            return None
        out = []
        for index, item in enumerate(raw):
            checked = check_schema(item, schema.item, f"{path}[{index}]", findings)
            # Keep positions stable so later rules report the same indices the user wrote.
            out.append(checked)
        return out
    if isinstance(schema, MapOf):
        if not isinstance(raw, dict):
            findings.add(path, WRONG_TYPE, f"must be a mapping of names to values, got {_type_name(raw)}")
            return None
        out_map = {}
        for key, value in raw.items():
            if not isinstance(key, str):
                findings.add(f"{path}[{key}]", WRONG_TYPE, f"map keys must be strings, got {_type_name(key)}",
                             fix=f'quote the key: "{key}"')
                continue
            checked = check_schema(value, schema.value, f"{path}[{key}]", findings)
            if checked is not None:
                out_map[key] = checked
            elif value is None and isinstance(schema.value, Struct):
                out_map[key] = {}  # JSON null decodes to the zero struct, which is then validated
        return out_map
    assert isinstance(schema, Struct)
    if not isinstance(raw, dict):
        findings.add(path or "<root>", WRONG_TYPE, f"must be a mapping ({schema.name}), got {_type_name(raw)}")
        return None
    out_struct = {}
    for key, value in raw.items():
        child = _join(path, str(key))
        if key in schema.fields:
            checked = check_schema(value, schema.fields[key], child, findings)
            if checked is not None:
                out_struct[key] = checked
        elif key in schema.explained_elsewhere:
            continue
        else:
            findings.add(child, UNKNOWN_FIELD, _unknown_message(str(key), schema), fix=_unknown_fix(str(key), schema))
    return out_struct


def _check_scalar(raw: Any, schema: Scalar, path: str, findings: Findings) -> Any:
    kind = schema.type
    if kind == "any":
        return raw
    if kind == "string":
        if isinstance(raw, str):
            return raw
        fix = f'quote it: "{raw}"' if isinstance(raw, (int, float, bool)) else None
        if isinstance(raw, bool):
            fix = ('quote the value you meant, such as "n" or "on" (YAML 1.1, as kubectl reads it, takes unquoted '
                   'y, n, yes, no, on, off, true and false as booleans)')
        findings.add(path, WRONG_TYPE, f"must be a string, got {_type_name(raw)}", fix=fix)
        return None
    if kind == "integer":
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        fix = None
        if isinstance(raw, str) and re.fullmatch(r"[+-]?\d+", raw.strip()):
            fix = f"remove the quotes: {raw.strip()}"
        findings.add(path, WRONG_TYPE, f"must be an integer, got {_type_name(raw)}", fix=fix)
        return None
    if kind == "boolean":
        if isinstance(raw, bool):
            return raw
        fix = None
        if isinstance(raw, str) and raw.lower() in ("true", "false"):
            fix = f"remove the quotes: {raw.lower()}"
        findings.add(path, WRONG_TYPE, f"must be true or false, got {_type_name(raw)}", fix=fix)
        return None
    if kind == "quantity":
        if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):
            findings.add(path, WRONG_TYPE, f"must be a quantity such as \"80Gi\" or \"4\", got {_type_name(raw)}")
            return None
        text = raw if isinstance(raw, str) else str(raw)
        try:
            parse_quantity(text)
        except QuantityError:
            findings.add(
                path, WRONG_TYPE,
                f"{text!r} is not a quantity: write a number with an optional suffix, such as 80Gi, 500M, 1.5 or 100m",
                fix=_quantity_fix(text),
            )
            return None
        return text
    if kind == "time":
        if isinstance(raw, (datetime.date, datetime.datetime)):
            return raw.isoformat()  # YAML reads unquoted timestamps as datetimes
        if isinstance(raw, str) and _TIME.match(raw):
            return raw
        findings.add(path, WRONG_TYPE, f"must be an RFC 3339 time such as \"2026-01-01T00:00:00Z\", got {raw!r}")
        return None
    raise AssertionError(kind)


def _unknown_message(key: str, schema: Struct) -> str:
    return f"{schema.name} has no field {key!r}; the v1 apiserver rejects it (kubectl --validate=strict) or drops it"


def _unknown_fix(key: str, schema: Struct) -> str | None:
    close = difflib.get_close_matches(key, list(schema.fields), n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]!r}? Rename {key!r} to {close[0]!r}"
    known = ", ".join(sorted(schema.fields))
    return f"remove {key!r}; {schema.name} fields are: {known}"


_UNIT_SLIPS = re.compile(r"^\s*([+-]?[0-9.]+)\s*([KkMGTPE])(i?)[Bb]?\s*$")


def _quantity_fix(text: str) -> str | None:
    """80GB -> 80G or 80Gi, '10 Gi' -> 10Gi: units written the way people write them elsewhere."""
    match = _UNIT_SLIPS.match(text)
    if not match:
        return None
    number, prefix, binary = match.groups()
    prefix = "k" if prefix in "Kk" and not binary else prefix.upper()
    decimal, binary_form = f"{number}{prefix}", f"{number}{prefix.upper()}i"
    try:
        parse_quantity(decimal)
        parse_quantity(binary_form)
    except QuantityError:
        return None
    return f"value: {binary_form} (binary, 1024-based, as memory is usually meant) or {decimal} (decimal)"
