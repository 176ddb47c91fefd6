"""Validate DRA objects as the resource.k8s.io/v1 kube-apiserver would, and say how to fix them.

`validate_object(raw)` takes a decoded YAML/JSON mapping, so fields the typed models would silently
ignore (unknown fields, the v1beta1 request shape) are caught; `validate_typed(obj)` takes a decoded
msgspec model, for callers such as `draplane allocate` that have already decoded their input.
Both return a list of `Problem`s, empty when the object is valid.
"""

from __future__ import annotations

from typing import Any, Iterable

import msgspec

from draplane.validation.pod import check_pod
from draplane.validation.problem import NOT_AN_OBJECT, UNSUPPORTED, WRONG_TYPE, Findings, Problem
from draplane.validation.resource import (
    check_device_class,
    check_device_taint_rule,
    check_resource_claim,
    check_resource_claim_template,
    check_resource_slice,
)
from draplane.validation.schema import OBJECTS, check_schema

__all__ = ["Problem", "validate_object", "validate_objects", "validate_typed", "capacity_domains"]

DRA_API_VERSION = "resource.k8s.io/v1"
DRA_KINDS = tuple(OBJECTS)
CORE_KINDS = ("Pod", "Node")


def object_identity(raw: Any) -> tuple[str, str]:
    if not isinstance(raw, dict):
        return "<document>", ""
    kind = raw.get("kind") if isinstance(raw.get("kind"), str) and raw.get("kind") else "<object>"
    meta = raw.get("metadata") if isinstance(raw.get("metadata"), dict) else {}
    name = meta.get("name") or meta.get("generateName") or "<unnamed>"
    return kind, str(name)


def validate_object(raw: Any, *, source: str | None = None, domains: dict[str, list[str]] | None = None,
                    admin_access: bool = False) -> list[Problem]:
    """All problems the v1 apiserver would find in one decoded document.

    `domains` maps attribute/capacity names to the driver domains that publish them (see
    `capacity_domains`), so a fix for `device.capacity["memory"]` can name the real domain.
    `admin_access`: the claims' namespace carries the label resource.kubernetes.io/admin-access=true,
    without which the apiserver rejects `adminAccess: true`.
    """
    kind, name = object_identity(raw)
    findings = Findings(kind, name, source)
    if not isinstance(raw, dict):
        findings.add("", NOT_AN_OBJECT, f"the document is {_describe(raw)}, not a Kubernetes object (a mapping with "
                     "apiVersion, kind and metadata)")
        return findings.problems
    api_version = raw.get("apiVersion")
    if not raw.get("kind") or not isinstance(raw.get("kind"), str) or not api_version or not isinstance(api_version, str):
        missing = [k for k in ("apiVersion", "kind") if not raw.get(k) or not isinstance(raw.get(k), str)]
        findings.add(" and ".join(missing), NOT_AN_OBJECT,
                     f"the document has no {' or '.join(missing)}, so it is not a Kubernetes object",
                     fix="start it with apiVersion: resource.k8s.io/v1 and kind: ResourceClaim (or DeviceClass, "
                         "ResourceSlice, ResourceClaimTemplate)")
        return findings.problems
    if kind in DRA_KINDS:
        if api_version != DRA_API_VERSION:
            note = ""
            if api_version.startswith("resource.k8s.io/v1beta1") or api_version.startswith("resource.k8s.io/v1alpha"):
                note = (" (in v1 a request's deviceClassName, count and selectors move under `exactly:`, and a "
                        "device's `basic:` fields move up into the device)")
            findings.add("apiVersion", UNSUPPORTED, f"{api_version!r}: draplane checks {kind} as {DRA_API_VERSION}, the "
                         f"version Kubernetes 1.34+ serves and stores{note}", fix=f"apiVersion: {DRA_API_VERSION}")
            return findings.problems
        clean = check_schema(raw, OBJECTS[kind], "", findings) or {}
        if any(p.reason == WRONG_TYPE for p in findings.problems):
            # The apiserver cannot decode such an object, so it never validates it; the rules would
            # only repeat the same mistake as "required" or "invalid".
            return findings.problems
        if kind == "DeviceClass":
            check_device_class(clean, findings, domains or {})
        elif kind == "ResourceClaim":
            check_resource_claim(clean, raw, findings, domains or {}, admin_access)
        elif kind == "ResourceClaimTemplate":
            check_resource_claim_template(clean, raw, findings, domains or {}, admin_access)
        elif kind == "DeviceTaintRule":
            check_device_taint_rule(clean, findings)
        else:
            check_resource_slice(clean, raw, findings)
        return findings.problems
    if kind in CORE_KINDS and api_version == "v1":
        if kind == "Pod":
            check_pod(raw, findings)
        return findings.problems
    if not is_dra_group(api_version):
        # A manifest folder holds Namespaces, Deployments and the like next to DRA objects: they
        # are not ours to judge (see `skipped_kinds`), and a valid one is no problem.
        return findings.problems
    known = ", ".join(f"{k} ({DRA_API_VERSION})" for k in DRA_KINDS) + ", Pod (v1), Node (v1)"
    findings.add("kind", UNSUPPORTED, f"{api_version} {kind} is not an object draplane checks; it checks {known}",
                 fix="lint only DRA objects and the Pods and Nodes that use them")
    return findings.problems


def is_dra_group(api_version: str) -> bool:
    return api_version.split("/", 1)[0] == "resource.k8s.io" and "/" in api_version


def is_checked(raw: Any) -> bool:
    """Whether validate_object judges this document (DRA objects, Pods and Nodes, and anything
    malformed), rather than passing over a kind of another API group."""
    if not isinstance(raw, dict) or not isinstance(raw.get("apiVersion"), str) or not isinstance(raw.get("kind"), str):
        return True
    api_version, kind = raw["apiVersion"], raw["kind"]
    return is_dra_group(api_version) or (api_version == "v1" and kind in CORE_KINDS) or not kind or not api_version


ADMIN_ACCESS_LABEL = "resource.kubernetes.io/admin-access"


def admin_access_namespaces(raws: Iterable[Any]) -> set[str]:
    """Namespaces defined in the input with the label that allows adminAccess: true."""
    allowed = set()
    for raw in raws:
        if not isinstance(raw, dict) or raw.get("apiVersion") != "v1" or raw.get("kind") != "Namespace":
            continue
        meta = raw.get("metadata") if isinstance(raw.get("metadata"), dict) else {}
        labels = meta.get("labels") if isinstance(meta.get("labels"), dict) else {}
        if str(labels.get(ADMIN_ACCESS_LABEL, "")).lower() == "true" and isinstance(meta.get("name"), str):
            allowed.add(meta["name"])
    return allowed


def _namespace_of(raw: Any) -> str:
    meta = raw.get("metadata") if isinstance(raw, dict) and isinstance(raw.get("metadata"), dict) else {}
    namespace = meta.get("namespace")
    return namespace if isinstance(namespace, str) and namespace else "default"


def _describe(raw: Any) -> str:
    if isinstance(raw, list):
        return f"a list of {len(raw)} items"
    if isinstance(raw, str):
        return f"the text {raw[:40]!r}"
    return f"a {type(raw).__name__} ({raw!r})"


def capacity_domains(raws: Iterable[Any]) -> dict[str, list[str]]:
    """name -> driver domains, from the attributes and capacities of the ResourceSlices among `raws`."""
    domains: dict[str, list[str]] = {}
    for raw in raws:
        if not isinstance(raw, dict) or raw.get("kind") != "ResourceSlice" or not isinstance(raw.get("spec"), dict):
            continue
        driver = raw["spec"].get("driver")
        devices = raw["spec"].get("devices")
        if not isinstance(driver, str) or not isinstance(devices, list):
            continue
        for device in devices:
            if not isinstance(device, dict):
                continue
            for field in ("attributes", "capacity"):
                entries = device.get(field)
                if not isinstance(entries, dict):
                    continue
                for key in entries:
                    domain, _, name = str(key).rpartition("/")
                    domain = domain or driver
                    known = domains.setdefault(name, [])
                    if domain not in known:
                        known.append(domain)
    return domains


def validate_objects(documents: Iterable[tuple[str | None, Any]], *, admin_access: bool = False) -> list[Problem]:
    """Problems of several (source, raw) documents; slices among them inform the fixes of the others."""
    documents = list(documents)
    domains = capacity_domains(raw for _, raw in documents)
    # A Namespace in the same input, labeled for admin access, allows it for its claims, as the
    # apiserver would once the Namespace is applied first.
    admin_namespaces = admin_access_namespaces(raw for _, raw in documents)
    problems: list[Problem] = []
    for source, raw in documents:
        allowed = admin_access or _namespace_of(raw) in admin_namespaces
        problems.extend(validate_object(raw, source=source, domains=domains, admin_access=allowed))
    return problems


def validate_typed(obj: msgspec.Struct, *, source: str | None = None, admin_access: bool = False) -> list[Problem]:
    """Problems of an already-decoded model (unknown fields are gone by then; everything else is checked)."""
    return validate_object(msgspec.to_builtins(obj), source=source, admin_access=admin_access)
